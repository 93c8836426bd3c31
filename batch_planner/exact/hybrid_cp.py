"""An exact, faster execution of Megatron-Core's `BalancedCPScheduler.get_groups_and_subsamples`.

Upstream (megatron/core/pipeline_parallel/hybrid_cp_schedule.py, the same class source in the dev
build and in the 0.19.2 release) sorts the samples longest first (stable), then calls
`next_hdp_group` on the samples left until none are: each call is one micro-batch. A call

1. splits the samples left, in their order, into "buckets" of consecutive samples with about equal
   work (`make_buckets_equal`; work = length**2 / CP size, CP size = `gpus_needed`);
2. repeatedly takes the head of the first bucket whose head can be placed (a group of its CP size
   exists, or enough ranks are free), and adds it to a new group on the first free ranks, or to
   the group of that size with the least load, adding the cost to every member's execution time;
   once a sample with a smaller CP size than the micro-batch's first was placed, it stops as soon
   as the spread of all ranks' times is within 5 % of the largest;
3. leaves the bucket contents not placed as leftovers, in bucket order;
4. `trim_overload`: while it lowers the spread, takes the last sample off the most loaded group
   and appends it to the leftovers;
5. `fill_empty_gpus`: while ranks are empty, doubles (capped at every rank) the first group of the
   smallest size, pushing the groups after it up.

This module makes the same decisions, with the same tie-breaking and the same floating-point
operations in the same order, on a group-level state instead of a rank-level one. Why that is exact:

- The ranks of one group always share one execution time. A group is created on free ranks at
  0.0 and every later addition (step 2) or subtraction (step 4) applies the same cost to every
  member, and the fill step (5) runs after the last use of the times that matter. So every
  `max`/`min`/`index` over ranks is the same over group times (a value, not a sum: no rounding).
- Free ranks are the ranks never assigned: they are at 0.0, so upstream's
  `sorted(free_ranks, key=exec_times)` (stable) is the free ranks in rank order, and a new group
  takes ranks [used, used + size). Groups therefore sit in creation order along the ranks, and
  "first rank holding the maximum" is "first group (in creation order) holding the maximum".
- Every cost is positive (length >= 1), so during step 2 a group's load is > 0.0 = a new group's
  load: upstream starts a new group whenever enough ranks are free, and otherwise takes the group
  of the sample's size with the least load, the first one on ties (`min(..., key=)` keeps the first
  minimum; groups are iterated in creation order). Here each CP size keeps a heap of
  (time, creation index), whose top is exactly that group; the time update is the same `t + c`.
- During step 2 times only grow (IEEE addition of a positive number is monotone), so the largest
  rank time is one running number; the smallest is 0.0 while ranks are free, else the least of the
  heap tops (one per CP size). The balance test is then upstream's expression on the same values.
- Buckets are consecutive ranges of the list and only lose their heads, so each is a range with a
  head position. Their boundaries use the same sums: `sum()` over the same list of floats (Python
  3.12's compensated sum, so it must be `sum` itself) and running totals from `numpy.cumsum`,
  which adds sequentially, exactly as `cur_work + work` does (cur_work starts at 0.0, and
  0.0 + w == w).
- `trim_overload` runs only when no rank is free (a free rank holds 0.0 and it stops on a 0.0
  minimum); there it works on the array of group times in creation order: `argmax` is the first
  maximum, the projected times are the same subtraction on the same group.
- `fill_empty_gpus` only reads group sizes and rank ranges; each call either raises or grows the
  used ranks, so it never loops. It raises upstream's AssertionError when no group exists (the
  message is only the assert's first string literal: the second line is a separate statement),
  and IndexError exactly when upstream's writes would pass the last rank (used - 1 + growth >= ranks).
  The times it writes are never read for `sample_id_groups`.

So upstream cannot loop for ever here: every call places at least one sample, which trimming
never takes back (a group keeps its last sample), or else places none and the fill step raises;
every fill step grows the used ranks or raises; and `fill_empty_gpus` never returns None (its loop
always reaches a group of the smallest size, and that iteration returns or raises), so upstream's
unpacking TypeError cannot happen. `SchedulerWouldNotTerminate` is only a guard on the first
argument: it is raised should a micro-batch ever consume nothing, where upstream would repeat it.

Upstream's quirks, kept: a bucket also closes when `len - i <= remaining_k - len(buckets)`, i.e.
k - 2 * (buckets closed so far); `prev_needed` is set once per micro-batch (the first sample's CP
size), so the balance check starts at the first smaller CP size and stays on; `trim_overload`
pops the most loaded group's last sample (LIFO) and appends it after the bucket leftovers, so the
next micro-batch's list is not sorted. Quirks with no effect on `sample_id_groups`: the
`@lru_cache` on methods (pure functions of their arguments), `[[]] * n` in `fill_empty_gpus`
(upstream's expanded ranks share one list object; here each rank has its own, equal, list), the
exec times `fill_empty_gpus` writes (only the first sample's work), and
`sample_ids.extend([] * ...)` (extends by nothing).

Each placement costs O(buckets + CP sizes + log groups) instead of O(ranks + groups); each
micro-batch's bucketing is a few numpy passes over the samples left.

Inputs: lengths are ints (the planner's). Invalid values fail as upstream does: a length <= 0 or a
negative `max_seq_len_per_rank` raises ValueError('math domain error'), a zero one
ZeroDivisionError, from the same expression evaluated on the samples in the same order; no ranks
at all (total_ranks <= 0) raises upstream's ValueError from `max()` of an empty list.
"""

