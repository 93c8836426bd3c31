"""The planner settings of a verl job, from `$BATCH_PLANNER_CONFIG` and `$BATCH_PLANNER_ENDPOINT` (which
wins over the file's endpoint), and the engine's sizes (docs/verl.md, "Planner settings").
"""

from __future__ import annotations

import os
from typing import Any

from batch_planner.request import CpLayout, PaddingRule, SchedulerKind
from trainer_client.config import ConfigError, PlannerClientConfig
from trainer_client.dropin.settings import CONFIG_ENV, given_planner_settings, merged_settings

ENDPOINT_ENV = "BATCH_PLANNER_ENDPOINT"
# Of the service's schedulers only dynamic CP plans for verl's engine (docs/verl.md, "Which schedulers").
VERL_SCHEDULERS = (SchedulerKind.DYNAMIC_CP,)
_ALLOWED = (SchedulerKind.DYNAMIC_CP, SchedulerKind.AUTO)


def planner_settings() -> dict[str, Any]:
    """The settings the environment names (`$BATCH_PLANNER_ENDPOINT` wins over the file's endpoint)."""
    given = given_planner_settings(None) if os.environ.get(CONFIG_ENV) else {}
    endpoint = os.environ.get(ENDPOINT_ENV, "").strip()
    if endpoint:
        given["planner_endpoint"] = endpoint
    return given


def verl_planner_config(
    settings: dict[str, Any],
    *,
    max_seqlen_per_dp_cp_rank: int,
    cp_size: int,
    tp_size: int,
    cp_layout: CpLayout,
    min_local_rows: int | None = None,
) -> PlannerClientConfig:
    """The client config for one of verl's schedule calls: the settings plus the engine's sizes;
    scheduler dynamic_cp (verl's own) unless the settings say auto, whose candidates are then
    restricted to dynamic CP through `auto_schedulers`."""
    derived = {
        "max_seqlen_per_dp_cp_rank": max_seqlen_per_dp_cp_rank,
        "context_parallel_size": cp_size,
        "tensor_parallel_size": tp_size,
        "cp_layout": cp_layout.value,
        # verl pads as its preprocess_thd_engine does (batch_planner/padding.py), so the plan counts it.
        "padding": PaddingRule.VERL.value,
        "min_local_rows": min_local_rows,
    }
    values = merged_settings(settings, derived, "verl's engine")
    scheduler = values.setdefault("scheduler", SchedulerKind.DYNAMIC_CP.value)
    if getattr(scheduler, "value", scheduler) not in [k.value for k in _ALLOWED]:
        raise ConfigError(
            f"scheduler: {scheduler!r} is not allowed for verl's engine; allowed: {[k.value for k in _ALLOWED]} "
            "(verl's engine runs the dynamic-CP contract, docs/verl.md)"
        )
    wanted = values.get("auto_schedulers") or ()
    other = [name for name in (getattr(k, "value", k) for k in wanted) if name not in [k.value for k in VERL_SCHEDULERS]]
    if other:
        raise ConfigError(
            f"auto_schedulers: {other} is not allowed for verl's engine; allowed: {[k.value for k in VERL_SCHEDULERS]}"
        )
    auto = getattr(scheduler, "value", scheduler) == SchedulerKind.AUTO.value
    values["auto_schedulers"] = [k.value for k in VERL_SCHEDULERS] if auto else []
    return PlannerClientConfig.from_dict(values)
