"""Padding for FP8 (batch_planner/precision.py, padding.py): properties over odd lengths, CP 1-8, TP 1-2
with and without sequence parallelism, both layouts, every precision, packed passes (a CP group's
samples in one buffer) and per-sample passes (hybrid CP).

Transformer Engine is not importable on CPU, so its checks are restated here, line by line, from
Transformer Engine 2.20 (the version bench/gpu/fp8_rows.py measured on an H100,
docs/gpu-benchmark-data/fp8-rows-h100.json), and applied to the rows one TP rank's linear layers see
in one pass: its input (its sequence-parallel shard, T / TP, under SP; all T rows without) and the
GEMMs' rows (T: the weight gradient's GEMM takes the gathered rows as its inner dimension).

- `transformer_engine/pytorch/utils.py:704`, `assert_dim_for_fp8_exec(*tensors)`: for every tensor,
  the product of the leading dimensions % 8 == 0 and the last dimension % 16 == 0 (ValueError
  otherwise); linear.py, layernorm_linear.py and layernorm_mlp.py call it on the input before any
  all-gather. The last dimension is the hidden size, the model's, not the plan's.
- `transformer_engine/common/gemm/cublaslt_gemm.cu:161`: `NVTE_CHECK((ret.lda % 16) == 0, "Leading
  dimension requirement on A for FP8 GEMM. Caller must pad.")`: the wgrad GEMM's A is the rows.
- `transformer_engine/pytorch/tensor/mxfp8_tensor.py:125`, `MXFP8Quantizer.is_quantizable`: the
  flattened rows % 32 == 0 and the last dimension % 32 == 0 (MXFP8_BLOCK_SCALING_SIZE).

Megatron-Core's own code is the oracle for the layout (`_validate_thd_route_partitioning`, its
`_build_thd_layout_segments`, through tests/batch_planner/test_padding_engines.py's helpers) and for
the top-up (`packed_seq_params.extend_thd_padding_before_cp_slice`, the "extend_last" tail padding
of `--pad-packed-seq-alignment N`).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batch_planner.errors import BatchNotPlannableError
from batch_planner.padding import alignment_tokens, group_padded_lengths, padding_multiple
from batch_planner.precision import Precision, rank_row_multiple
from batch_planner.request import CapacityBound, CpLayout, PaddingRule, PlanRequest, SchedulerKind
from tests.batch_planner.test_padding_engines import _cu, engine_refusal, megatron_core_shard_rows, our_shard_rows
from tests.support.megatron_builds import require_scheduler

packed_seq_params = pytest.importorskip(
    "megatron.core.packed_seq_params", reason="Megatron-Core's extend_last THD padding is in the Megatron-LM dev build only"
)
if not hasattr(packed_seq_params, "extend_thd_padding_before_cp_slice"):
    pytest.skip("this Megatron-Core has no extend_thd_padding_before_cp_slice (dev build only)", allow_module_level=True)

MXFP8_BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE, tensor/mxfp8_tensor.py
FP8_RECIPES = (Precision.FP8_DELAYED, Precision.FP8_CURRENT, Precision.FP8_BLOCK)

odd_lengths = st.lists(st.integers(0, 150).map(lambda k: 2 * k + 1), min_size=1, max_size=5)
cases = st.tuples(odd_lengths, st.integers(1, 8), st.sampled_from([1, 2]), st.booleans(), st.sampled_from(list(CpLayout)),
                  st.sampled_from(list(Precision)), st.booleans())


def transformer_engine_refusal(rows: int, tp: int, sequence_parallel: bool, precision: Precision) -> str | None:
    """Why Transformer Engine 2.20 refuses one TP rank's linear layers a pass of `rows` rows (a DPxCP
    rank's), or None: its checks (module docstring), applied to the input shard and the GEMM rows."""
    shard = rows // tp if sequence_parallel else rows
    if sequence_parallel and rows % tp:
        return f"{rows} rows do not split over TP {tp}"
    if precision in FP8_RECIPES:
        if shard % 8:  # utils.py:704 assert_dim_for_fp8_exec: leading dims % 8
            return f"assert_dim_for_fp8_exec: input of {shard} rows, not a multiple of 8"
        if rows % 16:  # cublaslt_gemm.cu:161: lda % 16 (the wgrad GEMM's A: all the rows)
            return f"cuBLASLt FP8 GEMM: lda {rows} not a multiple of 16"
    if precision is Precision.MXFP8:
        for what, n in (("input", shard), ("GEMM", rows)):  # mxfp8_tensor.py:125 is_quantizable
            if n % MXFP8_BLOCK:
                return f"MXFP8Quantizer.is_quantizable: {what} of {n} rows, not a multiple of {MXFP8_BLOCK}"
    return None


