"""Shard geometry: which tokens of an execution unit each rank of its CP group holds.

Pure integer arithmetic over padded lengths (batch_planner/padding.py), shared by the trainer client
(trainer_client/plans/apply.py builds the tensors from it) and the GPU benchmark. docs/design.md,
"Padding, layouts and statistics":

- zigzag: each *sequence* of the unit is cut into 2c chunks; rank r holds chunks r and 2c-1-r of
  every sequence (balanced causal attention).
- contiguous: the unit's *whole padded THD buffer* (its padded sequences, concatenated) is cut into
  c consecutive intervals; rank r holds interval r. That is how Megatron-LM dev's
  `get_cp_slice_for_thd(cp_partition_mode="contiguous")` and verl's THD preprocessing split a
  packed micro-batch, so an interval may end inside one sequence and hold the head of the next.

For a unit of one sequence both layouts agree with the classic per-sequence reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from batch_planner.padding import padded_length
from batch_planner.request import CpLayout


@dataclass(frozen=True)
class ShardRange:
    """Rows `[start, stop)` of the unit's `index`-th padded sequence that one rank holds."""

    index: int  # position of the sequence in the unit
    start: int
    stop: int


def unit_shard(
    lengths: Sequence[int], cp_size: int, cp_rank: int, tensor_parallel_size: int, layout: CpLayout
) -> list[ShardRange]:
    """The ranges rank `cp_rank` holds of a unit of sequences with real `lengths`, in the order
    they sit in that rank's shard. Adjacent ranges of one sequence are merged."""
    padded = [padded_length(n, cp_size, tensor_parallel_size, layout) for n in lengths]
    return padded_unit_shard(padded, cp_size, cp_rank, layout)


def padded_unit_shard(padded: Sequence[int], cp_size: int, cp_rank: int, layout: CpLayout) -> list[ShardRange]:
    """`unit_shard` of sequences already padded to `padded` rows. Zigzag cuts each sequence into 2c
    chunks, so each must be a multiple of 2c; contiguous cuts the buffer into c intervals, so their
    sum must be a multiple of c. Anything else raises ValueError: rows that no rank would hold."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside a CP group of size {cp_size}")
    if cp_size == 1:
        return [ShardRange(i, 0, p) for i, p in enumerate(padded)]
    if layout is CpLayout.ZIGZAG:
        uneven = [(i, p) for i, p in enumerate(padded) if p % (2 * cp_size)]
        if uneven:
            raise ValueError(
                f"padded lengths: sequence {uneven[0][0]} is padded to {uneven[0][1]} rows, not a multiple of "
                f"2 x CP = {2 * cp_size}; the zigzag layout cuts every sequence into 2 x CP chunks"
            )
        return [r for i, p in enumerate(padded) for r in _zigzag(i, p, cp_size, cp_rank)]
    if sum(padded) % cp_size:
        raise ValueError(f"padded lengths: the buffer holds {sum(padded)} rows, not a multiple of CP = {cp_size}; "
                         "the contiguous layout cuts it into CP equal intervals")
    return _contiguous(padded, cp_size, cp_rank)


def _zigzag(index: int, padded: int, cp_size: int, cp_rank: int) -> list[ShardRange]:
    chunk = padded // (2 * cp_size)
    second = 2 * cp_size - 1 - cp_rank
    if second == cp_rank + 1:  # the middle rank's two chunks touch
        return [ShardRange(index, cp_rank * chunk, (second + 1) * chunk)]
    return [ShardRange(index, cp_rank * chunk, (cp_rank + 1) * chunk), ShardRange(index, second * chunk, (second + 1) * chunk)]


def _contiguous(padded: Sequence[int], cp_size: int, cp_rank: int) -> list[ShardRange]:
    per_rank = sum(padded) // cp_size
    begin, end = cp_rank * per_rank, (cp_rank + 1) * per_rank
    ranges: list[ShardRange] = []
    offset = 0
    for index, length in enumerate(padded):
        start, stop = max(begin, offset), min(end, offset + length)
        if start < stop:
            ranges.append(ShardRange(index, start - offset, stop - offset))
        offset += length
        if offset >= end:
            break
    return ranges
