"""THD/CP padding arithmetic (Megatron's packed layout), shared by planner statistics and trainer."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from batch_planner.columns import lengths_column, round_up, segment_sums
from batch_planner.request import CpLayout, PaddingRule, PlanRequest


def padding_multiple(cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout, rule: PaddingRule = PaddingRule.MEGATRON_CORE) -> int:
    """A sequence on `cp_size` ranks is padded to a multiple of this (docs/design.md, "Padding,
    layouts and statistics"): TP alone at CP1; on a CP group, 2 x CP x TP in either layout, by
    Megatron-Core's rule, and CP x TP for the contiguous layout by verl's.

    2 x CP: Transformer Engine's THD attention cuts every sequence of a CP shard into 2 x CP chunks
    (zigzag), and Megatron-Core converts contiguous input to zigzag before it
    (`context_parallel_layout/routes.py` refuses a sequence that is not a multiple of 2 x CP).
    x TP: sequence parallelism splits each rank's rows over the TP ranks. Megatron-LM's own dataset
    pads the same way. verl pads its contiguous layout to CP x TP only (`preprocess_thd_engine`): its
    engine picks that layout for attention that reads contiguous shards itself (DeepSeek-V4's)."""
    if cp_size == 1:
        return tensor_parallel_size
    if rule is PaddingRule.VERL and cp_layout is CpLayout.CONTIGUOUS:
        return tensor_parallel_size * cp_size
    return 2 * tensor_parallel_size * cp_size


def padded_length(length: int, cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout, rule: PaddingRule = PaddingRule.MEGATRON_CORE) -> int:
    return _round_up(length, padding_multiple(cp_size, tensor_parallel_size, cp_layout, rule))


def group_padded_lengths(
    lengths: Sequence[int], cp_size: int, tensor_parallel_size: int, cp_layout: CpLayout,
    rule: PaddingRule = PaddingRule.MEGATRON_CORE, min_local_rows: int | None = None,
) -> list[int]:
    """Each sequence's padded length in one CP group's packed THD buffer: `padded_length`, then,
    with `min_local_rows` (verl's: a kernel's minimum window per rank), the last sequence padded
    further until the buffer holds at least `cp_size * min_local_rows` rows."""
    padded = [padded_length(n, cp_size, tensor_parallel_size, cp_layout, rule) for n in lengths]
    if min_local_rows is not None and padded and sum(padded) < cp_size * min_local_rows:
        padded[-1] += cp_size * min_local_rows - sum(padded)
    return padded


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
    statistics then read each group's padded_tokens instead of padding its samples again. A group's
    padded tokens are `group_padded_lengths`' sum: its samples packed into one buffer, as the
    packing schedulers run them (verl's `min_local_rows` top-up is per buffer; validation allows it
    with the packing schedulers only).
    """

    def __init__(self, sequence_lengths: Sequence[int], tensor_parallel_size: int, cp_layout: CpLayout,
                 rule: PaddingRule = PaddingRule.MEGATRON_CORE, min_local_rows: int | None = None):
        self.sequence_lengths = sequence_lengths
        self._tensor_parallel_size = tensor_parallel_size
        self._cp_layout = cp_layout
        self._rule = rule
        self._min_local_rows = min_local_rows
        self._multiples: dict[int, int] = {}

    @classmethod
    def for_request(cls, request: PlanRequest) -> PlanPadding:
        return cls(request.sequence_lengths, request.tensor_parallel_size, request.cp_layout, request.padding, request.min_local_rows)

    def multiple(self, cp_size: int) -> int:
        found = self._multiples.get(cp_size)
        if found is None:
            found = self._multiples[cp_size] = padding_multiple(cp_size, self._tensor_parallel_size, self._cp_layout, self._rule)
        return found

    def padded_tokens(self, sample_ids: Sequence[int], cp_size: int) -> int:
        """The padded tokens of one group of `sample_ids` (all within the request) on `cp_size` ranks."""
        padded = padded_sum(map(self.sequence_lengths.__getitem__, sample_ids), self.multiple(cp_size))
        if self._min_local_rows is not None and sample_ids:
            return max(padded, cp_size * self._min_local_rows)
        return padded

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
        padded = segment_sums(round_up(tokens, multiples), offsets)
        if self._min_local_rows is not None:  # verl's top-up of each non-empty group's buffer
            floor = np.asarray(sizes, dtype=padded.dtype) * self._min_local_rows
            padded = np.where(np.diff(offsets) > 0, np.maximum(padded, floor), padded)
        return real, padded.tolist()
