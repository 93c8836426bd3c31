"""Pricing plans: the cost model's arithmetic, plan statistics and the static-CP comparison estimate
(docs/cost-model.md). The coefficients are batch_planner/cost_spec.py's CostModel.

A deliberately simple model: it ranks plans, it does not predict wall-clock time to the millisecond.
For a sample of real length L, padded length P, on a CP group of size c, one rank of the group pays

    token term      seconds_per_token * P / c
    attention term  seconds_per_attention_token_pair * L^2 / c
    CP comm term    cp_seconds_per_token * P * (c - 1) / c          (c > 1 only)

and each forward+backward pass over a group costs a fixed

    pass term       seconds_per_pass                                 (every c, CP1 included)
    CP fixed term   cp_seconds_per_micro_batch                       (c > 1 only)

Both fixed terms are paid once per pass: once per sample under hybrid CP (each sample of a group is
its own pass), once per micro-batch (pack) under the packing schedulers and in the static-CP
estimate. The pass term is what makes many short passes dearer than one packed pass. A
micro-batch lasts as long as its slowest rank (ranks meet at a barrier); a step is the sum of its
micro-batches. The lower bound (batch_planner/lower_bound.py) is what no plan of the request can
avoid: the work spread evenly over all DPxCP ranks, the passes of the fewest micro-batches, and the
CP terms that samples longer than one rank's budget force.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from batch_planner.cost_spec import CostModel
from batch_planner.lower_bound import step_lower_bound
from batch_planner.padding import padded_sum, padding_multiple
from batch_planner.plan import CpGroup, MicroBatch, PlanStatistics
from batch_planner.request import CapacityBound, PlanRequest


def unit_features(padded_tokens: int, attention_units: int, cp_size: int, passes: int) -> dict[str, float]:
    """What one rank of a CP group of `cp_size` does, per coefficient: the one home of the model's
    arithmetic. The group's padded tokens P, its sum of L^2, and its forward+backward passes give

        seconds_per_token                 P / c
        seconds_per_attention_token_pair  L^2 / c
        cp_seconds_per_token              P (c - 1) / c        (0 at c = 1)
        seconds_per_pass                  passes
        cp_seconds_per_micro_batch        passes               (0 at c = 1)

    in the order of CostModel's fields (cost_spec.COEFFICIENT_NAMES). `price` is the dot product
    with the coefficients; the planner prices plans with it and the trainer's calibration
    (trainer_client/calibration.py) fits the coefficients to timed units' features, so what is
    predicted and what is fitted cannot drift apart."""
    cp = cp_size > 1
    return {
        "seconds_per_token": padded_tokens / cp_size,
        "seconds_per_attention_token_pair": float(attention_units) / cp_size,
        "cp_seconds_per_micro_batch": float(passes) if cp else 0.0,
        "cp_seconds_per_token": padded_tokens * (cp_size - 1) / cp_size if cp else 0.0,
        "seconds_per_pass": float(passes),
    }


def price(model: CostModel, features: Mapping[str, float]) -> float:
    """Seconds of work with these features (`unit_features`): the coefficients' dot product."""
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


def step_cost(micro_batches: Sequence[MicroBatch], request: PlanRequest, model: CostModel, packed: bool) -> float:
    """The plan's predicted step time, from each CP group's padded tokens and its samples' L^2."""
    squares = [length * length for length in request.sequence_lengths]
    total = 0.0
    for micro_batch in micro_batches:
        slowest = 0.0
        for group in micro_batch.cp_groups:
            ids = group.sample_ids
            seconds = group_work_seconds(model, group.padded_tokens, sum(map(squares.__getitem__, ids)), group.size, len(ids), packed)
            slowest = max(slowest, seconds)
        total += slowest
    return total


def pack_in_order(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sample ids packed in their original order, a new pack whenever the next would pass `budget`
    tokens (a longer sample gets a pack of its own): static CP's packing, as the estimate prices it."""
    packs: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for sample_id, length in enumerate(lengths):
        if current and tokens + length > budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(sample_id)
        tokens += length
    if current:
        packs.append(current)
    return packs


def static_cp_step_cost(request: PlanRequest, model: CostModel) -> float:
    """The same batch under static CP at the job's CP size: a comparison estimate, not a plan.

    Every sample is split over the static CP group; samples are packed in their original order up
    to the per-replica budget (max_seqlen_per_dp_cp_rank * CP); pack k runs on DP replica k % DP,
    one pass per pack. Megatron's ordinary schedule has no barrier between micro-batches, so the
    replicas meet only at the gradient all-reduce: the step is the slowest replica's sum.
    """
    cp = request.context_parallel_size
    lengths = request.sequence_lengths
    multiple = padding_multiple(cp, request.tensor_parallel_size, request.cp_layout)
    squares = [length * length for length in lengths]
    dp = request.data_parallel_size
    replica_seconds = [0.0] * dp
    for k, pack in enumerate(pack_in_order(lengths, request.max_seqlen_per_dp_cp_rank * cp)):
        padded = padded_sum(map(lengths.__getitem__, pack), multiple)
        replica_seconds[k % dp] += group_work_seconds(model, padded, sum(map(squares.__getitem__, pack)), cp, len(pack), True)
    return max(replica_seconds)


def plan_statistics(
    micro_batches: Sequence[MicroBatch],
    request: PlanRequest,
    capacity_bound: CapacityBound,
    model: CostModel,
) -> PlanStatistics:
    """The plan's statistics under `model`; its lower bound and balance efficiency (bound /
    predicted: 1.0 means no imbalance left to recover) are of every plan of `request`."""
    groups: list[CpGroup] = [g for mb in micro_batches for g in mb.cp_groups]
    real = sum(g.real_tokens for g in groups)
    padded = sum(g.padded_tokens for g in groups)
    mix: dict[int, list[int]] = {}
    for group in groups:
        entry = mix.setdefault(group.size, [0, 0])
        entry[0] += len(group.sample_ids)
        entry[1] += group.real_tokens
    packed = capacity_bound is CapacityBound.PER_RANK_SUM
    predicted = step_cost(micro_batches, request, model, packed)
    lower_bound = step_lower_bound(request, capacity_bound, model).cost
    static = static_cp_step_cost(request, model)
    return PlanStatistics(
        real_tokens=real,
        padded_tokens=padded,
        padding_ratio=(padded - real) / padded if padded else 0.0,
        micro_batch_count=len(micro_batches),
        cp_size_mix=tuple((size, n, tokens) for size, (n, tokens) in sorted(mix.items())),
        predicted_step_cost=predicted,
        lower_bound_cost=lower_bound,
        balance_efficiency=lower_bound / predicted if predicted > 0 else 1.0,
        static_cp_step_cost=static,
        predicted_speedup_over_static_cp=static / predicted if predicted > 0 else 1.0,
    )
