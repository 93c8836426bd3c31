"""Which rows of a dynamic-CP rank's THD shard are padding: the `_dcp_padding_mask` of verl's
micro-batches (True = padding), from the shard geometry of batch_planner/shards.py.

A micro-batch's samples are padded to the layout's multiple (batch_planner/padding.py); with
`min_local_rows` the last one is padded further until the group's buffer holds at least
`cp_size * min_local_rows` rows (a kernel's minimum window). Zigzag: each sequence's
`padded // cp_size` local rows, in sequence order; contiguous: one interval of the whole buffer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from batch_planner.padding import padded_length
from batch_planner.request import CpLayout
from batch_planner.shards import padded_unit_shard


def padded_lengths(
    lengths: Sequence[int], cp_size: int, tensor_parallel_size: int, layout: CpLayout, min_local_rows: int | None
) -> list[int]:
    """Each sample's padded length in the group's THD buffer."""
    padded = [padded_length(n, cp_size, tensor_parallel_size, layout) for n in lengths]
    if min_local_rows is not None and sum(padded) < cp_size * min_local_rows:
        padded[-1] += cp_size * min_local_rows - sum(padded)
    return padded


def local_padding_mask(
    lengths: Sequence[int],
    cp_size: int,
    cp_rank: int,
    tensor_parallel_size: int,
    layout: CpLayout,
    min_local_rows: int | None = None,
) -> torch.Tensor:
    """Bool mask over rank `cp_rank`'s local rows of the group's buffer: True where a row is padding."""
    padded = padded_lengths(lengths, cp_size, tensor_parallel_size, layout, min_local_rows)
    per_sequence = layout is CpLayout.ZIGZAG or cp_size == 1
    region_start = [0]
    for p in padded[:-1]:
        region_start.append(region_start[-1] + p // cp_size)
    mask = torch.ones(sum(padded) // cp_size, dtype=torch.bool)
    cursor, current = 0, -1
    for piece in padded_unit_shard(padded, cp_size, cp_rank, layout):
        if per_sequence and piece.index != current:
            cursor, current = region_start[piece.index], piece.index
        real = max(0, min(lengths[piece.index], piece.stop) - piece.start)
        mask[cursor : cursor + real] = False
        cursor += piece.stop - piece.start
    return mask