def passes(lengths: list[int], packed: bool) -> list[list[int]]:
    return [lengths] if packed else [[n] for n in lengths]


def padded_pass(lengths, cp, tp, layout, precision, sequence_parallel) -> list[int]:
    return group_padded_lengths(lengths, cp, tp, layout, PaddingRule.MEGATRON_CORE, None, rank_row_multiple(precision, tp, sequence_parallel))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases)
def test_every_ranks_rows_pass_transformer_engines_checks(case):
    lengths, cp, tp, sp, layout, precision, packed = case
    for unit in passes(lengths, packed):
        padded = padded_pass(unit, cp, tp, layout, precision, sp)
        assert sum(padded) % cp == 0, (case, padded)
        problem = transformer_engine_refusal(sum(padded) // cp, tp, sp, precision)
        assert problem is None, (case, padded, problem)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases)
def test_every_aligned_padding_is_one_megatron_core_accepts_and_cuts_alike(case):
    """(b) Megatron-Core's `_validate_thd_route_partitioning` (and the TP split) accepts every pass;
    (c) every rank's shard is the rows Megatron-Core's `_build_thd_layout_segments` cuts."""
    lengths, cp, tp, sp, layout, precision, packed = case
    for unit in passes(lengths, packed):
        padded = padded_pass(unit, cp, tp, layout, precision, sp)
        assert all(p >= n for p, n in zip(padded, unit)) and len(padded) == len(unit)
        assert engine_refusal(padded, cp, tp, layout, PaddingRule.MEGATRON_CORE) is None, (case, padded)
        for rank in range(cp):
            assert our_shard_rows(padded, cp, rank, layout) == megatron_core_shard_rows(padded, cp, rank, layout), (case, padded, rank)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases)
def test_the_top_up_is_megatron_cores_extend_last_at_the_rank_row_multiple(case):
    """(d) Megatron-Core's `extend_thd_padding_before_cp_slice(alignment=N)`, given the layout's padded
    buffer, extends its last sequence to the same end: N = rank_row_multiple, for both layouts (its
    round-up of each rank's rows to N keeps 2 x CP x TP, since N is a multiple of 2 x TP here)."""
    lengths, cp, tp, sp, layout, precision, packed = case
    multiple = rank_row_multiple(precision, tp, sp)
    assume(multiple > 1)  # bf16: nothing to extend
    for unit in passes(lengths, packed):
        layout_only = group_padded_lengths(unit, cp, tp, layout)
        ours = padded_pass(unit, cp, tp, layout, precision, sp)
        cu, max_seqlen, target = packed_seq_params.extend_thd_padding_before_cp_slice(
            torch.tensor(_cu(layout_only), dtype=torch.int32), max(layout_only), alignment=multiple, target_len=None,
            cp_size=cp, cp_partition_mode=layout.value,
        )
        assert cu.tolist() == _cu(ours) and target == sum(ours) and max_seqlen == max(ours), (case, layout_only, ours)