from __future__ import annotations

import heapq
from bisect import insort
from math import ceil, log2

import numpy as np

from batch_planner.errors import SchedulerWouldNotTerminate

_DELTA = 0.05  # next_hdp_group's default `delta`: the balance slack
_BUCKET_SLACK = 1.1  # make_buckets_equal's "too much work" factor
NO_GROUP_MESSAGE = "There should be at least one group existing, cannot reditribute, "
NOT_ENOUGH_MESSAGE = "Empty GPUs were detected but not enough to expand."
INDEX_MESSAGE = "list assignment index out of range"
EMPTY_MAX_MESSAGE = "max() iterable argument is empty"


def _gpus_needed(length: int, max_seq_len_per_rank: int) -> int:
    """Upstream's `gpus_needed`, the same expression."""
    return max(1, 2 ** ceil(log2((length / max_seq_len_per_rank))))


def _buckets(needs: list[int], costs: list[float], cost_array: np.ndarray) -> list[list[int]]:
    """`make_buckets_equal` as [start, end) ranges over the samples left (in their order)."""
    n = len(costs)
    k = len(set(needs))
    target = sum(costs) / k  # builtin sum: Python 3.12's compensated float sum, as upstream
    threshold = target * _BUCKET_SLACK
    ranges: list[list[int]] = []
    start = 0
    while start < n:
        # projected work at position i (> start) is cumsum over [start, i], sequential like upstream.
        # Upstream closes the bucket at the first i > start with projected > threshold, or with
        # n - i <= remaining_k - len(buckets) == k - 2 * (buckets closed so far).
        index_bound = n - (k - 2 * len(ranges))  # i >= index_bound closes
        end = n
        if index_bound <= start + 1:
            end = start + 1 if start + 1 < n else n
        else:
            running = np.cumsum(cost_array[start:index_bound])
            over = np.flatnonzero(running[1:] > threshold)
            if over.size:
                end = start + 1 + int(over[0])
            elif index_bound < n:
                end = index_bound
        ranges.append([start, end])
        start = end
    return ranges


class _MicroBatch:
    """One call of upstream's `next_hdp_group` on the group level."""

    def __init__(self, total_ranks: int):
        self.total_ranks = total_ranks
        self.used = 0
        self.sizes: list[int] = []  # per group, in creation (= rank) order
        self.times: list[float] = []
        self.members: list[list[int]] = []  # per group: positions (into the list left) of its samples
        self.heaps: dict[int, list[tuple[float, int]]] = {}  # CP size -> (time, group) heap

    def min_time(self) -> float:
        if self.used < self.total_ranks:
            return 0.0
        return min(heap[0][0] for heap in self.heaps.values())


def _next_micro_batch(ids: list, needs: list[int], costs: list[float], total_ranks: int) -> tuple[list[list], list[int]]:
    """One micro-batch: its sample ids per DPxCP rank, and the positions of the samples left over
    (upstream's leftover order)."""
    cost_array = np.array(costs, dtype=np.float64)
    ranges = _buckets(needs, costs, cost_array)
    batch = _MicroBatch(total_ranks)
    heaps = batch.heaps
    times = batch.times
    members = batch.members
    first_open = 0  # upstream pops empty leading buckets
    number = len(ranges)
    prev_needed = None
    check_balance = False
    max_time = 0.0

    while first_open < number:
        free = total_ranks - batch.used
        picked = None
        for b in range(first_open, number):
            head, end = ranges[b]
            if head == end:
                continue
            needed = needs[head]
            if needed in heaps or free >= needed:
                picked = b
                break
        if picked is None:
            break
        position = ranges[picked][0]
        if prev_needed is None:
            prev_needed = needed
        cost = costs[position]
        if free >= needed:  # a new group's load (0.0) beats every existing group's (> 0.0)
            group = len(times)
            time = 0.0 + cost
            batch.sizes.append(needed)
            times.append(time)
            members.append([position])
            batch.used += needed
            heap = heaps.get(needed)
            if heap is None:
                heaps[needed] = [(time, group)]
            else:
                heapq.heappush(heap, (time, group))
        else:
            heap = heaps[needed]
            group = heap[0][1]
            time = times[group] + cost
            times[group] = time
            members[group].append(position)
            heapq.heapreplace(heap, (time, group))
        if time > max_time:
            max_time = time
        ranges[picked][0] = position + 1
        while first_open < number and ranges[first_open][0] == ranges[first_open][1]:
            first_open += 1
        if needed < prev_needed:
            check_balance = True
        if check_balance and first_open < number and max_time - batch.min_time() <= _DELTA * max_time:
            break

    leftovers: list[int] = []
    for head, end in ranges[first_open:]:
        leftovers.extend(range(head, end))

    if batch.used >= total_ranks and times:
        _trim_overload(batch, costs, leftovers)

    _fill_empty_ranks(batch)

    per_rank: list[list] = []
    for size, group_members in zip(batch.sizes, members):
        sample_ids = [ids[p] for p in group_members]
        per_rank.extend(list(sample_ids) for _ in range(size))
    return per_rank, leftovers


