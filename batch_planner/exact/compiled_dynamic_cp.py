"""The exact dynamic-CP path (batch_planner/exact/dynamic_cp.py) with its packing loop compiled.

`get_groups_and_subsamples` here returns what `dynamic_cp.get_groups_and_subsamples` returns, list
for list, and raises what it raises: the packing loop of one micro-batch (`best`, `place` and the
skip over samples that fit nowhere, in dynamic_cp.py's module doc) runs as machine code
(batch_planner/exact/compiler.py), every other step (the sort, upstream's `dcp_gpus_needed`, the
fill steps, the VPP alignment) is dynamic_cp.py's own Python.

Why the compiled loop makes the same decisions: it is the same algorithm on the same values, with
the same IEEE double operations in the same order, and no fast-math (no reassociation, no
contraction into fused multiply-adds):

- `(length * length) / cp_size` and `length / cp_size`: Python divides two ints that are exact as
  doubles by dividing their doubles (CPython's true division does exactly that below 2**53), which
  is what the compiled code does; every length's square, `max_seq_len_per_rank` and the CP sizes
  are checked below 2**53 first (`_fits_the_kernel`), and anything else runs dynamic_cp.py.
- `numpy.maximum(times + cost, floor)` then `argmin` over the groups of one CP size, with groups that
  do not fit at +inf: the first group (in creation order) with the smallest projected value, found
  by a loop that replaces only on a strictly smaller value. The same comparisons: `<= cap`,
  `< best`, `== floor`, `<= max_seq_len_per_rank`.
- Upstream's `dcp_gpus_needed` is called in Python, by upstream's own function, once per distinct
  length before the loop; should it raise on any length, dynamic_cp.py runs the whole batch instead,
  so the exception comes where, and as, dynamic_cp.py (and upstream) raise it.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import numpy as np

from batch_planner.exact import dynamic_cp
from batch_planner.exact.align import align_sample_id_groups
from batch_planner.exact.compiler import kernel

_FLOAT_EXACT = 2**53  # integers below this are exact as doubles
_LARGEST_CP = 2**52


@kernel
def _best(length, min_needed, total_ranks, used_ranks, limit, cap, floor, times, packed, offsets, counts):
    """dynamic_cp._MicroBatch.best: (found, value, CP size, position or -1 for a new group)."""
    best_value = math.inf
    found = False
    best_size = 0
    best_position = -1
    cp_size = min_needed
    level = 0
    while (1 << level) < min_needed:
        level += 1
    while cp_size <= total_ranks:
        cost = float(length * length) / float(cp_size)
        per_rank = float(length) / float(cp_size)
        n = counts[level]
        if n > 0:
            start = offsets[level]
            value = math.inf
            position = 0
            for i in range(n):
                if packed[start + i] + per_rank <= limit:
                    projected = times[start + i] + cost
                    if projected < floor:
                        projected = floor
                    if projected < value:
                        value = projected
                        position = i
            if value <= cap and (not found or value < best_value):
                best_value, found, best_size, best_position = value, True, cp_size, position
        if total_ranks - used_ranks >= cp_size:
            value = cost if cost >= floor else floor
            if value <= cap and (not found or value < best_value):
                best_value, found, best_size, best_position = value, True, cp_size, -1
        if found and best_value == floor:
            return found, best_value, best_size, best_position
        cp_size *= 2
        level += 1
    return found, best_value, best_size, best_position


@kernel
def _pack(lengths, needs, total_ranks, limit, cap, group_of, group_sizes):
    """One micro-batch's packing loop (dynamic_cp.next_micro_batch up to the fill steps) over the
    samples left, longest first: `group_of[p]` becomes sample p's group (creation order) or -1 for
    a leftover, `group_sizes[g]` group g's CP size. Returns (groups, used ranks)."""
    levels = 1
    while (1 << levels) <= total_ranks:
        levels += 1
    offsets = np.zeros(levels + 1, dtype=np.int64)
    for level in range(levels):
        offsets[level + 1] = offsets[level] + max(1, total_ranks >> level)
    counts = np.zeros(levels, dtype=np.int64)
    times = np.zeros(offsets[levels], dtype=np.float64)
    packed = np.zeros(offsets[levels], dtype=np.float64)
    slot_group = np.zeros(offsets[levels], dtype=np.int64)
    state = np.zeros(2, dtype=np.int64)  # groups, used ranks
    max_time = np.zeros(1, dtype=np.float64)
    count = lengths.shape[0]
    _place(0, lengths[0], needs[0], -1, total_ranks, times, packed, offsets, counts, slot_group, group_of, group_sizes, state, max_time)
    position = 1
    while position < count:
        found, value, size, slot = _best(
            lengths[position], needs[position], total_ranks, state[1], limit, cap, max_time[0], times, packed, offsets, counts
        )
        if found:
            _place(position, lengths[position], size, slot, total_ranks, times, packed, offsets, counts, slot_group, group_of, group_sizes, state, max_time)
            position += 1
            continue
        # dynamic_cp._first_true: exponential then binary search for the first sample that fits.
        lo = position
        step = 1
        hi = lo + step
        while hi < count and not _best(lengths[hi], needs[hi], total_ranks, state[1], limit, cap, max_time[0], times, packed, offsets, counts)[0]:
            lo = hi
            step *= 2
            hi = lo + step
        if hi > count:
            hi = count
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _best(lengths[mid], needs[mid], total_ranks, state[1], limit, cap, max_time[0], times, packed, offsets, counts)[0]:
                hi = mid
            else:
                lo = mid
        for skipped in range(position, hi):
            group_of[skipped] = -1
        position = hi
    return state[0], state[1]