def fewest_tokens(layout_only: list[int], cp: int, layout_multiple: int, row_multiple: int) -> int:
    """The smallest total of any padding that keeps every sequence at least its layout's padded length
    and a multiple of the layout's multiple, and every rank's rows a multiple of `row_multiple`: every
    way of adding `layout_multiple`s to the sequences, searched by brute force."""
    base = sum(layout_only)
    # Enough: a sequence given a period (lcm) or more could give it back and stay aligned, so the
    # fewest tokens add less than a period to each.
    period = math.lcm(layout_multiple, cp * row_multiple)
    best = None
    for extra in itertools.product(range(0, period, layout_multiple), repeat=len(layout_only)):
        total = base + sum(extra)
        if total % cp == 0 and (total // cp) % row_multiple == 0 and (best is None or total < best):
            best = total
    assert best is not None
    return best


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 40).map(lambda k: 2 * k + 1), min_size=1, max_size=3), st.integers(1, 8), st.sampled_from([1, 2]),
       st.booleans(), st.sampled_from(list(CpLayout)), st.sampled_from(list(Precision)))
def test_the_padding_is_the_fewest_tokens_that_align(lengths, cp, tp, sp, layout, precision):
    """(e) No smaller total keeps every sequence a multiple of its layout multiple and every rank's
    rows a multiple of the row multiple; bf16 adds nothing."""
    multiple = rank_row_multiple(precision, tp, sp)
    layout_only = group_padded_lengths(lengths, cp, tp, layout)
    ours = padded_pass(lengths, cp, tp, layout, precision, sp)
    m = padding_multiple(cp, tp, layout)
    assert sum(ours) == fewest_tokens(layout_only, cp, m, multiple), (lengths, cp, tp, sp, layout, precision, layout_only, ours)
    assert sum(ours) - sum(layout_only) == alignment_tokens(sum(layout_only), cp, m, multiple)
    assert ours[:-1] == layout_only[:-1]  # only the last sequence is topped up
    if precision is Precision.BF16:
        assert ours == layout_only


