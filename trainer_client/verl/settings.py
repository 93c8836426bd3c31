"""The planner settings of a verl job, from `$BATCH_PLANNER_CONFIG` and `$BATCH_PLANNER_ENDPOINT` (which
wins over the file's endpoint), read once, and the engine's sizes (docs/verl.md, "Planner settings").
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from batch_planner.request import CpLayout, PaddingRule, SchedulerKind
from trainer_client.refusals.compatibility import check
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin.derived import DerivedSettings
from trainer_client.dropin.settings import CONFIG_ENV, given_planner_settings, merged_settings
from trainer_client.verl.refusals import SOURCE, VERL_SCHEDULERS

ENDPOINT_ENV = "BATCH_PLANNER_ENDPOINT"


def planner_settings() -> dict[str, Any]:
    """The settings the environment names (`$BATCH_PLANNER_ENDPOINT` wins over the file's endpoint);
    the file is read once per path (verl builds a scheduler for every forward/backward call)."""
    return dict(_settings(os.environ.get(CONFIG_ENV) or None, os.environ.get(ENDPOINT_ENV, "").strip()))


@functools.lru_cache(maxsize=8)
def _settings(path: str | None, endpoint: str) -> tuple[tuple[str, Any], ...]:
    given = given_planner_settings(None) if path else {}
    if endpoint:
        given["planner_endpoint"] = endpoint
    return tuple(given.items())


def verl_planner_config(
    settings: dict[str, Any],
    *,
    max_seqlen_per_dp_cp_rank: int,
    cp_size: int,
    tp_size: int,
    cp_layout: CpLayout,
    min_local_rows: int | None = None,
) -> PlannerClientConfig:
    """The client config for one of verl's schedule calls: the settings plus the engine's sizes,
    checked against the refusal table's verl rows; scheduler dynamic_cp (verl's own) unless the
    settings say auto, whose candidates are then restricted to dynamic CP through `auto_schedulers`."""
    derived = verl_settings(max_seqlen_per_dp_cp_rank, cp_size, tp_size, cp_layout, min_local_rows)
    values = merged_settings(settings, derived, "verl's engine")
    values.setdefault("scheduler", SchedulerKind.DYNAMIC_CP.value)
    config = PlannerClientConfig.from_dict(values)
    check({SOURCE: derived, "planner config": config})
    auto = config.scheduler is SchedulerKind.AUTO
    return dataclasses.replace(config, auto_schedulers=tuple(VERL_SCHEDULERS) if auto else ())


def verl_settings(max_seqlen_per_dp_cp_rank: int, cp_size: int, tp_size: int, cp_layout: CpLayout,
                  min_local_rows: int | None = None) -> DerivedSettings:
    """What verl's engine fixes of the planner settings: its sizes and layout, and verl's padding (as its
    preprocess_thd_engine pads, batch_planner/padding.py, so that the plan counts it) with its top-up."""
    return DerivedSettings(max_seqlen_per_dp_cp_rank, cp_size, tp_size, padding=PaddingRule.VERL, min_local_rows=min_local_rows,
                           cp_layout=cp_layout)
