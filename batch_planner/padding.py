"""THD/CP padding arithmetic (Megatron's packed layout), shared by planner statistics and trainer."""

from __future__ import annotations

from batch_planner.request import CpLayout


def padding_multiple(cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    """A sequence on `cp_size` ranks is padded to a multiple of this (design: padding)."""
    zigzag_factor = 2 if cp_layout is CpLayout.ZIGZAG and cp_size > 1 else 1
    return tensor_parallel_size * cp_size * zigzag_factor


def padded_length(length: int, cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    multiple = padding_multiple(cp_size, tensor_parallel_size, cp_layout)
    return -(-length // multiple) * multiple