@kernel
def _place(position, length, cp_size, slot, total_ranks, times, packed, offsets, counts, slot_group, group_of, group_sizes, state, max_time):
    """dynamic_cp._MicroBatch.place."""
    level = 0
    while (1 << level) < cp_size:
        level += 1
    cost = float(length * length) / float(cp_size)
    start = offsets[level]
    if slot < 0:
        slot = counts[level]
        counts[level] += 1
        group = state[0]
        state[0] += 1
        state[1] += cp_size
        group_sizes[group] = cp_size
        slot_group[start + slot] = group
        packed[start + slot] = float(length) / float(cp_size)
        time = 0.0 + cost
        times[start + slot] = time
    else:
        packed[start + slot] += float(length) / float(cp_size)
        time = times[start + slot] + cost
        times[start + slot] = time
    group_of[position] = slot_group[start + slot]
    if time > max_time[0]:
        max_time[0] = time


@kernel
def _one_group(lengths, total_ranks, limit, selected):
    """dynamic_cp._one_group_over_every_rank's loop: `selected[p]` whether sample p joins the one
    group over every rank (each adds length / ranks to its packed length, in order)."""
    packed = 0.0
    for position in range(lengths.shape[0]):
        per_rank = float(lengths[position]) / float(total_ranks)
        if packed + per_rank <= limit:
            selected[position] = True
            packed += per_rank
        else:
            selected[position] = False


def _fits_the_kernel(lengths: np.ndarray, needs: np.ndarray, max_seq_len_per_rank: int, total_ranks: int) -> bool:
    """Whether every value the loop computes with is an int exact as a double (module doc), and
    every CP size a power of two the loop can index."""
    if not len(lengths) or int(lengths[-1]) < 1 or int(lengths[0]) ** 2 >= _FLOAT_EXACT:
        return False
    if not 0 < max_seq_len_per_rank < _FLOAT_EXACT or not 0 < total_ranks < _LARGEST_CP:
        return False
    return bool(((needs >= 1) & (needs < _LARGEST_CP) & ((needs & (needs - 1)) == 0)).all())


# Upstream's `dcp_gpus_needed` values already computed in this process, per (function, budget,
# min_cp_size): a pure function's results (auto's candidates and a job's steps repeat budgets and
# lengths), bounded in size.
_NEEDS_SEEN: dict[tuple[Callable, int, int], dict[int, int]] = {}
_NEEDS_SEEN_MOST = 1 << 20


def _needs(lengths: np.ndarray, max_seq_len_per_rank: int, min_cp_size: int, cp_min: Callable[[int, int, int], int]) -> np.ndarray:
    """Upstream's `dcp_gpus_needed` of every sample (lengths longest first), called once per
    distinct length not seen before with these arguments; raises what it raises."""
    call = getattr(cp_min, "__wrapped__", cp_min)  # its lru_cache holds 128: a pure function either way
    distinct, inverse = np.unique(lengths, return_inverse=True)
    if sum(map(len, _NEEDS_SEEN.values())) > _NEEDS_SEEN_MOST:
        _NEEDS_SEEN.clear()
    seen = _NEEDS_SEEN.setdefault((cp_min, max_seq_len_per_rank, min_cp_size), {})
    values = []
    for length in distinct.tolist():
        value = seen.get(length)
        if value is None:
            value = call(length, max_seq_len_per_rank, min_cp_size)
            if type(value) is not int:
                raise TypeError("dcp_gpus_needed returned a non-int")
            if not 0 < value < _LARGEST_CP:
                raise OverflowError("a CP size the compiled loop cannot index")
            seen[length] = value
        values.append(value)
    return np.array(values, dtype=np.int64)[inverse]


