"""THD/CP padding arithmetic (Megatron's packed layout), shared by planner statistics and trainer."""

from __future__ import annotations

from typing import Sequence

from batch_planner.request import CpLayout, PlanRequest


def padding_multiple(cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    """A sequence on `cp_size` ranks is padded to a multiple of this (docs/design.md, Padding, layouts and statistics)."""
    zigzag_factor = 2 if cp_layout is CpLayout.ZIGZAG and cp_size > 1 else 1
    return tensor_parallel_size * cp_size * zigzag_factor


def padded_length(length: int, cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    return _round_up(length, padding_multiple(cp_size, tensor_parallel_size, cp_layout))


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


class PlanPadding:
    """The padded lengths of each CP group's samples, computed once per plan.

    Building the CP groups (padded_tokens), checking the capacity invariant and pricing the plan
    all need each sample's padded length at its group's CP size; they share this table instead
    of computing it three times.
    """

    def __init__(self, sequence_lengths: Sequence[int], tensor_parallel_size: int, cp_layout: CpLayout):
        self.sequence_lengths = sequence_lengths
        self._tensor_parallel_size = tensor_parallel_size
        self._cp_layout = cp_layout
        self._by_group: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    @classmethod
    def for_request(cls, request: PlanRequest) -> PlanPadding:
        return cls(request.sequence_lengths, request.tensor_parallel_size, request.cp_layout)

    def of_group(self, sample_ids: tuple[int, ...], cp_size: int) -> tuple[int, ...]:
        """Padded lengths of `sample_ids` on `cp_size` ranks; ids outside the request are skipped
        (the invariant check reports them)."""
        key = (sample_ids, cp_size)
        padded = self._by_group.get(key)
        if padded is None:
            multiple = padding_multiple(cp_size, self._tensor_parallel_size, self._cp_layout)
            lengths = self.sequence_lengths
            padded = tuple(_round_up(lengths[i], multiple) for i in sample_ids if 0 <= i < len(lengths))
            self._by_group[key] = padded
        return padded
