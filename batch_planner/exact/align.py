"""Megatron-Core's `align_sample_id_groups` (VPP: the micro-batch count made a multiple of the
micro-batch group size), with the same list operations, results and exceptions, except that where
upstream would loop for ever this raises `SchedulerWouldNotTerminate`.

Upstream splits a tail micro-batch in two at a CP-group boundary and refills each half's empty
ranks by doubling a CP group (`fill_empty_by_expanding_cp`, repeated while the last rank is
empty). On some layouts (non-power-of-two DPxCP, few samples) one refill step changes nothing, or
comes back to a micro-batch it had before, and upstream repeats it for ever. The step is a
function of the micro-batch's contents alone, so a repeated content means an endless loop: it is
detected exactly, by remembering the contents seen.

This costs nothing that matters: it runs once per plan on a few micro-batches.
"""

from __future__ import annotations

from batch_planner.errors import SchedulerWouldNotTerminate

Ranks = list[list[int]]  # one micro-batch: sample ids per DPxCP rank

NO_SPLIT_MESSAGE = "align_sample_id_groups: no tail microbatch has enough ids to split"


def align_sample_id_groups(sample_id_groups: list[Ranks], microbatch_group_size_per_vp_stage: int) -> list[Ranks]:
    multiple = int(microbatch_group_size_per_vp_stage)
    missing = (-len(sample_id_groups)) % multiple
    index = len(sample_id_groups) - 1
    attempts_since_split = 0
    while missing > 0:
        if index < 0:
            if attempts_since_split >= len(sample_id_groups):
                raise AssertionError(NO_SPLIT_MESSAGE)
            index = len(sample_id_groups) - 1
        first, second = _split(sample_id_groups[index])
        if first is not None and second is not None:
            sample_id_groups[index] = first
            sample_id_groups.append(second)
            missing -= 1
            attempts_since_split = 0
        else:
            attempts_since_split += 1
        index -= 1
    return sample_id_groups


def _group_bounds(ranks: Ranks) -> list[int]:
    """Where each CP group starts (and the end), walking runs of ranks that hold the first id of
    the run's first rank; upstream asserts the run lengths never grow."""
    total = len(ranks)
    bounds = [0]
    previous = 0
    while bounds[-1] != total:
        start = bounds[-1]
        first_id = ranks[start][0]
        size = 0
        for rank in range(start, total):
            if first_id not in ranks[rank]:
                break
            size += 1
        if previous != 0 and size > previous:
            raise AssertionError(f"split_group: CP size is not decreasing: prev={previous}, cur={size}")
        bounds.append(start + size)
        previous = size
    return bounds


def _split(ranks: Ranks) -> tuple[Ranks | None, Ranks | None]:
    """Upstream's `split_group`: (the new micro-batch, the rest), or (None, None) for one group."""
    total = len(ranks)
    bounds = _group_bounds(ranks)
    if len(bounds) == 2:
        return None, None
    cut_at = 0
    while bounds[cut_at] < total // 2:
        cut_at += 1
    cut = bounds[cut_at]
    kept = ranks[:cut] + [[] for _ in range(total - cut)]
    moved = ranks[cut:] + [[] for _ in range(cut)]
    kept = _fill_by_expanding_cp(kept)
    moved = _fill_by_expanding_cp(moved)
    return moved, kept


def _fill_by_expanding_cp(ranks: Ranks) -> Ranks:
    """Upstream's `fill_empty_by_expanding_cp`: repeat one refill step while the last rank is
    empty; a content seen before means upstream never stops."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    while len(ranks[-1]) == 0:
        state = tuple(tuple(ids) for ids in ranks)
        if state in seen:
            raise SchedulerWouldNotTerminate(
                "Megatron-Core's align_sample_id_groups would loop for ever on this batch: refilling a split "
                f"micro-batch of {len(ranks)} DPxCP ranks by expanding a CP group comes back to where it was "
                "(VPP micro_batch_group_size with this DPxCP size and batch)"
            )
        seen.add(state)
        ranks = _fill_once(ranks)
    return ranks


def _fill_once(ranks: Ranks) -> Ranks:
    """Upstream's `fill_empty`, slice for slice: walking CP groups from the last non-empty rank
    back, copy the first group that is larger than the one after it (or, reaching rank 0, the first
    group if it fits the empty ranks) over the ranks after it, shifting the rest right."""
    empty = sum(1 for ids in ranks if len(ids) == 0)
    rank = len(ranks) - 1 - empty
    previous = 0
    while rank >= 0:
        first_id = ranks[rank][0]
        size = 0
        # Upstream reads ranks[rank] before checking rank >= 0, so at rank -1 it reads the last rank.
        while first_id in ranks[rank] and rank >= 0:
            size += 1
            rank -= 1
        if size > previous and previous != 0:
            start = rank + 1 + size
            end = -empty + previous if -empty + previous < 0 else None
            ranks[start + 2 * previous : end] = ranks[start + previous : -empty]
            ranks[start + previous : start + 2 * previous] = ranks[start : start + previous]
            break
        if size <= empty and rank == -1:
            end = -empty + size if -empty + size < 0 else None
            ranks[2 * size : end] = ranks[size:-empty]
            ranks[size : 2 * size] = ranks[0:size]
            break
        previous = size
    return ranks
