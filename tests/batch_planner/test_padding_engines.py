"""Padding the engine accepts, and shards the engine cuts (batch_planner/padding.py, shards.py),
as properties over odd lengths, CP 1-8, TP 1-2, both layouts, both padding rules and verl's
`min_local_rows` (docs/design.md, "Padding, layouts and statistics").

The engines, by the drop-ins that feed them:
- Megatron-Core's rule (the Megatron-LM and Bridge drop-ins, the client's own micro-batches): on a
  CP group Megatron-Core's dev attention reads zigzag, Transformer Engine cutting every sequence into
  2 x CP chunks, and converts contiguous input to zigzag first; the oracle is Megatron-Core's own
  check (`context_parallel_layout/routes.py`, `_validate_thd_route_partitioning`); sequence
  parallelism splits each rank's rows over TP.
- verl's rule (the verl drop-in, which must equal verl's preprocessing): zigzag goes to Transformer
  Engine as above; contiguous to attention that reads contiguous shards itself (verl picks it for
  DeepSeek-V4's), which needs the buffer to split into CP equal intervals of whole TP multiples.
  Where verl's own `min_local_rows` top-up cannot keep a zigzag sequence a multiple of 2 x CP, the
  refusal table refuses the combination before the first step (trainer_client/refusals/compatibility.py).

Every shard equals the one Megatron-Core's own layout code cuts (`_build_thd_layout_segments`, the
route it converts between layouts with; for zigzag the DualChunkSwap rows Transformer Engine's
`thd_get_partitioned_indices` returns, tests/trainer_client/transformer_engine ties the two on a GPU). The verl
leg compares verl's rule with verl's own code (tests/trainer_client/verl/test_verl_contract.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batch_planner.errors import BatchNotPlannableError
from batch_planner.padding import group_padded_lengths
from batch_planner.request import CpLayout, PaddingRule
from batch_planner.shards import padded_unit_shard
from trainer_client.refusals.compatibility import check
from trainer_client.service.config import PlannerClientConfig
from trainer_client.errors import UnsupportedCombinationError

routes = pytest.importorskip(
    "megatron.core.context_parallel_layout.routes",
    reason="Megatron-Core's THD layout code (context_parallel_layout/routes.py) is in the Megatron-LM dev build only",
)

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=6)
units = st.tuples(lengths_st, st.integers(1, 8), st.sampled_from([1, 2]), st.sampled_from(list(CpLayout)),
                  st.sampled_from(list(PaddingRule)), st.one_of(st.none(), st.integers(1, 64)))


def _cu(padded: list[int]) -> list[int]:
    return [0, *itertools.accumulate(padded)]


def engine_refusal(padded: list[int], cp: int, tp: int, layout: CpLayout, rule: PaddingRule) -> str | None:
    """Why the engine that takes this layout under this rule refuses these padded lengths, or None."""
    total = sum(padded)
    if total % cp or (total // cp) % tp:
        return f"{total} rows do not split into {cp} ranks of whole multiples of TP {tp}"
    if cp == 1 or (rule is PaddingRule.VERL and layout is CpLayout.CONTIGUOUS):
        return None  # no CP split / attention that reads contiguous intervals itself
    try:
        routes._validate_thd_route_partitioning(_cu(padded), cp)
    except ValueError as error:
        return str(error)
    return None


def refused_by_the_table(cp_layout: CpLayout, tp: int, min_local_rows: int | None) -> UnsupportedCombinationError | None:
    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=64, cp_layout=cp_layout, tensor_parallel_size=tp,
                                 padding=PaddingRule.VERL, min_local_rows=min_local_rows)
    try:
        check({"planner config": config})
    except UnsupportedCombinationError as error:
        return error
    return None


@settings(max_examples=600, deadline=None)
@given(units)
def test_every_padded_length_is_one_the_engine_accepts(unit):
    lengths, cp, tp, layout, rule, min_local_rows = unit
    if rule is PaddingRule.MEGATRON_CORE:
        min_local_rows = None  # verl's alone
    padded = group_padded_lengths(lengths, cp, tp, layout, rule, min_local_rows)
    assert all(p >= n for p, n in zip(padded, lengths)) and len(padded) == len(lengths)
    problem = engine_refusal(padded, cp, tp, layout, rule)
    if problem is not None:
        # Only verl's min_local_rows top-up can get here, and the refusal table stops it first.
        assert rule is PaddingRule.VERL and min_local_rows is not None, (unit, padded, problem)
        refusal = refused_by_the_table(layout, tp, min_local_rows)
        assert refusal is not None and refusal.option == "min_local_rows", (unit, padded, problem)


@settings(max_examples=600, deadline=None)
@given(units)
def test_every_shard_is_the_one_megatron_core_cuts(unit):
    lengths, cp, tp, layout, rule, min_local_rows = unit
    if rule is PaddingRule.MEGATRON_CORE or refused_by_the_table(layout, tp, min_local_rows) is not None:
        min_local_rows = None
    padded = group_padded_lengths(lengths, cp, tp, layout, rule, min_local_rows)
    for rank in range(cp):
        assert our_shard_rows(padded, cp, rank, layout) == megatron_core_shard_rows(padded, cp, rank, layout), (unit, padded, rank)


def our_shard_rows(padded: list[int], cp: int, rank: int, layout: CpLayout) -> list[int]:
    """The buffer's rows rank `rank` of `cp` holds, in order, as batch_planner/shards.py cuts them."""
    starts = _cu(padded)
    return [starts[r.index] + row for r in padded_unit_shard(padded, cp, rank, layout) for row in range(r.start, r.stop)]


