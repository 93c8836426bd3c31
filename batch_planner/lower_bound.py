"""A lower bound on the predicted step cost of every plan of a request: what no plan can avoid
under the cost model (batch_planner/cost.py) and the plan invariants (docs/design.md, "Plan
invariants"). docs/cost-model.md ("Step cost, lower bound, balance") has the proof of each term.

The step is the sum over micro-batches of the slowest rank's time. Two bounds, the larger served:

- **even**: the slowest rank is at least the average rank, so the step is at least all ranks'
  seconds over DPxCP: every sample's work at the cheapest CP size it fits (token, attention and
  CP-traffic terms, padding included), plus the pass terms no plan avoids: `seconds_per_pass` for
  every rank pass (packed: one per rank and micro-batch of the fewest micro-batches; per sample:
  also one per sample on every rank of the smallest group it fits), `cp_seconds_per_micro_batch`
  (one ring step, the fewest a CP pass has) for every pass over a CP group that samples longer
  than one rank's budget, or ranks left without a sample of their own, force;
- **single**: the micro-batch holding a sample lasts at least that sample's own pass on one rank
  of its group, and every other micro-batch at least one pass.

Arithmetic over the request's lengths only (numpy, one column per allowed CP size), never a schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np

from batch_planner.columns import INT64_EXACT, lengths_column, round_up
from batch_planner.cost_spec import CostModel
from batch_planner.padding import padding_multiple
from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
from batch_planner.schedulers import valid_cp_sizes


@dataclass(frozen=True)
class LowerBound:
    """The bound's parts, in model seconds; `cost` is the bound."""

    even: float  # all ranks' unavoidable seconds over DPxCP
    single: float  # one sample's own pass, plus one pass per other micro-batch
    fewest_micro_batches: int
    rank_passes: float  # forward+backward passes summed over the ranks, that no plan avoids
    cp_rank_passes: float  # of them, passes over CP groups (c > 1)

    @property
    def cost(self) -> float:
        return max(self.even, self.single)


@dataclass(frozen=True)
class _SampleSizes:
    """Each sample's CP sizes: the plan's allowed ones whose group holds it (c x budget >= L).
    Per-size values are columns of one (n,) array per size, so each pass over them stays small."""

    lengths: np.ndarray  # (n,) int64
    sizes: np.ndarray  # (k,) the plan's allowed CP sizes, ascending
    multiples: np.ndarray  # (k,) their padding multiples
    smallest_index: np.ndarray  # (n,) the index in `sizes` of the smallest size each sample fits
    # The fits are a suffix of the sizes for every sample (capacities ascending, in int64), every
    # sample fits one, every length is >= 1 and its square exact: what _Work's shortcuts need.
    ordered: bool
    held: np.ndarray  # (n,) bool: some size holds the sample
    capacities: np.ndarray  # (k,) int64: sizes x max_seqlen_per_dp_cp_rank

    @cached_property
    def fits(self) -> list[np.ndarray]:
        """k x (n,) bool: sample s fits a group of sizes[k]; a sample no group holds is in no
        plan (validation refuses it): every size stands for it."""
        return [(capacity >= self.lengths) | ~self.held for capacity in self.capacities]

    @cached_property
    def smallest_group(self) -> np.ndarray:
        """(n,) the smallest CP size each sample fits."""
        return self.sizes[self.smallest_index]

    @cached_property
    def padded(self) -> list[np.ndarray]:
        """k x (n,) int64: sample s padded for sizes[k]."""
        return [round_up(self.lengths, multiple) for multiple in self.multiples.tolist()]


def step_lower_bound(request: PlanRequest, capacity_bound: CapacityBound, model: CostModel) -> LowerBound:
    """The lower bound on the predicted step cost (`cost.step_cost`) of every plan of `request`
    (a concrete scheduler, not auto) that keeps the plan invariants under `capacity_bound`."""
    if not request.sequence_lengths:
        return LowerBound(0.0, 0.0, 0, 0.0, 0.0)
    samples = _sample_sizes(request)
    fewest = fewest_micro_batches(request, capacity_bound)
    passes = _rank_passes(request, capacity_bound, samples, fewest)
    cp_passes = _cp_rank_passes(request, capacity_bound, samples, fewest)
    work = _Work(model, samples)
    fixed = model.seconds_per_pass * passes + model.cp_seconds_per_micro_batch * cp_passes
    # fsum: exactly rounded, so every replica (whatever numpy's reduction order on its CPU) serves
    # the same bytes.
    even = (math.fsum(work.cheapest().tolist()) + fixed) / request.dp_cp_size
    return LowerBound(even, _single(model, samples, work, fewest), fewest, passes, cp_passes)


