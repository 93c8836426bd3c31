"""The one function that refuses every combination the drop-in cannot honour in Bridge's loop.

`check_bridge_support(cfg, settings)` runs once, in `enable()`, before Bridge initialises anything:
no refusal ever comes halfway through training. It applies `BRIDGE_RULES`, the rows that come from
Bridge's own loop, then the rules every dynamic-CP trainer shares (trainer_client/compatibility.py:
per-token loss, CUDA graphs, FP8, the planner's sizes against the model's, ...) to Bridge's model
config. Each refusal is an `UnsupportedCombinationError` naming the
setting by its path in Bridge's `ConfigContainer`, its value and what to do; docs/megatron-bridge.md
lists the same rows (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from batch_planner.request import SchedulerKind
from trainer_client.compatibility import UnsupportedCombinationError, check_dynamic_cp_support


@dataclass(frozen=True)
class BridgeRule:
    """`path` (attribute path in Bridge's ConfigContainer) is refused when `refused(value)`."""

    path: str
    when: str  # the condition in words, as docs/megatron-bridge.md shows it
    fix: str
    refused: Callable[[Any], bool]
    default: Any = None


def _set(value: Any) -> bool:
    return bool(value)


def _above_one(value: Any) -> bool:
    return (value or 1) > 1


BRIDGE_RULES: tuple[BridgeRule, ...] = (
    BridgeRule("model.virtual_pipeline_model_parallel_size", "> 1",
               "the drop-in hands Bridge one iterator of planned micro-batches, not one per virtual pipeline "
               "stage; unset virtual pipeline parallelism", _above_one),
    BridgeRule("model.pipeline_model_parallel_size", "> 1",
               "the drop-in plans for pipeline parallelism 1 (Bridge's middle stages read other fields); set "
               "pipeline_model_parallel_size=1", _above_one, default=1),
    BridgeRule("dataset.dataloader_type", "'batch'",
               "Bridge's finetuning path re-batches each step (prepare_finetuning_batch) after the plan is made; "
               "use dataloader_type='single' (or 'cyclic')", lambda v: v == "batch"),
    BridgeRule("train.rampup_batch_size", "set",
               "the drop-in reads one global batch ahead with the micro-batch count in force; batch-size ramp-up "
               "changes it between steps: unset rampup_batch_size", _set),
    BridgeRule("ddp.use_megatron_fsdp", "true",
               "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP or the distributed optimizer", _set),
    BridgeRule("optimizer.optimizer_cuda_graph", "true",
               "Megatron-Core does not support CUDA graphs with dynamic CP; set optimizer_cuda_graph=False", _set),
    BridgeRule("model.mtp_num_layers", "set",
               "multi-token prediction is not planned by the drop-in; unset mtp_num_layers", _set),
    BridgeRule("model.is_hybrid_model", "true",
               "hybrid (Mamba) models need per-sequence state indices the planned THD micro-batches do not carry; "
               "use a transformer model", _set),
    BridgeRule("model.moe_expert_rank_capacity_factor", "set",
               "Bridge then re-runs iterations through PagedStashRunner, around the planned schedule; unset "
               "moe_expert_rank_capacity_factor", lambda v: v is not None),
    BridgeRule("dist.use_decentralized_pg", "true",
               "dynamic CP runs on parallel_state's per-size DPxCP groups, which decentralized process groups "
               "do not build; set use_decentralized_pg=False", _set),
    BridgeRule("model.dynamic_context_parallel", "false on a Megatron-Core with dynamic CP groups",
               "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; set "
               "cfg.model.dynamic_context_parallel=True", lambda v: v is False),
    BridgeRule("model.hybrid_context_parallel", "false on a Megatron-Core release (0.19)",
               "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; on 0.19 set "
               "cfg.model.hybrid_context_parallel=True (the plans still come from dynamic CP)", lambda v: v is False),
)

# The two group rules read only the field the installed Megatron-Core has.
_GROUP_RULES = ("model.dynamic_context_parallel", "model.hybrid_context_parallel")


def check_bridge_support(cfg: Any, settings: Any) -> None:
    """Raises UnsupportedCombinationError for the first combination the drop-in cannot run:
    Bridge's rows first (they name Bridge's settings), then the rules every dynamic-CP trainer shares."""
    for rule in BRIDGE_RULES:
        value = _read(cfg, rule)
        if value is _ABSENT or not rule.refused(value):
            continue
        if rule.path == "model.hybrid_context_parallel" and hasattr(cfg.model, "dynamic_context_parallel"):
            continue  # the dev build: its dynamic_context_parallel rule decides
        if rule.path in _GROUP_RULES and settings.scheduler is not SchedulerKind.DYNAMIC_CP:
            continue  # static packing runs on the static CP group
        raise UnsupportedCombinationError(rule.path, value, rule.fix)
    check_dynamic_cp_support(transformer_config=cfg.model, planner_config=settings.planner)


_ABSENT = object()


def _read(cfg: Any, rule: BridgeRule) -> Any:
    """The value at `rule.path`; `_ABSENT` when Bridge's config has no such field, except where the
    rule has a default (a field every build has)."""
    value: Any = cfg
    for name in rule.path.split("."):
        value = getattr(value, name, _ABSENT) if value is not None else _ABSENT
        if value is _ABSENT:
            return rule.default if rule.default is not None else _ABSENT
    return value