plans = st.tuples(
    st.lists(st.integers(0, 450).map(lambda k: 2 * k + 1), min_size=4, max_size=16), st.sampled_from([(2, 1), (2, 2), (4, 1), (1, 4), (1, 8)]),
    st.sampled_from([1, 2]), st.booleans(), st.sampled_from(list(CpLayout)), st.sampled_from(list(Precision)),
    st.sampled_from(["dynamic_cp", "hybrid_cp", "static_packing", "auto"]),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(plans)
def test_every_scheduler_serves_aligned_passes_and_counts_their_alignment(case):
    """(f) Each plan's passes are aligned (the TE checks above), its groups' padded tokens are the
    aligned passes', and statistics' alignment_padding_tokens is their padded tokens less the
    layout's padding alone of the same passes."""
    from batch_planner.planner import plan_batch

    lengths, (dp, cp), tp, sp, layout, precision, scheduler = case
    kind = SchedulerKind(scheduler)
    if kind is not SchedulerKind.AUTO:
        require_scheduler(kind)
    try:
        plan = plan_batch(PlanRequest.of(lengths, dp, cp, 1000, scheduler=kind, cp_layout=layout, tensor_parallel_size=tp,
                                         precision=precision, sequence_parallel=sp))
    except BatchNotPlannableError:
        assume(False)  # a batch Megatron-Core's scheduler refuses (too few samples for static packing)
        return
    assert plan.precision is precision and plan.sequence_parallel is sp
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    aligned_total = layout_total = 0
    for micro_batch in plan.micro_batches:
        for group in micro_batch.cp_groups:
            group_tokens = 0
            for unit in passes([lengths[i] for i in group.sample_ids], packed):
                if not unit:
                    continue
                padded = padded_pass(unit, group.size, tp, layout, precision, sp)
                assert transformer_engine_refusal(sum(padded) // group.size, tp, sp, precision) is None, (case, group, padded)
                group_tokens += sum(padded)
                layout_total += sum(group_padded_lengths(unit, group.size, tp, layout))
            assert group.padded_tokens == group_tokens, (case, group)
            aligned_total += group_tokens
    assert plan.statistics.padded_tokens == aligned_total
    assert plan.statistics.alignment_padding_tokens == aligned_total - layout_total, case
    if precision is Precision.BF16:
        assert plan.statistics.alignment_padding_tokens == 0


def test_the_restated_checks_refuse_what_the_h100_refused():
    """The restatement is not vacuous: the rows the H100 run refused (docs/gpu-benchmark-data/
    fp8-rows-h100.json: 8, 24, 40 ... failed cuBLASLt's lda check; odd counts the Python check)."""
    for precision in FP8_RECIPES:
        assert "lda 24" in transformer_engine_refusal(24, 1, False, precision)
        assert "assert_dim_for_fp8_exec" in transformer_engine_refusal(20, 1, False, precision)
        assert transformer_engine_refusal(32, 1, False, precision) is None
        # TP 2 with SP: 16 rows give each TP rank 8, which passes; 8 rows give 4, which does not.
        assert transformer_engine_refusal(16, 2, True, precision) is None
        assert "input of 4 rows" in transformer_engine_refusal(8, 2, True, precision)
    assert "MXFP8Quantizer" in transformer_engine_refusal(48, 1, False, Precision.MXFP8)
    assert transformer_engine_refusal(6, 1, False, Precision.BF16) is None


@pytest.mark.parametrize(("tp", "precision"), [(3, Precision.FP8_DELAYED), (6, Precision.FP8_CURRENT), (3, Precision.MXFP8)])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_where_extend_last_pads_less_it_breaks_the_layouts_multiple(tp, precision, cp):
    """The equivalence above needs N a multiple of 2 x TP. Without sequence parallelism at a TP that
    is not a power of two (N = 16, or 32 for MXFP8, at TP 3 or 6) it is not: Megatron-Core rounds each
    rank's rows up to N alone, so its extended last sequence is no longer a multiple of the layout's
    2 x CP x TP (TP at CP1), which the planner keeps; the planner's buffer is then lcm(m, CP x N)."""
    multiple = rank_row_multiple(precision, tp, False)
    assert multiple % (2 * tp)
    layout_only = group_padded_lengths([1], cp, tp, CpLayout.ZIGZAG)
    ours = padded_pass([1], cp, tp, CpLayout.ZIGZAG, precision, False)
    cu, _, target = packed_seq_params.extend_thd_padding_before_cp_slice(
        torch.tensor(_cu(layout_only), dtype=torch.int32), max(layout_only), alignment=multiple, target_len=None, cp_size=cp,
        cp_partition_mode="zigzag",
    )
    m = padding_multiple(cp, tp, CpLayout.ZIGZAG)
    assert target == cp * multiple < sum(ours) == math.lcm(m, cp * multiple)
    assert target % m and all(p % m == 0 for p in ours)
    assert transformer_engine_refusal(target // cp, tp, False, precision) is None  # Transformer Engine would take its rows


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 2000).map(lambda k: 2 * k + 1), min_size=1, max_size=24), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]),
       st.booleans(), st.sampled_from(list(CpLayout)), st.sampled_from(list(Precision)))
def test_the_static_cp_comparisons_packs_are_aligned_too(lengths, cp, tp, sp, layout, precision):
    """The static-CP comparison (cost.static_cp_packs: one pass per pack) pads each pack's buffer as a
    packed pass is padded: its rows pass Transformer Engine's checks, with the fewest tokens."""
    from batch_planner.cost import static_cp_packs

    request = PlanRequest.of(lengths, 2, cp, 4096, cp_layout=layout, tensor_parallel_size=tp, precision=precision, sequence_parallel=sp)
    _, offsets, padded = static_cp_packs(request)
    _, _, layout_only = static_cp_packs(request.replace(precision=Precision.BF16))
    m, multiple = padding_multiple(cp, tp, layout), rank_row_multiple(precision, tp, sp)
    for tokens, base in zip(padded.tolist(), layout_only.tolist()):
        assert transformer_engine_refusal(tokens // cp, tp, sp, precision) is None and tokens % cp == 0
        assert tokens - base == alignment_tokens(base, cp, m, multiple)
    assert len(padded) == len(offsets) - 1
