"""Pricing plans: the cost model's arithmetic, plan statistics and the static-CP comparison estimate
(docs/cost-model.md). The coefficients are batch_planner/cost_spec.py's CostModel.

A deliberately simple model: it ranks plans, it does not predict wall-clock time to the millisecond.
For a sample of real length L, padded length P, on a CP group of size c, one rank of the group pays

    token term      seconds_per_token * P / c
    attention term  seconds_per_attention_token_pair * L^2 / c
    CP comm term    cp_seconds_per_token * P * (c - 1) / c          (c > 1 only)

and each forward+backward pass over a group costs a fixed

    pass term       seconds_per_pass                                 (every c, CP1 included)
    CP fixed term   cp_seconds_per_micro_batch * (c - 1)             (per ring step; 0 at c = 1)

The CP fixed term is a fixed cost per step of Transformer Engine's THD ring, c - 1 steps a pass: the
replay on an H100 (docs/gpu-replay.md) measured about 0.5 ms of launches and corrections per step
and layer forward, whatever the rows, so a pass over CP 16 pays 15 of them. (Before the replay, on
the toy engine's two GPUs, it was one per CP pass: c - 1 = 1 there.)

Both fixed terms are paid once per pass: once per sample under hybrid CP (each sample of a group is
its own pass), once per micro-batch (pack) under the packing schedulers and in the static-CP
estimate. The pass term is what makes many short passes dearer than one packed pass. A
micro-batch lasts as long as its slowest rank (ranks meet at a barrier); a step is the sum of its
micro-batches. The lower bound (batch_planner/lower_bound.py) is what no plan of the request can
avoid: the work spread evenly over all DPxCP ranks, the passes of the fewest micro-batches, and the
CP terms that samples longer than one rank's budget force.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from batch_planner.columns import FLOAT_EXACT, INT64_EXACT, lengths_column, round_up, segment_sums
from batch_planner.cost_spec import CostModel
from batch_planner.lower_bound import step_lower_bound
from batch_planner.padding import PlanPadding, padding_multiple, pass_multiple, row_multiple_of
from batch_planner.plan import GroupColumns, MicroBatch, PlanStatistics
from batch_planner.request import CapacityBound, PlanRequest


def unit_features(padded_tokens: Any, attention_units: Any, cp_size: Any, passes: Any) -> dict[str, Any]:
    """What one rank of a CP group of `cp_size` does, per coefficient: the one home of the model's
    arithmetic. The group's padded tokens P, its sum of L^2, and its forward+backward passes give

        seconds_per_token                 P / c
        seconds_per_attention_token_pair  L^2 / c
        cp_seconds_per_token              P (c - 1) / c        (0 at c = 1)
        seconds_per_pass                  passes
        cp_seconds_per_micro_batch        passes (c - 1)       (ring steps; 0 at c = 1)

    in the order of CostModel's fields (cost_spec.COEFFICIENT_NAMES). `price` is the dot product
    with the coefficients; the planner prices plans with it and the trainer's calibration
    (trainer_client/service/calibration.py) fits the coefficients to timed units' features, so what is
    predicted and what is fitted cannot drift apart.

    The arguments may also be numpy columns (batch_planner/columns.py), one value per group: the
    same operations then run element by element (x * 1.0 is float(x); the CP terms vanish at c = 1
    as (c - 1) is 0), so a group's features are the same bits either way."""
    return {
        "seconds_per_token": padded_tokens / cp_size,
        "seconds_per_attention_token_pair": attention_units * 1.0 / cp_size,
        "cp_seconds_per_micro_batch": passes * (cp_size - 1) * 1.0,
        "cp_seconds_per_token": padded_tokens * (cp_size - 1) / cp_size,
        "seconds_per_pass": passes * 1.0,
    }


def price(model: CostModel, features: Mapping[str, Any]) -> Any:
    """Seconds of work with these features (`unit_features`): the coefficients' dot product (a
    column of seconds for columns of features)."""
    return (
        model.seconds_per_token * features["seconds_per_token"]
        + model.seconds_per_attention_token_pair * features["seconds_per_attention_token_pair"]
        + model.cp_seconds_per_micro_batch * features["cp_seconds_per_micro_batch"]
        + model.cp_seconds_per_token * features["cp_seconds_per_token"]
        + model.seconds_per_pass * features["seconds_per_pass"]
    )