def _micro_batch(
    ids: list, positions: np.ndarray, lengths: np.ndarray, needs: np.ndarray, total_ranks: int, max_seq_len_per_rank: int,
    cap_delta: float,
) -> tuple[list[list[int]], np.ndarray]:
    """dynamic_cp.next_micro_batch with the packing loop compiled, over the samples left (`positions`
    into `ids`, longest first): the micro-batch's sample ids per rank, and the indices (into
    `positions`) of the samples left over, in order."""
    first_length = int(lengths[0])
    cp_size = int(needs[0])
    assert cp_size <= total_ranks, dynamic_cp.first_needs_too_many(first_length, cp_size, total_ranks)
    cap = float(first_length) * float(max_seq_len_per_rank) * (1.0 + cap_delta)
    group_of = np.empty(len(lengths), dtype=np.int64)
    group_sizes = np.empty(total_ranks, dtype=np.int64)
    groups, used = _pack(lengths, needs, total_ranks, float(max_seq_len_per_rank), cap, group_of, group_sizes)
    placed = np.flatnonzero(group_of >= 0)
    order = placed[np.argsort(group_of[placed], kind="stable")]  # each group's samples in placement order
    bounds = np.searchsorted(group_of[order], np.arange(groups + 1))
    batch = dynamic_cp._MicroBatch(total_ranks, max_seq_len_per_rank, cap)
    first_rank = 0
    order_list = positions[order].tolist()
    for index, size in enumerate(group_sizes[:groups].tolist()):
        members = [ids[p] for p in order_list[bounds[index] : bounds[index + 1]]]
        batch.groups.append(dynamic_cp._Group(first_rank, size, members))
        first_rank += size
    batch.used_ranks = int(used)
    leftovers = np.flatnonzero(group_of < 0)
    while batch.used_ranks < total_ranks:
        if not dynamic_cp._fill_empty_ranks(batch):
            selected = np.empty(len(lengths), dtype=np.bool_)
            _one_group(lengths, total_ranks, float(max_seq_len_per_rank), selected)
            assert selected.any(), dynamic_cp.NOTHING_FITS_ONE_GROUP
            chosen = [ids[p] for p in positions[selected].tolist()]
            return [chosen] * total_ranks, np.flatnonzero(~selected)
    # The ranks of one group share one list (as DpBalancedScheduler's do): equal, list for list,
    # to dynamic_cp's copies, which no caller mutates; a copy per rank is most of a plan's time.
    per_rank: list[list[int]] = []
    for group in batch.groups:
        per_rank.extend([group.sample_ids] * group.size)
    return per_rank, leftovers


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
    """dynamic_cp.get_groups_and_subsamples, its packing loop compiled (module doc)."""
    python_path = partial(
        dynamic_cp.get_groups_and_subsamples, sample_id_seqlens, max_seq_len_per_rank=max_seq_len_per_rank, total_ranks=total_ranks,
        min_cp_size=min_cp_size, microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage, cp_min=cp_min, cap_delta=cap_delta,
    )
    given = [length for _, length in sample_id_seqlens]
    if min_cp_size < 1 or min_cp_size & (min_cp_size - 1) or not given or not all(type(length) is int for length in given):
        return python_path()
    if not (0 < min(given) and max(given) ** 2 < _FLOAT_EXACT):  # the kernel's exact range (module doc)
        return python_path()
    # sorted(..., key=length, reverse=True) keeps equal lengths in their order: a stable argsort of -length.
    order = np.argsort(-np.array(given, dtype=np.int64), kind="stable")
    lengths = np.array(given, dtype=np.int64)[order]
    try:
        needs = _needs(lengths, max_seq_len_per_rank, min_cp_size, cp_min)
    except Exception:  # noqa: BLE001 - an input the loop cannot take: the Python path raises (or plans) it
        return python_path()
    if not _fits_the_kernel(lengths, needs, max_seq_len_per_rank, total_ranks):
        return python_path()
    ids = [sample_id for sample_id, _ in sample_id_seqlens]
    positions = order  # the samples left, longest first, as positions in `ids`
    sample_id_groups: list[list[list[int]]] = []
    while len(positions):
        per_rank, left = _micro_batch(ids, positions, lengths, needs, total_ranks, max_seq_len_per_rank, cap_delta)
        sample_id_groups.append(per_rank)
        positions, lengths, needs = positions[left], lengths[left], needs[left]
    if microbatch_group_size_per_vp_stage is not None and microbatch_group_size_per_vp_stage > 1:
        sample_id_groups = align_sample_id_groups(sample_id_groups, microbatch_group_size_per_vp_stage)
    return sample_id_groups


def prepare() -> None:
    """Compiles (or loads from the on-disk cache) the loop, by planning one tiny batch: what the
    server's worker preload and the trainer's fallback pay at start instead of on a plan."""
    lengths = np.array([3, 2, 1], dtype=np.int64)
    needs = np.array([1, 1, 1], dtype=np.int64)
    _pack(lengths, needs, 2, 4.0, 9.45, np.empty(3, dtype=np.int64), np.empty(2, dtype=np.int64))
    _one_group(lengths, 2, 4.0, np.empty(3, dtype=np.bool_))