def _sample_sizes(request: PlanRequest) -> _SampleSizes:
    exact = lengths_column(request.sequence_lengths, request.dp_cp_size, request.tensor_parallel_size)
    lengths = exact if exact.dtype == np.int64 else np.asarray(request.sequence_lengths, dtype=np.int64)
    allowed = sorted(valid_cp_sizes(request.scheduler, request.dp_cp_size, request.context_parallel_size, request.min_cp_size))
    sizes = np.asarray(allowed, dtype=np.int64)
    budget = request.max_seqlen_per_dp_cp_rank
    capacities = sizes * budget
    ascending = 0 < budget and allowed[-1] * budget < INT64_EXACT  # in int64: a sample fits a suffix of the sizes
    if ascending:
        first = np.searchsorted(capacities, lengths, side="left")
        held = first < len(allowed)
    else:
        fits = np.stack([capacity >= lengths for capacity in capacities], axis=1)
        held = fits.any(axis=1)
        first = np.argmax(fits, axis=1)
    ordered = ascending and bool(held.all()) and exact.dtype == np.int64 and int(lengths.min()) >= 1
    # verl's min_local_rows top-up only adds: a bound without it is still a bound.
    multiples = np.asarray([padding_multiple(c, request.tensor_parallel_size, request.cp_layout, request.padding) for c in allowed],
                           dtype=np.int64)
    return _SampleSizes(lengths, sizes, multiples, np.where(held, first, 0), ordered, held, capacities)


def fewest_micro_batches(request: PlanRequest, capacity_bound: CapacityBound) -> int:
    """The fewest micro-batches a plan of `request` can have.

    Per rank sum: a micro-batch's groups hold at most max_seqlen_per_dp_cp_rank real tokens per
    rank, so at most budget x DPxCP; static packing also holds at most max_seqs_per_micro_batch
    samples per DP replica; and both schedulers return a multiple of micro_batch_group_size.
    Per sample: no bound on a micro-batch's tokens, so one."""
    if not request.sequence_lengths:
        return 0
    if capacity_bound is CapacityBound.PER_SAMPLE:
        return 1
    fewest = _ceil_div(sum(request.sequence_lengths), request.max_seqlen_per_dp_cp_rank * request.dp_cp_size)
    cap = request.max_seqs_per_micro_batch
    if request.scheduler is SchedulerKind.STATIC_PACKING and cap:
        fewest = max(fewest, _ceil_div(_ceil_div(request.num_samples, cap), request.data_parallel_size))
    group = request.micro_batch_group_size or 1
    return _ceil_div(fewest, group) * group


def _rank_passes(request: PlanRequest, capacity_bound: CapacityBound, samples: _SampleSizes, fewest: int) -> float:
    """Passes summed over the ranks, at least: every rank runs at least one pass in every
    micro-batch (no idle rank); packed, exactly one. Per sample, each sample is a pass on every rank
    of its group, at least the smallest group it fits."""
    every_rank = request.dp_cp_size * fewest
    if capacity_bound is CapacityBound.PER_RANK_SUM:
        return float(every_rank)
    return float(max(every_rank, int(samples.smallest_group.sum())))


def _cp_rank_passes(request: PlanRequest, capacity_bound: CapacityBound, samples: _SampleSizes, fewest: int) -> float:
    """Of the rank passes, those over CP groups (c > 1), at least: all of them when no CP1 group is
    allowed; else every rank of a micro-batch outside CP1 groups, which hold a sample each, so at
    least DPxCP x micro-batches - the samples of one rank's budget or less; and the samples longer
    than one rank's budget (`_long_sample_passes`). A sum of CP sizes, so rounded up to a multiple
    of their greatest common divisor."""
    cp_sizes = samples.sizes[samples.sizes > 1]
    if not cp_sizes.size:
        return 0.0
    if samples.sizes[0] > 1:
        return _rank_passes(request, capacity_bound, samples, fewest)
    budget = request.max_seqlen_per_dp_cp_rank
    long = samples.lengths > budget
    outside_cp1 = request.dp_cp_size * fewest - int((~long).sum())
    needed = max(outside_cp1, _long_sample_passes(capacity_bound, samples, long, budget))
    step = int(np.gcd.reduce(cp_sizes))
    return float(_ceil_div(needed, step) * step)


def _long_sample_passes(capacity_bound: CapacityBound, samples: _SampleSizes, long: np.ndarray, budget: int) -> int:
    """CP rank passes that samples longer than one rank's budget force. Per sample: each is its
    own pass on at least the smallest group it fits. Packed, samples may share a group's pass: a
    group of c ranks holds at most c x budget real tokens, so they fill at least their tokens over
    the budget in ranks, and the longest needs at least the smallest group it fits."""
    if not long.any():
        return 0
    smallest = samples.smallest_group[long]
    if capacity_bound is CapacityBound.PER_SAMPLE:
        return int(smallest.sum())
    return max(_ceil_div(int(samples.lengths[long].sum()), budget), int(smallest.max()))


