"""Megatron-Bridge's part of the refusal table (docs/megatron-bridge.md, "What is refused, before the
first step"): its rows, which read Bridge's `ConfigContainer` (the `bridge` source) or need it, and its
paths of the core's settings. Registered with the drop-in (trainer_client/megatron_bridge/__init__.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

from batch_planner.request import SchedulerKind
from trainer_client.refusals.compatibility import (
    ABSENT, MEGATRON_SCHEDULER_NAMES, PACKING_SCHEDULERS, Inputs, Place, Rule, TableSource, is_false, is_set, kind_name,
    layout_name, packing_scheduler_name,
)

SOURCE = "bridge"
# Bridge's loop runs one packed forward pass per planned micro-batch: the packing schedulers only
# (the one home of this allow-list; the scheduler row below refuses the others).
BRIDGE_SCHEDULERS = PACKING_SCHEDULERS

_bridge = partial(Place, SOURCE)
_NO_DPXCP_GROUPS = "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; "


def _scheduler_name(inputs: Inputs) -> Any:
    model = inputs.at(_bridge("model"))
    return packing_scheduler_name(model) if hasattr(model, "sequence_packing_scheduler") else ABSENT


ROWS = (
    Rule(Place("planner config", "cp_layout"), "'contiguous'",
         "0.19's PackedSeqParams has no cp_partition_mode, so its attention takes every CP shard as zigzag; "
         "set cp_layout=zigzag in the planner settings",
         lambda v, _: v == "contiguous", read=layout_name, needs=(SOURCE,), build="release"),
    Rule(_bridge("model.pipeline_model_parallel_size"), "> 2",
         "Bridge builds data iterators on the first and last pipeline stages only "
         "(data/utils.is_dataset_built_on_rank), so a middle stage cannot read the step it must plan and "
         "agree on; set pipeline_model_parallel_size to 1 or 2", lambda v, _: (v or 1) > 2),
    Rule(_bridge("dataset.dataloader_type"), "'batch' or 'external'",
         "'batch' re-batches each step after the plan is made (prepare_finetuning_batch), 'external' hands "
         "over a list of iterators; use dataloader_type='single' (or 'cyclic')", lambda v, _: v in ("batch", "external")),
    Rule(_bridge("dataset.skip_getting_attention_mask_from_dataset"), "false",
         "the dataset's own attention mask does not travel into packed THD micro-batches (THD attention "
         "reads cu_seqlens); pack documents with cu_seqlens and leave it True", is_false),
    Rule(_bridge("train.iterations_to_skip"), "set",
         "a skipped iteration reads its micro-batches past the drop-in, which has read that step ahead "
         "already; unset iterations_to_skip", is_set),
    Rule(_bridge("model.is_hybrid_model"), "true",
         "hybrid (Mamba) models need per-sequence state indices the planned THD micro-batches do not carry; "
         "use a transformer model", is_set),
    Rule(_bridge("model.moe_expert_rank_capacity_factor"), "set",
         "Bridge then re-runs iterations through PagedStashRunner, around the planned schedule; unset "
         "moe_expert_rank_capacity_factor", lambda v, _: v is not None),
    Rule(_bridge("model.overlap_moe_expert_parallel_comm"), "true",
         "Bridge's forward step then builds a schedule plan without the micro-batch's PackedSeqParams; unset "
         "overlap_moe_expert_parallel_comm", is_set),
    Rule(_bridge("dist.use_decentralized_pg"), "true",
         "dynamic CP runs on parallel_state's per-size DPxCP groups, which decentralized process groups "
         "do not build; set use_decentralized_pg=False", is_set),
    Rule(_bridge("model.dynamic_context_parallel"), "false",
         _NO_DPXCP_GROUPS + "set cfg.model.dynamic_context_parallel=True", is_false,
         build="dev", schedulers=(SchedulerKind.DYNAMIC_CP,)),
    Rule(_bridge("model.hybrid_context_parallel"), "false",
         _NO_DPXCP_GROUPS + "on 0.19 set cfg.model.hybrid_context_parallel=True (the plans still come from dynamic CP)",
         is_false, build="release", schedulers=(SchedulerKind.DYNAMIC_CP,)),
    Rule(_bridge("model.sequence_packing_scheduler"), "not one of " + ", ".join(map(repr, MEGATRON_SCHEDULER_NAMES)),
         "the drop-in plans with Megatron-Core's packing schedulers: set cfg.model.dynamic_context_parallel=True "
         "(dynamic CP) or cfg.model.sequence_packing_scheduler='dp_balanced' (static packing)",
         lambda v, _: v is not ABSENT and v not in MEGATRON_SCHEDULER_NAMES, read=_scheduler_name),
    Rule(Place("planner config", "scheduler"), "not " + " or ".join(k.value for k in BRIDGE_SCHEDULERS), "each planned micro-batch is one "
         "packed forward pass of Bridge's loop: set scheduler to " + " or ".join(k.value for k in BRIDGE_SCHEDULERS) + " in the planner "
         "settings (a Megatron-Core release has no sequence_packing_scheduler to say it)",
         lambda v, _: v is not None and kind_name(v) not in [k.value for k in BRIDGE_SCHEDULERS], needs=(SOURCE,)),
    Rule(_bridge("model.max_seqlen_per_dp_cp_rank"), "not set",
         "dynamic CP plans each rank's tokens against it: set cfg.model.max_seqlen_per_dp_cp_rank "
         "(e.g. seq_length // context_parallel_size)", lambda v, _: v is None),
)

REFUSALS = TableSource(SOURCE, "Megatron-Bridge's drop-in", ROWS, places={
    "use_megatron_fsdp": ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp"),
    "batch_size_rampup": ("train.rampup_batch_size",),
    "position_embedding_type": ("model.position_embedding_type",),
    "mtp_num_layers": ("model.mtp_num_layers",),
})
