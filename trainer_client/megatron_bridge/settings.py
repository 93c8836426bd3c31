"""The drop-in's settings: what Megatron-Bridge's own `ConfigContainer` says, plus the planner's own
(docs/megatron-bridge.md, "Settings: Bridge's own where it has them")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_planner.request import SchedulerKind
from trainer_client.refusals.compatibility import MEGATRON_SCHEDULER_NAMES, check, packing_scheduler_name
from trainer_client.service.config import ConfigError, PlannerClientConfig
from trainer_client.dropin.settings import given_planner_settings, planner_config, planner_settings_of
from trainer_client.megatron_bridge.refusals import BRIDGE_SCHEDULERS, SOURCE


@dataclass(frozen=True)
class BridgeSettings:
    """What the drop-in plans with, read once from Bridge's config and the planner settings."""

    scheduler: SchedulerKind
    planner: PlannerClientConfig
    model: Any  # cfg.model: Bridge's model provider, a Megatron-Core TransformerConfig

    @classmethod
    def of(cls, cfg: Any, planner: PlannerClientConfig | dict | None = None) -> BridgeSettings:
        given = given_planner_settings(planner)
        check({SOURCE: cfg})  # Bridge's rows (its scheduler and sizes among them), before they are read
        model = cfg.model
        scheduler = scheduler_of(model, given.get("scheduler"))
        cp_size = int(getattr(model, "context_parallel_size", 1) or 1)
        return cls(scheduler, planner_config(given, planner_settings_of(model, scheduler, cp_size), "Megatron"), model)


def scheduler_of(model: Any, given: Any = None) -> SchedulerKind:
    """The scheduler Bridge's config asks for: `model.sequence_packing_scheduler` (set by
    `model.dynamic_context_parallel=True` on the Megatron-LM dev build). A Megatron-Core release
    (0.19) has neither field: there the planner settings' `scheduler` says, dynamic CP by default.
    The refusal table refuses the others: the model field's other names before this is called, a
    scheduler Bridge's loop does not run (`refusals.BRIDGE_SCHEDULERS`) in `check_bridge_support`.
    A name that is no scheduler at all is refused here, with what the table allows."""
    if hasattr(model, "sequence_packing_scheduler"):
        return MEGATRON_SCHEDULER_NAMES[packing_scheduler_name(model)]
    if given is None:
        return SchedulerKind.DYNAMIC_CP
    try:
        return SchedulerKind(given)
    except ValueError:
        allowed = [kind.value for kind in BRIDGE_SCHEDULERS]
        raise ConfigError(f"scheduler: {given!r} is not allowed in Megatron-Bridge's drop-in; allowed: {allowed}") from None


def check_bridge_support(cfg: Any, settings: BridgeSettings) -> None:
    """The one call that refuses every combination the drop-in cannot honour in Bridge's loop, once, in
    `enable()`, before Bridge initialises anything (docs/megatron-bridge.md, "What is refused, before the first step")."""
    check({SOURCE: cfg, "transformer": cfg.model, "model": cfg.model, "planner config": settings.planner})