def megatron_core_shard_rows(padded: list[int], cp: int, rank: int, layout: CpLayout) -> list[int]:
    """The same, as Megatron-Core's own layout code cuts them (`_build_thd_layout_segments`); all rows at CP1."""
    if cp == 1:
        return list(range(sum(padded)))  # Megatron-Core slices nothing at CP1
    segments, local_rows = routes._build_thd_layout_segments(_cu(padded), cp, rank, layout.value)
    rows = [row for start, count, _ in sorted(segments, key=lambda s: s[2]) for row in range(start, start + count)]
    assert len(rows) == local_rows
    return rows


def test_the_planted_contiguous_padding_of_cp_times_tp_is_one_megatron_core_refuses():
    """The padding the contiguous layout had before (a multiple of CP x TP, batch_planner/padding.py's
    history): Megatron-Core's own check refuses it, as the issue's example shows."""
    padded = [256, 146, 1260]  # lengths [255, 146, 1259] padded to multiples of CP x TP = 2
    assert "divisible by 2 * cp_size (4)" in engine_refusal(padded, 2, 1, CpLayout.CONTIGUOUS, PaddingRule.MEGATRON_CORE)
    assert group_padded_lengths([255, 146, 1259], 2, 1, CpLayout.CONTIGUOUS) == [256, 148, 1260]


plans = st.tuples(
    st.lists(st.integers(1, 1000), min_size=4, max_size=20), st.sampled_from([(2, 1), (2, 2), (4, 1), (1, 4)]), st.sampled_from([1, 2]),
    st.sampled_from(list(CpLayout)), st.sampled_from(list(PaddingRule)), st.one_of(st.none(), st.integers(1, 64)),
    st.sampled_from(["dynamic_cp", "static_packing", "hybrid_cp"]),
)


@settings(max_examples=100, deadline=None)
@given(plans)
def test_the_plans_padded_tokens_are_the_padding_the_trainer_applies(case):
    """The statistics follow the same padding: each CP group's padded tokens (and so the plan's, and
    its cost) are the padded lengths `micro_batches_for_rank` gives the group's samples."""
    from batch_planner.planner import plan_batch
    from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
    from trainer_client.plans.apply import micro_batches_for_rank
    from trainer_client.plans.batch import GlobalBatch, JaggedField

    lengths, (dp, cp), tp, layout, rule, min_local_rows, scheduler = case
    if rule is PaddingRule.MEGATRON_CORE or scheduler == "hybrid_cp" or refused_by_the_table(layout, tp, min_local_rows):
        min_local_rows = None  # verl's top-up is for its packed groups, where the table lets it through
    kind = SchedulerKind(scheduler)
    from tests.support.megatron_builds import require_scheduler

    require_scheduler(kind)
    try:
        plan = plan_batch(PlanRequest.of(lengths, dp, cp, 1000, scheduler=kind, cp_layout=layout, tensor_parallel_size=tp,
                                         padding=rule, min_local_rows=min_local_rows))
    except BatchNotPlannableError:
        assume(False)  # a batch Megatron-Core's scheduler refuses (too few samples for static packing): no plan to check
        return
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    for micro_batch in plan.micro_batches:
        for group in micro_batch.cp_groups:
            sizes = [[lengths[i] for i in group.sample_ids]] if packed else [[lengths[i]] for i in group.sample_ids]
            expected = sum(sum(group_padded_lengths(unit, group.size, tp, layout, rule, min_local_rows)) for unit in sizes if unit)
            assert group.padded_tokens == expected, (case, group)
    assert plan.statistics.padded_tokens == sum(g.padded_tokens for mb in plan.micro_batches for g in mb.cp_groups)
    # micro_batches_for_rank pads as the plan counted: on every rank, each group's units' padded
    # buffers add up to the group's padded tokens.
    starts = tuple(itertools.accumulate(lengths, initial=0))[:-1]
    batch = GlobalBatch(tuple(lengths), {"input_ids": JaggedField(torch.zeros(sum(lengths), dtype=torch.long), starts)}, {})
    for rank in range(plan.dp_cp_size):
        buffers: dict[int, int] = {}
        for unit in micro_batches_for_rank(plan, batch, rank, pack_group_samples=packed):
            buffers[unit.micro_batch_index] = buffers.get(unit.micro_batch_index, 0) + int(unit.cu_seqlens_padded[-1])
        for index, padded in buffers.items():
            assert padded == plan.micro_batches[index].group_of_rank(rank).padded_tokens, (case, rank, index)
