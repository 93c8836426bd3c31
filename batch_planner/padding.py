"""THD/CP padding arithmetic (Megatron's packed layout), shared by planner statistics and trainer."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from batch_planner.columns import lengths_column, round_up, segment_sums
from batch_planner.request import CpLayout, PlanRequest


def padding_multiple(cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    """A sequence on `cp_size` ranks is padded to a multiple of this (docs/design.md, Padding, layouts and statistics)."""
    zigzag_factor = 2 if cp_layout is CpLayout.ZIGZAG and cp_size > 1 else 1
    return tensor_parallel_size * cp_size * zigzag_factor


def padded_length(length: int, cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout) -> int:
    return _round_up(length, padding_multiple(cp_size, tensor_parallel_size, cp_layout))


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def padded_sum(lengths: Iterable[int], multiple: int) -> int:
    """Sum of `lengths`, each rounded up to `multiple`: _round_up inlined, since a call per sample
    costs more than the arithmetic (plans price thousands of samples)."""
    if multiple == 1:
        return sum(lengths)
    return sum([-(-length // multiple) * multiple for length in lengths])


class PlanPadding:
    """The padding arithmetic of one plan's request: each CP size's padding multiple computed once.

    Building the CP groups needs their padded tokens (`group_tokens`, every group at once); the
    statistics then read each group's padded_tokens instead of padding its samples again.
    """

    def __init__(self, sequence_lengths: Sequence[int], tensor_parallel_size: int, cp_layout: CpLayout):
        self.sequence_lengths = sequence_lengths
        self._tensor_parallel_size = tensor_parallel_size
        self._cp_layout = cp_layout
        self._multiples: dict[int, int] = {}

    @classmethod
    def for_request(cls, request: PlanRequest) -> PlanPadding:
        return cls(request.sequence_lengths, request.tensor_parallel_size, request.cp_layout)

    def multiple(self, cp_size: int) -> int:
        found = self._multiples.get(cp_size)
        if found is None:
            found = self._multiples[cp_size] = padding_multiple(cp_size, self._tensor_parallel_size, self._cp_layout)
        return found

    def padded_tokens(self, sample_ids: Sequence[int], cp_size: int) -> int:
        """Sum of the padded lengths of `sample_ids` (all within the request) on `cp_size` ranks."""
        return padded_sum(map(self.sequence_lengths.__getitem__, sample_ids), self.multiple(cp_size))

    def group_tokens(self, sample_ids: np.ndarray, offsets: np.ndarray, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Real and padded tokens of groups given by their sizes and all their sample ids one after
        another (every id within the request), group i's at offsets[i]..offsets[i + 1]
        (columns.run_offsets): what `padded_tokens` and summing the lengths give, for all groups
        in one pass over the samples."""
        column = lengths_column(self.sequence_lengths, max(sizes, default=1), self._tensor_parallel_size)
        tokens = column[sample_ids]
        multiple_of = {size: self.multiple(size) for size in set(sizes)}
        multiples = np.repeat(np.asarray(list(map(multiple_of.__getitem__, sizes)), dtype=column.dtype), np.diff(offsets))
        real = segment_sums(tokens, offsets).tolist()
        return real, segment_sums(round_up(tokens, multiples), offsets).tolist()
