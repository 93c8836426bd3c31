"""The drop-in's settings: what Megatron-Bridge's own `ConfigContainer` says, plus the planner's own
(docs/megatron-bridge.md, "Settings: Bridge's own where it has them")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_planner.request import SchedulerKind
from trainer_client.config import ConfigError, PlannerClientConfig
from trainer_client.dropin.settings import PACKING_SCHEDULERS, given_planner_settings, planner_config_for

# The schedulers whose plans the drop-in runs: both pack a CP group's samples into one THD
# micro-batch, so each planned micro-batch is one forward pass on every rank.
BRIDGE_SCHEDULERS = tuple(PACKING_SCHEDULERS.values())


@dataclass(frozen=True)
class BridgeSettings:
    """What the drop-in plans with, read once from Bridge's config and the planner settings."""

    scheduler: SchedulerKind
    planner: PlannerClientConfig
    model: Any  # cfg.model: Bridge's model provider, a Megatron-Core TransformerConfig

    @classmethod
    def of(cls, cfg: Any, planner: PlannerClientConfig | dict | None = None) -> BridgeSettings:
        model = cfg.model
        given = given_planner_settings(planner)
        scheduler = scheduler_of(model, given.get("scheduler"))
        if getattr(model, "max_seqlen_per_dp_cp_rank", None) is None:
            raise ConfigError(
                "model.max_seqlen_per_dp_cp_rank: not set; dynamic CP plans each rank's tokens against it: set "
                "cfg.model.max_seqlen_per_dp_cp_rank (e.g. seq_length // context_parallel_size)"
            )
        cp_size = int(getattr(model, "context_parallel_size", 1) or 1)
        return cls(scheduler, planner_config_for(model, scheduler, cp_size, given), model)


def scheduler_of(model: Any, given: Any = None) -> SchedulerKind:
    """The scheduler Bridge's config asks for: `model.sequence_packing_scheduler` (set by
    `model.dynamic_context_parallel=True` on the Megatron-LM dev build). A Megatron-Core release
    (0.19) has neither field: there the planner settings' `scheduler` says, dynamic CP by default."""
    if not hasattr(model, "sequence_packing_scheduler"):
        kind = SchedulerKind(given) if given is not None else SchedulerKind.DYNAMIC_CP
        if kind not in BRIDGE_SCHEDULERS:
            raise ConfigError(
                f"scheduler: {kind.value!r} is not one the Bridge drop-in runs; allowed: "
                f"{[k.value for k in BRIDGE_SCHEDULERS]} (each planned micro-batch is one packed forward pass)"
            )
        return kind
    name = model.sequence_packing_scheduler
    if name is None and getattr(model, "dynamic_context_parallel", False):
        name = "default_dynamic_cp"
    if name not in PACKING_SCHEDULERS:
        raise ConfigError(
            f"model.sequence_packing_scheduler: {name!r}; the drop-in plans with "
            f"{sorted(PACKING_SCHEDULERS)}: set cfg.model.dynamic_context_parallel=True (dynamic CP) or "
            "cfg.model.sequence_packing_scheduler='dp_balanced' (static packing)"
        )
    return PACKING_SCHEDULERS[name]