def group_work_seconds(model: CostModel, padded_tokens: int, attention_units: int, cp_size: int, samples: int, packed: bool) -> float:
    """One rank's time for a CP group of `samples` samples with these padded tokens and sum of
    L^2: one pass when packed, one per sample otherwise, none for an empty group."""
    passes = (1 if packed else samples) if samples else 0
    return price(model, unit_features(padded_tokens, attention_units, cp_size, passes))


def single_rank_work(model: CostModel, lengths: Iterable[int]) -> float:
    """The work of `lengths` on one rank at CP1, unpadded, without the fixed terms: the total CP1
    work that bench/quality.py measures the static-CP estimate against."""
    tokens = attention_units = 0
    for length in lengths:
        tokens += length
        attention_units += length * length
    return model.seconds_per_token * tokens + model.seconds_per_attention_token_pair * float(attention_units)


def step_cost(micro_batches: Sequence[MicroBatch], request: PlanRequest, model: CostModel, packed: bool, columns: GroupColumns | None = None) -> float:
    """The plan's predicted step time, from each CP group's padded tokens and its samples' L^2.
    `columns`: GroupColumns.of(micro_batches), when the caller has them."""
    columns = columns or GroupColumns.of(micro_batches, request.num_samples)
    seconds = _groups_seconds(model, columns, request, packed).tolist()
    total = 0.0
    for start, end in pairwise(columns.micro_batch_starts):
        total += max(0.0, *seconds[start:end])  # the slowest group; a micro-batch lasts that long
    return total


def _groups_seconds(model: CostModel, columns: GroupColumns, request: PlanRequest, packed: bool) -> np.ndarray:
    """One rank's time for each CP group (`group_work_seconds`, one group per element)."""
    largest = max(columns.sizes, default=1)
    lengths = lengths_column(request.sequence_lengths, largest, request.tensor_parallel_size)
    dtype = lengths.dtype if max(columns.padded_tokens, default=0) * largest < FLOAT_EXACT else np.dtype(object)
    ids = columns.sample_id_column
    squares = (lengths * lengths)[np.asarray(columns.sample_ids, dtype=np.int64) if ids is None else ids]
    counts = np.diff(columns.sample_offsets)
    passes = np.where(counts > 0, 1 if packed else counts, 0)
    sizes = columns.size_column.astype(dtype)
    attention = segment_sums(squares.astype(dtype), columns.sample_offsets)
    return _price_columns(model, unit_features(np.asarray(columns.padded_tokens, dtype=dtype), attention, sizes, passes))


def _price_columns(model: CostModel, features: Mapping[str, Any]) -> np.ndarray:
    """`price` of columns of features, as float64; an overflow to inf passes silently, as it does
    in Python's float arithmetic."""
    with np.errstate(over="ignore"):
        return np.asarray(price(model, features), dtype=np.float64)