class _Work:
    """A sample's token, attention and CP-traffic seconds summed over the ranks of a group of each
    allowed size (c x cost.unit_features' per-rank share, without the pass terms)."""

    def __init__(self, model: CostModel, samples: _SampleSizes):
        self.samples = samples
        squares = (samples.lengths * samples.lengths).astype(np.float64)
        self.attention = model.seconds_per_attention_token_pair * squares
        self.per_padded_token = model.seconds_per_token + model.cp_seconds_per_token * (samples.sizes - 1).astype(np.float64)
        # Every coefficient >= +0.0 (none -0.0): the seconds then never fall as a size or a length grows.
        self.monotone = samples.ordered and all(
            math.copysign(1.0, value) > 0 for value in (model.seconds_per_token, model.cp_seconds_per_token, model.seconds_per_attention_token_pair,
                                                        model.seconds_per_pass, model.cp_seconds_per_micro_batch))

    @cached_property
    def columns(self) -> list[np.ndarray]:
        """k x (n,): every sample's seconds at every allowed size."""
        return [rate * padded + self.attention for rate, padded in zip(self.per_padded_token, self.samples.padded)]

    def cheapest(self) -> np.ndarray:
        """(n,): each sample's seconds at the cheapest size it fits: `at_smallest_fit` where that is
        the same, else the minimum over the sizes it fits."""
        multiples = self.samples.multiples.tolist()
        if self.monotone and all(larger % smaller == 0 for smaller, larger in pairwise(multiples)):
            return self.at_smallest_fit()
        return _cheapest(self.columns, self.samples.fits)

    def at_smallest_fit(self) -> np.ndarray:
        """(n,): each sample's seconds at the smallest size it fits. The cheapest when `monotone`
        and each allowed size's padding multiple divides the next one's: a sample's padded length
        then never falls as the size grows, nor does the per-token rate (coefficients >= 0), so
        neither does the rounded product, nor its sum with the attention term; the same bits as the
        minimum over the sizes it fits."""
        index = self.samples.smallest_index
        return self.per_padded_token[index] * round_up(self.samples.lengths, self.samples.multiples[index]) + self.attention


def _pass_seconds(model: CostModel, sizes: np.ndarray) -> np.ndarray:
    """(k,): one pass's fixed seconds on one rank of a group of each size."""
    return model.seconds_per_pass + model.cp_seconds_per_micro_batch * (sizes - 1)  # a pass and its c - 1 ring steps


def _cheapest(values: list[np.ndarray], fits: list[np.ndarray]) -> np.ndarray:
    """Each sample's smallest value over the sizes it fits."""
    cheapest = np.full(len(values[0]), np.inf)
    for value, fit in zip(values, fits):
        np.minimum(cheapest, value, out=cheapest, where=fit)
    return cheapest


def _single(model: CostModel, samples: _SampleSizes, work: _Work, fewest: int) -> float:
    """The dearest sample's cheapest own pass on one rank of its group (its share of `work` and
    the pass terms), plus one pass for each other of the fewest micro-batches (with the CP fixed
    term when no CP1 group is allowed)."""
    passes = _pass_seconds(model, samples.sizes)
    every_pass = float(passes[0])  # the cheapest group's pass
    return _dearest_own_pass(samples, work, passes) + max(0, fewest - 1) * every_pass


def _dearest_own_pass(samples: _SampleSizes, work: _Work, passes: np.ndarray) -> float:
    """The largest over the samples of a sample's cheapest own pass over the sizes it fits."""
    if work.monotone:
        return _longest_samples_own_pass(samples, work, passes)
    own = [seconds / size + fixed for seconds, size, fixed in zip(work.columns, samples.sizes, passes)]
    return float(_cheapest(own, samples.fits).max())


def _longest_samples_own_pass(samples: _SampleSizes, work: _Work, passes: np.ndarray) -> float:
    """The longest sample's cheapest own pass, computed for it alone with `_dearest_own_pass`'s
    operations: the dearest when `work.monotone`. At one size, a longer sample's pass then never
    costs less (its padded length and its square never fall, the coefficients are >= 0), and it
    fits fewer sizes (a suffix of those a shorter one fits), so its cheapest pass never costs less."""
    longest = int(np.argmax(samples.lengths))
    first = int(samples.smallest_index[longest])
    padded = round_up(samples.lengths[longest], samples.multiples[first:])
    seconds = work.per_padded_token[first:] * padded + work.attention[longest]
    return float((seconds / samples.sizes[first:] + passes[first:]).min())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