def _trim_overload(batch: _MicroBatch, costs: list[float], leftovers: list[int]) -> None:
    """Upstream's `trim_overload` when no rank is free (with free ranks it stops at once)."""
    times = np.array(batch.times, dtype=np.float64)
    members = batch.members
    while True:
        cur_max = float(times.max())
        cur_min = float(times.min())
        cur_slack = cur_max - cur_min
        if cur_slack <= _DELTA * cur_max:
            break
        if cur_min == 0:
            break
        group = int(np.argmax(times))  # the first maximum: the first rank holding it
        if len(members[group]) <= 1:
            break
        position = members[group][-1]
        old = float(times[group])
        times[group] = old - costs[position]
        proj_slack = float(times.max()) - float(times.min())
        if proj_slack < cur_slack:
            members[group].pop()
            leftovers.append(position)
        else:
            times[group] = old
            break


def _fill_empty_ranks(batch: _MicroBatch) -> None:
    """Upstream's `fill_empty_gpus` loop, on group sizes: while ranks are empty, the first group of
    the smallest size grows to min(2 * size, ranks); the groups after it move up."""
    total = batch.total_ranks
    if batch.used >= total:
        return
    sizes = batch.sizes
    by_size: dict[int, list[int]] = {}
    for group, size in enumerate(sizes):
        by_size.setdefault(size, []).append(group)
    while batch.used < total:
        if not by_size:
            raise AssertionError(NO_GROUP_MESSAGE)
        smallest = min(by_size)
        next_size = min(smallest * 2, total)
        needed = next_size - smallest
        groups = by_size[smallest]
        group = groups.pop(0)
        if not groups:
            del by_size[smallest]
        if needed <= 0:
            raise AssertionError(NOT_ENOUGH_MESSAGE)
        if batch.used - 1 + needed >= total:
            raise IndexError(INDEX_MESSAGE)
        sizes[group] = next_size
        insort(by_size.setdefault(next_size, []), group)
        batch.used += needed


def get_groups_and_subsamples(sample_id_seqlens: list[tuple[int, int]], *, max_seq_len_per_rank: int, total_ranks: int) -> list[list[list[int]]]:
    """`BalancedCPScheduler(max_seq_len_per_rank, <group of size total_ranks>)
    .get_groups_and_subsamples(sample_id_seqlens, None)[1]` (the sample_id_groups), exactly."""
    ordered = sorted(sample_id_seqlens, key=lambda x: x[1], reverse=True)
    ids = [pair[0] for pair in ordered]
    lengths = [pair[1] for pair in ordered]
    need_of: dict[int, int] = {}
    needs: list[int] = []
    for length in lengths:  # upstream's first make_buckets_equal evaluates these in this order
        needed = need_of.get(length)
        if needed is None:
            needed = need_of[length] = _gpus_needed(length, max_seq_len_per_rank)
        needs.append(needed)
    costs = [(length * length) / needed for length, needed in zip(lengths, needs)]
    sample_id_groups: list[list[list[int]]] = []
    while ids:
        if total_ranks <= 0:  # upstream places nothing, then trim_overload's max() of no ranks raises
            raise ValueError(EMPTY_MAX_MESSAGE)
        per_rank, left = _next_micro_batch(ids, needs, costs, total_ranks)
        if len(left) >= len(ids):  # unreachable (module doc); upstream would repeat this call for ever
            raise SchedulerWouldNotTerminate(
                f"Megatron-Core's BalancedCPScheduler would loop for ever on this batch: a micro-batch placed none of the {len(ids)} samples left"
            )
        sample_id_groups.append(per_rank)
        ids = [ids[p] for p in left]
        needs = [needs[p] for p in left]
        costs = [costs[p] for p in left]
    return sample_id_groups
