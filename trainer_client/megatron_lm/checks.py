"""What Megatron-LM's drop-ins set up once, before the first step: the planner settings from the model's
config, the model checked against the refusal table's `megatron_lm` rows, and the read-ahead planner."""

from __future__ import annotations

from typing import Any, Callable

from batch_planner.request import SchedulerKind
from trainer_client.plans import megatron as mcore
from trainer_client.refusals.compatibility import check
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin.settings import given_planner_settings, planner_config, planner_settings_of
from trainer_client.dropin.step_input import LocalBatch
from trainer_client.dropin.step_planner import StepPlanner
from trainer_client.megatron_lm.refusals import SOURCE


def start_planner(
    read_local: Callable[[], LocalBatch], config: Any, scheduler: SchedulerKind, groups: mcore.DataGroups, planner: Any,
    gate: Callable[[], None] = lambda: None,
) -> StepPlanner:
    """The drop-in's read-ahead planner, after refusing a model its plans would train wrong on the
    installed Megatron-Core (RoPE or MTP on 0.19 with CP groups other than the static one), then
    `gate` (the drop-in's version gate: a build that lacks what it calls); a setting the user can
    change is named first."""
    settings = megatron_planner_config(config, scheduler, groups.dp_cp.size() // groups.dp.size(), planner)
    check_model(config, settings)
    gate()
    return StepPlanner.start(read_local, groups, settings, transformer_config=config)


def megatron_planner_config(config: Any, scheduler: SchedulerKind, cp_size: int, planner: Any = None) -> PlannerClientConfig:
    """The planner settings given (`planner=`, else `$BATCH_PLANNER_CONFIG`) with what the model's config fixes."""
    return planner_config(given_planner_settings(planner), planner_settings_of(config, scheduler, cp_size), "Megatron")


def check_model(config: Any, settings: PlannerClientConfig) -> None:
    """UnsupportedCombinationError for a model the drop-in's plans would train wrong (the `megatron_lm` rows)."""
    check({SOURCE: {name: model_setting(config, name) for name in MODEL_SETTINGS}, "planner config": settings})


# The model's settings the `megatron_lm` rows read.
MODEL_SETTINGS = ("position_embedding_type", "mtp_num_layers")


def model_setting(config: Any, name: str) -> Any:
    """A model setting: the config's own attribute where it has one, else Megatron-LM's argument of
    that name (its training loop's parsed arguments, e.g. `--position-embedding-type`); None where
    neither is known."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    try:
        from megatron.training.global_vars import get_args
    except ImportError:  # Megatron-Core alone, without Megatron-LM's training package
        return None
    try:
        return getattr(get_args(), name, None)
    except AssertionError:  # Megatron-LM's arguments are not parsed in this process
        return None
