"""The rows each DPxCP rank holds in each pass of a plan, and the plans the FP8 tests make: what
tests/trainer_client/transformer_engine/test_te_fp8_dynamic_cp.py runs on the GPU and
tests/trainer_client/megatron_lm/test_megatron_dropin_fp8_rows.py checks on the CPU (the same
lengths, the same settings, the same planner).

Under dynamic CP a pass of a CP group of size c runs one packed buffer, cut c ways: each of its
ranks holds the buffer's padded tokens / c rows, and Transformer Engine's FP8 GEMMs take them only
as a multiple of 16 on an H100 (batch_planner/precision.py, `ROW_RULES`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

from batch_planner.padding import group_padded_lengths
from batch_planner.plan import Plan

PLANNER = {"scheduler_implementation": "upstream"}  # in-process, Megatron-Core's own code (no compile per rank)
FP8_FORMAT = "hybrid"  # E4M3 forward, E5M2 gradients: what FP8 training runs
# Megatron-Core's fp8_recipe names of the two per-tensor recipes the test runs, by the test's name for them.
RECIPES = {"current": "tensorwise", "delayed": "delayed"}


def rank_rows(plan: Plan, lengths: Sequence[int], row_multiple: int) -> list[list[int]]:
    """rows[micro_batch][dp_cp_rank]: what each rank holds in each pass of `plan` (dynamic CP: each
    CP group's samples packed into one buffer), its samples of `lengths` (the dataset's padded
    lengths, by global id) padded by `group_padded_lengths` with `row_multiple` (1: the layout's
    rule alone, as in bf16; `rank_row_multiple(...)`: the precision's)."""
    out = []
    for micro_batch in plan.micro_batches:
        row = []
        for rank in range(plan.dp_cp_size):
            group = micro_batch.group_of_rank(rank)
            padded = group_padded_lengths([lengths[i] for i in group.sample_ids], group.size, plan.tensor_parallel_size,
                                          plan.cp_layout, plan.padding, plan.min_local_rows, row_multiple)
            row.append(sum(padded) // group.size)
        out.append(row)
    return out


def not_multiples(rows: list[list[int]], multiple: int) -> list[tuple[int, int, int]]:
    """(micro_batch, rank, rows) of every pass of `rows` whose rows are not a multiple of `multiple`."""
    return [(m, r, n) for m, per_rank in enumerate(rows) for r, n in enumerate(per_rank) if n % multiple]


def first_failure_is_shared(rows: list[list[int]], multiple: int) -> bool:
    """Whether the first pass in which any rank's rows are not a multiple of `multiple` holds the
    same rows on every rank (so every rank fails at the same GEMM of the same pass, and none waits
    in a collective for one that failed): what running a bf16 plan under delayed scaling needs,
    whose amax reduction spans every rank in every pass."""
    for per_rank in rows:
        if any(n % multiple for n in per_rank):
            return len(set(per_rank)) == 1
    return False


def model_settings(recipe: str | None, max_seqlen_per_dp_cp_rank: int) -> SimpleNamespace:
    """The fields of the GPU test's Megatron-Core TransformerConfig (tests/support/attention_model.py,
    the packing fields of tests/support/dropin_attention.packing_config) that the Megatron-LM
    drop-in plans from; `recipe`: Megatron-Core's fp8_recipe, None for bf16."""
    return SimpleNamespace(
        max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, tensor_model_parallel_size=1, context_parallel_size=2,
        sequence_packing_scheduler="default_dynamic_cp", min_dynamic_context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, cp_partition_mode="zigzag", sequence_parallel=False,
        fp8=None if recipe is None else FP8_FORMAT, fp8_recipe=recipe, calculate_per_token_loss=True,
    )


def drop_in_plan(config, lengths: Sequence[int], data_parallel_size: int, cp_size: int = 2) -> Plan:
    """The plan the Megatron-LM drop-in makes in process for a global batch of `lengths` (the
    dataset's padded lengths, in DP rank order) with `config`'s settings and PLANNER."""
    from batch_planner.planner import plan_batch
    from batch_planner.request import PlanningOptions, PlanRequest, SchedulerKind
    from trainer_client.megatron_lm.checks import megatron_planner_config

    settings = megatron_planner_config(config, SchedulerKind.DYNAMIC_CP, cp_size, PLANNER)
    request = PlanRequest(tuple(lengths), data_parallel_size, PlanningOptions.of(settings), settings.job)
    return plan_batch(request, implementation=settings.scheduler_implementation)
