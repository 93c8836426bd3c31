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

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.compatibility import UnsupportedCombinationError, check_dynamic_cp_support


@dataclass(frozen=True)
class BridgeRule:
    """`path` (attribute path in Bridge's ConfigContainer) is refused when `refused(value)`."""

    path: str
    when: str  # the condition in words, as docs/megatron-bridge.md shows it
    fix: str
    refused: Callable[[Any], bool]


def _above_one(value: Any) -> bool:
    return (value or 1) > 1


ROPE_FAMILY = ("rope", "mrope", "yarn")

BRIDGE_RULES: tuple[BridgeRule, ...] = (
    BridgeRule("model.virtual_pipeline_model_parallel_size", "> 1",
               "the drop-in hands Bridge one iterator of planned micro-batches, not one per virtual pipeline "
               "stage; unset virtual pipeline parallelism", _above_one),
    BridgeRule("model.pipeline_model_parallel_size", "> 1",
               "the drop-in plans for pipeline parallelism 1 (Bridge's middle stages read other fields); set "
               "pipeline_model_parallel_size=1", _above_one),
    BridgeRule("dataset.dataloader_type", "'batch' or 'external'",
               "'batch' re-batches each step after the plan is made (prepare_finetuning_batch), 'external' hands "
               "over a list of iterators; use dataloader_type='single' (or 'cyclic')", lambda v: v in ("batch", "external")),
    BridgeRule("dataset.skip_getting_attention_mask_from_dataset", "false",
               "the dataset's own attention mask does not travel into packed THD micro-batches (THD attention "
               "reads cu_seqlens); pack documents with cu_seqlens and leave it True", lambda v: v is False),
    BridgeRule("train.rampup_batch_size", "set",
               "the drop-in reads one global batch ahead with the micro-batch count in force; batch-size ramp-up "
               "changes it between steps: unset rampup_batch_size", bool),
    BridgeRule("train.iterations_to_skip", "set",
               "a skipped iteration reads its micro-batches past the drop-in, which has read that step ahead "
               "already; unset iterations_to_skip", bool),
    BridgeRule("ddp.use_megatron_fsdp", "true",
               "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP or the distributed optimizer", bool),
    BridgeRule("dist.use_megatron_fsdp", "true",
               "Megatron-Core's dynamic CP does not support Megatron FSDP (Bridge copies this to ddp later); use "
               "DDP or the distributed optimizer", bool),
    BridgeRule("model.mtp_num_layers", "set",
               "multi-token prediction is not planned by the drop-in; unset mtp_num_layers", bool),
    BridgeRule("model.is_hybrid_model", "true",
               "hybrid (Mamba) models need per-sequence state indices the planned THD micro-batches do not carry; "
               "use a transformer model", bool),
    BridgeRule("model.moe_expert_rank_capacity_factor", "set",
               "Bridge then re-runs iterations through PagedStashRunner, around the planned schedule; unset "
               "moe_expert_rank_capacity_factor", lambda v: v is not None),
    BridgeRule("model.overlap_moe_expert_parallel_comm", "true",
               "Bridge's forward step then builds a schedule plan without the micro-batch's PackedSeqParams; unset "
               "overlap_moe_expert_parallel_comm", bool),
    BridgeRule("dist.use_decentralized_pg", "true",
               "dynamic CP runs on parallel_state's per-size DPxCP groups, which decentralized process groups "
               "do not build; set use_decentralized_pg=False", bool),
    BridgeRule("model.dynamic_context_parallel", "false on a Megatron-Core with dynamic CP groups",
               "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; set "
               "cfg.model.dynamic_context_parallel=True", lambda v: v is False),
    BridgeRule("model.hybrid_context_parallel", "false on a Megatron-Core release (0.19)",
               "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; on 0.19 set "
               "cfg.model.hybrid_context_parallel=True (the plans still come from dynamic CP)", lambda v: v is False),
    BridgeRule("model.position_embedding_type", "rope, mrope or yarn on a Megatron-Core release (0.19)",
               "0.19's attention rotates THD input over the static CP group (transformer/attention.py), not the "
               "micro-batch's, so positions are wrong in CP groups of another size; run the trainer on the "
               "Megatron-LM dev build (it rotates over the micro-batch's group)", lambda v: v in ROPE_FAMILY),
)

# Rules for one of the two builds: the dev build has model.dynamic_context_parallel, 0.19 has not.
_RELEASE_ONLY = ("model.hybrid_context_parallel", "model.position_embedding_type")
_GROUP_RULES = ("model.dynamic_context_parallel", "model.hybrid_context_parallel")


def check_bridge_support(cfg: Any, settings: Any) -> None:
    """Raises UnsupportedCombinationError for the first combination the drop-in cannot run:
    Bridge's rows first (they name Bridge's settings), then the rules every dynamic-CP trainer shares."""
    for rule in BRIDGE_RULES:
        value = _read(cfg, rule)
        if value is _ABSENT or not rule.refused(value):
            continue
        if rule.path in _RELEASE_ONLY and hasattr(cfg.model, "dynamic_context_parallel"):
            continue  # the dev build
        if rule.path in _GROUP_RULES and settings.scheduler is not SchedulerKind.DYNAMIC_CP:
            continue  # static packing runs on the static CP group
        raise UnsupportedCombinationError(rule.path, value, rule.fix)
    release = not hasattr(cfg.model, "dynamic_context_parallel")
    if release and settings.planner.cp_layout is CpLayout.CONTIGUOUS:
        raise UnsupportedCombinationError(
            "cp_layout", settings.planner.cp_layout.value,
            "0.19's PackedSeqParams has no cp_partition_mode, so its attention takes every CP shard as zigzag; "
            "set cp_layout=zigzag in the planner settings",
        )
    check_dynamic_cp_support(transformer_config=cfg.model, model_config=cfg.model, planner_config=settings.planner)


_ABSENT = object()


def _read(cfg: Any, rule: BridgeRule) -> Any:
    """The value at `rule.path`; `_ABSENT` when Bridge's config (or this build) has no such field."""
    value: Any = cfg
    for name in rule.path.split("."):
        value = getattr(value, name, _ABSENT) if value is not None else _ABSENT
        if value is _ABSENT:
            return _ABSENT
    return value
