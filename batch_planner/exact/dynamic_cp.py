"""An exact, faster execution of Megatron-Core's `DefaultDynamicCPScheduler.get_groups_and_subsamples`.

Same decisions, same tie-breaking, same floating-point operations in the same order as upstream's
`next_hdp_group_packing_aware` (megatron/core/datasets/data_schedule_utils.py at the verified
builds, batch_planner/exact/verified.py), so the returned `sample_id_groups` are equal to
upstream's, list for list. docs/design.md ("The exact scheduler path") states why each change
below is exact; the differential tests (tests/batch_planner/test_exact_differential.py) check it on a corpus.

Where upstream spends its time, and what this module does instead:

1. For every sample, every CP size and every group of that size, upstream rescans the execution
   time of all DPxCP ranks (`projected_max`). Here the ranks of one CP group share one execution
   time (they are created together and always receive the same work), free ranks are at 0.0, and
   IEEE addition is monotone, so for a group g with time T_g and a sample cost c

       max over ranks of (time + c if rank in g else time)  ==  max(T_g + c, M)

   where M is the largest time of any rank (if T_g == M the left term is already the maximum).
   M only grows, so it is kept as one number. A new group on free ranks projects max(c, M).
2. The groups of one CP size are numpy arrays (times, packed lengths), so one CP size is a few
   array operations instead of a Python loop over groups; `argmin` returns the first minimum,
   which is upstream's "strictly smaller replaces" order within a size.
3. No candidate projects below M, so once one projects exactly M nothing after it can replace it:
   the search over CP sizes stops there.
4. A sample that fits nowhere leaves the state unchanged, and whether a sample fits is monotone in
   its length (for a power-of-two `min_cp_size` the CP sizes a shorter sample may use include a
   longer one's, and every bound is monotone in the length). Samples are sorted longest first, so
   after a sample that does not fit, the next one that fits is found by an exponential then binary
   search instead of trying every sample in between; the ones skipped are leftovers, in order.

The fill steps after the packing loop (expanding the smallest groups into empty ranks, or one
group over every rank) work on the group list and raise what upstream raises where upstream
raises. The VPP alignment is batch_planner/exact/align.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from batch_planner.exact.align import align_sample_id_groups

_INF = math.inf


@dataclass
class _SizeClass:
    """The groups of one CP size, in creation order: their shared rank time and packed length."""

    times: np.ndarray
    packed: np.ndarray
    group_index: list[int] = field(default_factory=list)  # position in _MicroBatch.groups

    @property
    def count(self) -> int:
        return len(self.group_index)


@dataclass
class _Group:
    first_rank: int
    size: int
    sample_ids: list[int]


class _MicroBatch:
    """One call of upstream's `next_hdp_group_packing_aware`, over the samples left, longest first."""

    def __init__(self, total_ranks: int, max_seq_len_per_rank: int, cap: float):
        self.total_ranks = total_ranks
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.cap = cap
        self.used_ranks = 0  # ranks [0, used_ranks) are in groups; the rest are free (time 0.0)
        self.max_time = 0.0  # M: the largest execution time of any rank
        self.groups: list[_Group] = []
        self.sizes: dict[int, _SizeClass] = {}

    def best(self, length: int, min_needed: int) -> tuple[float, int, int] | None:
        """Upstream's choice for one sample: (projected max, CP size, position among the groups of
        that size, or -1 for a new group), or None when no candidate stays within the cap."""
        best_value = _INF
        best: tuple[float, int, int] | None = None
        limit = self.max_seq_len_per_rank
        floor = self.max_time
        cp_size = min_needed
        while cp_size <= self.total_ranks:
            cost = (length * length) / cp_size
            size_class = self.sizes.get(cp_size)
            if size_class is not None:
                n = size_class.count
                fits = (size_class.packed[:n] + length / cp_size) <= limit
                projected = np.maximum(size_class.times[:n] + cost, floor)
                projected[~fits] = _INF
                position = int(np.argmin(projected))
                value = float(projected[position])
                if value <= self.cap and (best is None or value < best_value):
                    best_value, best = value, (value, cp_size, position)
            if self.total_ranks - self.used_ranks >= cp_size:
                value = max(cost, floor)
                if value <= self.cap and (best is None or value < best_value):
                    best_value, best = value, (value, cp_size, -1)
            if best is not None and best_value == floor:
                return best  # nothing projects below M, and only a strictly smaller value replaces
            cp_size *= 2
        return best

    def place(self, sample_id: int, length: int, cp_size: int, position: int) -> None:
        cost = (length * length) / cp_size
        if position < 0:
            self._new_group(cp_size)
            size_class = self.sizes[cp_size]
            position = size_class.count - 1
            size_class.packed[position] = length / cp_size
            time = size_class.times[position] = 0.0 + cost
        else:
            size_class = self.sizes[cp_size]
            size_class.packed[position] += length / cp_size
            size_class.times[position] += cost
            time = float(size_class.times[position])
        self.groups[size_class.group_index[position]].sample_ids.append(sample_id)
        if time > self.max_time:
            self.max_time = time

    def _new_group(self, cp_size: int) -> int:
        index = len(self.groups)
        self.groups.append(_Group(self.used_ranks, cp_size, []))
        self.used_ranks += cp_size
        size_class = self.sizes.get(cp_size)
        if size_class is None:
            capacity = max(1, self.total_ranks // cp_size)
            size_class = self.sizes[cp_size] = _SizeClass(np.zeros(capacity), np.zeros(capacity))
        size_class.group_index.append(index)
        return index



def _fill_empty_ranks(batch: _MicroBatch) -> bool:
    """Upstream's `fill_empty_gpus_once` on the group list: the first group of the smallest size
    that can double (capped at every rank) takes the ranks after it; the groups after it move up.
    Raises upstream's IndexError where the groups it pushes would pass the last rank."""
    total = batch.total_ranks
    empty_rank = batch.used_ranks
    if empty_rank >= total or not batch.groups:
        return False
    smallest = min(group.size for group in batch.groups)
    next_size = min(smallest * 2, total)
    needed = next_size - smallest
    for index, group in enumerate(batch.groups):
        if group.size != smallest:
            continue
        end = group.first_rank + group.size - 1
        if end + 1 > empty_rank or end + needed >= total:
            continue
        pushed = empty_rank - (end + 1)
        if pushed > 0 and end + needed + pushed >= total:
            raise IndexError("list assignment index out of range")
        group.size = next_size
        for later in batch.groups[index + 1 :]:
            later.first_rank += needed
        batch.used_ranks += needed
        return True
    return False


# Upstream's assertion messages, raised by both executions (the compiled one too).
NOTHING_FITS_ONE_GROUP = "At least one sequence should fit in the full DPxCP group; try to increase 'max-seqlen-per-dp-cp-rank'."


def first_needs_too_many(first_length: int, cp_size: int, total_ranks: int) -> str:
    return f"Sequence length {first_length} requires CP size {cp_size}, but only {total_ranks} DPxCP ranks are available."


def _one_group_over_every_rank(
    ids: list[int], lengths: list[int], total_ranks: int, max_seq_len_per_rank: int
) -> tuple[list[int], list[int]]:
    """Upstream's `fill_with_full_dpxcp_group`: the samples, in order, that fit one group over
    every rank (each adds length / ranks to the packed length), and the rest."""
    selected: list[int] = []
    left: list[int] = []
    packed = 0.0
    for position, length in enumerate(lengths):
        per_rank = length / total_ranks
        if packed + per_rank <= max_seq_len_per_rank:
            selected.append(position)
            packed += per_rank
        else:
            left.append(position)
    assert selected, NOTHING_FITS_ONE_GROUP
    return selected, left


def next_micro_batch(
    ids: list[int],
    lengths: list[int],
    total_ranks: int,
    max_seq_len_per_rank: int,
    min_cp_size: int,
    cp_min: Callable[[int, int, int], int],
    cap_delta: float,
) -> tuple[list[list[int]], list[int]]:
    """One micro-batch from the samples left (`ids`, `lengths`: longest first, upstream's order):
    its sample ids per DPxCP rank, and the positions of the samples left over, in order."""
    first_length = lengths[0]
    cp_size = cp_min(first_length, max_seq_len_per_rank, min_cp_size)
    assert cp_size <= total_ranks, first_needs_too_many(first_length, cp_size, total_ranks)
    cap = float(first_length) * float(max_seq_len_per_rank) * (1.0 + cap_delta)
    batch = _MicroBatch(total_ranks, max_seq_len_per_rank, cap)
    batch.place(ids[0], first_length, cp_size, -1)

    leftovers: list[int] = []
    count = len(lengths)
    position = 1
    while position < count:
        length = lengths[position]
        choice = batch.best(length, cp_min(length, max_seq_len_per_rank, min_cp_size))
        if choice is not None:
            batch.place(ids[position], length, choice[1], choice[2])
            position += 1
            continue
        # Nothing fits this sample, and the state does not change until something does: find the
        # first shorter sample that fits (fitting is monotone in the length) and skip to it.
        fits = lambda p: batch.best(lengths[p], cp_min(lengths[p], max_seq_len_per_rank, min_cp_size)) is not None  # noqa: E731
        nxt = _first_true(fits, position, count)
        leftovers.extend(range(position, nxt))
        position = nxt

    while batch.used_ranks < total_ranks:
        if not _fill_empty_ranks(batch):
            selected, left = _one_group_over_every_rank(ids, lengths, total_ranks, max_seq_len_per_rank)
            chosen = [ids[p] for p in selected]
            return [list(chosen) for _ in range(total_ranks)], left

    per_rank: list[list[int]] = []
    for group in batch.groups:
        per_rank.extend(list(group.sample_ids) for _ in range(group.size))
    return per_rank, leftovers


def _first_true(predicate: Callable[[int], bool], known_false: int, end: int) -> int:
    """The first position after `known_false` where a predicate that is False up to some position
    and True from there on holds, or `end`: an exponential then a binary search."""
    lo, step = known_false, 1  # predicate(lo) is False
    hi = lo + step
    while hi < end and not predicate(hi):
        lo = hi
        step *= 2
        hi = lo + step
    hi = min(hi, end)  # predicate(hi) is True, or hi == end
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid
    return hi


def get_groups_and_subsamples(
    sample_id_seqlens: list[tuple[int, int]],
    *,
    max_seq_len_per_rank: int,
    total_ranks: int,
    min_cp_size: int,
    microbatch_group_size_per_vp_stage: int | None,
    cp_min: Callable[[int, int, int], int],
    cap_delta: float,
) -> list[list[list[int]]]:
    """`DefaultDynamicCPScheduler.get_groups_and_subsamples`, exactly (see the module doc)."""
    if min_cp_size < 1 or min_cp_size & (min_cp_size - 1):
        raise ValueError(f"the exact dynamic-CP path needs a power-of-two min_cp_size, got {min_cp_size}")
    ordered = sorted(sample_id_seqlens, key=lambda pair: pair[1], reverse=True)
    ids = [sample_id for sample_id, _ in ordered]
    lengths = [length for _, length in ordered]
    sample_id_groups: list[list[list[int]]] = []
    while ids:
        per_rank, left = next_micro_batch(ids, lengths, total_ranks, max_seq_len_per_rank, min_cp_size, cp_min, cap_delta)
        sample_id_groups.append(per_rank)
        ids = [ids[p] for p in left]
        lengths = [lengths[p] for p in left]
    if microbatch_group_size_per_vp_stage is not None and microbatch_group_size_per_vp_stage > 1:
        sample_id_groups = align_sample_id_groups(sample_id_groups, microbatch_group_size_per_vp_stage)
    return sample_id_groups