def pack_in_order(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sample ids packed in their original order, a new pack whenever the next would pass `budget`
    tokens (a longer sample gets a pack of its own): static CP's packing, as the estimate prices it."""
    starts = pack_starts(lengths_column(lengths, 1, 1), budget)
    return [list(range(start, end)) for start, end in pairwise([*starts, len(lengths)])]


def pack_starts(lengths: np.ndarray, budget: int) -> list[int]:
    """The first sample of each of `pack_in_order`'s packs (lengths >= 0): a pack from sample s
    runs to the last sample whose running total from s stays within `budget`, and holds at least s."""
    count = len(lengths)
    if not count:
        return []
    totals = np.zeros(count + 1, dtype=lengths.dtype)
    np.cumsum(lengths, out=totals[1:])
    # A budget above the whole batch packs as the whole batch does (and keeps the sums in int64).
    budget = min(budget, int(totals[-1]))
    last = np.searchsorted(totals, totals[:-1] + budget, side="right") - 1
    following = np.maximum(last, np.arange(1, count + 1)).tolist()  # the next pack's first sample
    starts, start = [], 0
    while start < count:
        starts.append(start)
        start = following[start]
    return starts


def static_cp_step_cost(request: PlanRequest, model: CostModel) -> float:
    """The same batch under static CP at the job's CP size: a comparison estimate, not a plan.

    Every sample is split over the static CP group; samples are packed in their original order up
    to the per-replica budget (max_seqlen_per_dp_cp_rank * CP); pack k runs on DP replica k % DP,
    one pass per pack. Megatron's ordinary schedule has no barrier between micro-batches, so the
    replicas meet only at the gradient all-reduce: the step is the slowest replica's sum.
    """
    cp = request.context_parallel_size
    lengths, offsets, padded = static_cp_packs(request)
    features = unit_features(padded, segment_sums(lengths * lengths, offsets), cp, 1)  # one pass per pack
    return _slowest_replica(_price_columns(model, features), request.data_parallel_size)


def static_cp_packs(request: PlanRequest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The static-CP comparison's packs (`static_cp_step_cost`): the lengths column, each pack's
    offsets into it, and each pack's padded tokens (one pass per pack: the layout's padding, verl's
    top-up, then the precision's)."""
    cp = request.context_parallel_size
    lengths = lengths_column(request.sequence_lengths, cp, request.tensor_parallel_size)
    starts = pack_starts(lengths, request.max_seqlen_per_dp_cp_rank * cp)
    offsets = np.asarray([*starts, len(lengths)], dtype=np.int64)
    multiple = padding_multiple(cp, request.tensor_parallel_size, request.cp_layout, request.padding)
    padded = segment_sums(round_up(lengths, multiple), offsets)
    if request.min_local_rows is not None:  # verl's top-up of each pack's buffer
        padded = np.maximum(padded, cp * request.min_local_rows)
    if (rows := row_multiple_of(request)) > 1:  # the precision's top-up of each pack's buffer
        padded = round_up(padded, pass_multiple(multiple, cp, rows))
    return lengths, offsets, padded


def _slowest_replica(pack_seconds: np.ndarray, dp: int) -> float:
    """The largest of the DP replicas' sums when pack k runs on replica k % dp: each replica's sum
    left to right from 0.0, as `replica_seconds[k % dp] += seconds` adds."""
    rounds = -(-len(pack_seconds) // dp)
    table = np.zeros((rounds + 1, dp))  # row 0: every replica's 0.0; the last row's tail: nothing more
    table.reshape(-1)[dp : dp + len(pack_seconds)] = pack_seconds
    with np.errstate(over="ignore"):
        return max(np.add.accumulate(table, axis=0)[-1].tolist())


def plan_statistics(
    micro_batches: Sequence[MicroBatch],
    request: PlanRequest,
    capacity_bound: CapacityBound,
    model: CostModel,
    columns: GroupColumns | None = None,
) -> PlanStatistics:
    """The plan's statistics under `model`; its lower bound and balance efficiency (bound /
    predicted: 1.0 means no imbalance left to recover) are of every plan of `request`.
    `columns`: GroupColumns.of(micro_batches), when the caller has them."""
    columns = columns or GroupColumns.of(micro_batches, request.num_samples)
    real = sum(columns.real_tokens)
    padded = sum(columns.padded_tokens)
    packed = capacity_bound is CapacityBound.PER_RANK_SUM
    predicted = step_cost(micro_batches, request, model, packed, columns)
    lower_bound = step_lower_bound(request, capacity_bound, model).cost
    static = static_cp_step_cost(request, model)
    return PlanStatistics(
        real_tokens=real,
        padded_tokens=padded,
        padding_ratio=(padded - real) / padded if padded else 0.0,
        micro_batch_count=len(micro_batches),
        cp_size_mix=cp_size_mix(columns),
        predicted_step_cost=predicted,
        lower_bound_cost=lower_bound,
        balance_efficiency=lower_bound / predicted if predicted > 0 else 1.0,
        static_cp_step_cost=static,
        predicted_speedup_over_static_cp=static / predicted if predicted > 0 else 1.0,
        alignment_padding_tokens=alignment_padding_tokens(columns, request, packed),
    )


def alignment_padding_tokens(columns: GroupColumns, request: PlanRequest, packed: bool) -> int:
    """Of the groups' padded tokens, those the precision's alignment added: their padded tokens
    less the layout's padding alone of the same groups."""
    if row_multiple_of(request) == 1 or not columns.sizes:
        return 0
    ids = columns.sample_id_column
    ids = np.asarray(columns.sample_ids, dtype=np.int64) if ids is None else ids
    _, layout_only = PlanPadding.for_request(request, packed).without_alignment().group_tokens(ids, columns.sample_offsets, columns.sizes)
    return sum(columns.padded_tokens) - sum(layout_only)


def cp_size_mix(columns: GroupColumns) -> tuple[tuple[int, int, int], ...]:
    """(cp_size, samples, real_tokens) for each CP size the plan's groups use, by cp_size."""
    sizes = columns.size_column
    real = np.asarray(columns.real_tokens, dtype=np.int64 if sum(columns.real_tokens) < INT64_EXACT else object)
    counts = np.diff(columns.sample_offsets)
    mix = []
    for size in sorted(set(columns.sizes)):
        mask = sizes == size
        mix.append((size, int(counts[mask].sum()), int(real[mask].sum())))
    return tuple(mix)
