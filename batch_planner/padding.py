"""THD/CP padding arithmetic (Megatron's packed layout), shared by planner statistics and trainer."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from batch_planner.columns import lengths_column, round_up, segment_sums
from batch_planner.precision import rank_row_multiple
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
    rule: PaddingRule = PaddingRule.MEGATRON_CORE, min_local_rows: int | None = None, row_multiple: int = 1,
) -> list[int]:
    """Each sequence's padded length in one pass's packed THD buffer on a CP group: `padded_length`,
    then the last sequence padded further, with `min_local_rows` (verl's: a kernel's minimum window
    per rank) until the buffer holds at least `cp_size * min_local_rows` rows, with `row_multiple`
    (`rank_row_multiple`: what the precision needs) until each rank's rows are a multiple of it."""
    padded = [padded_length(n, cp_size, tensor_parallel_size, cp_layout, rule) for n in lengths]
    if min_local_rows is not None and padded and sum(padded) < cp_size * min_local_rows:
        padded[-1] += cp_size * min_local_rows - sum(padded)
    if row_multiple > 1 and padded:
        padded[-1] += alignment_tokens(sum(padded), cp_size, padding_multiple(cp_size, tensor_parallel_size, cp_layout, rule), row_multiple)
    return padded


def alignment_tokens(buffer_tokens: int, cp_size: int, multiple: int, row_multiple: int) -> int:
    """The padding one pass's buffer of `buffer_tokens` (each sequence padded to `multiple`) needs
    so that each of its `cp_size` ranks holds a multiple of `row_multiple` rows: the fewest tokens
    that keep every sequence a multiple of `multiple` (its layout's rule) and make the buffer a
    multiple of cp_size x row_multiple. Topping up one sequence by them spends no more than any
    other way of padding (a padding-only segment would have to be a multiple of `multiple` too)."""
    return _round_up(buffer_tokens, pass_multiple(multiple, cp_size, row_multiple)) - buffer_tokens


def pass_multiple(multiple: int, cp_size: int, row_multiple: int) -> int:
    """What one pass's buffer on `cp_size` ranks is padded to a multiple of: its sequences'
    `multiple` (the layout's) and `cp_size` x `row_multiple` rows (the precision's): the one home of
    the rule that `alignment_tokens`, `PlanPadding` and the static-CP estimate apply."""
    return math.lcm(multiple, cp_size * row_multiple)


def row_multiple_of(options) -> int:
    """What each rank's rows in a pass must be a multiple of, for a request's or a plan's precision,
    tensor parallel size and sequence parallelism."""
    return rank_row_multiple(options.precision, options.tensor_parallel_size, options.sequence_parallel)


# What decides how a request's or a plan's passes are padded (`padding_key`).
PADDING_KEY_FIELDS = ("cp_layout", "tensor_parallel_size", "padding", "min_local_rows", "precision", "rows per rank a multiple of")


def padding_key(options) -> tuple:
    """What decides how a request's or a plan's passes are padded (PADDING_KEY_FIELDS): equal keys
    pad alike. A plan whose key is not its request's was padded for something else (a server that
    ignores a field). Sequence parallelism counts only through the row multiple it makes."""
    return (options.cp_layout, options.tensor_parallel_size, options.padding, options.min_local_rows,
            options.precision, row_multiple_of(options))


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
    padded tokens are `group_padded_lengths`' sum over the group's passes: its samples packed into
    one buffer, as the packing schedulers run them (`packed`), or each sample its own pass, as
    hybrid CP runs them. verl's `min_local_rows` top-up is per buffer (validation allows it with the
    packing schedulers only); the precision's (`row_multiple`) is per pass: a group's buffer when
    packed, each sample's padded length when not.
    """

    def __init__(self, sequence_lengths: Sequence[int], tensor_parallel_size: int, cp_layout: CpLayout,
                 rule: PaddingRule = PaddingRule.MEGATRON_CORE, min_local_rows: int | None = None,
                 row_multiple: int = 1, packed: bool = True):
        self.sequence_lengths = sequence_lengths
        self._tensor_parallel_size = tensor_parallel_size
        self._cp_layout = cp_layout
        self._rule = rule
        self._min_local_rows = min_local_rows
        self._row_multiple = row_multiple
        self._packed = packed
        self._multiples: dict[int, int] = {}

    @classmethod
    def for_request(cls, request: PlanRequest, packed: bool = True) -> PlanPadding:
        return cls(request.sequence_lengths, request.tensor_parallel_size, request.cp_layout, request.padding, request.min_local_rows,
                   row_multiple_of(request), packed)

    def multiple(self, cp_size: int) -> int:
        """Each sequence's padding multiple on `cp_size` ranks (with the precision's, when each
        sample is its own pass)."""
        found = self._multiples.get(cp_size)
        if found is None:
            found = padding_multiple(cp_size, self._tensor_parallel_size, self._cp_layout, self._rule)
            if not self._packed and self._row_multiple > 1:
                found = pass_multiple(found, cp_size, self._row_multiple)
            self._multiples[cp_size] = found
        return found

    def group_tokens(self, sample_ids: np.ndarray, offsets: np.ndarray, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Real and padded tokens of groups given by their sizes and all their sample ids one after
        another (every id within the request), group i's at offsets[i]..offsets[i + 1]
        (columns.run_offsets): what `group_padded_lengths` gives each pass, summed per group, for
        all groups in one pass over the samples."""
        largest = max(sizes, default=1)
        column = lengths_column(self.sequence_lengths, largest, self._tensor_parallel_size)
        tokens = column[sample_ids]
        multiple_of = {size: self.multiple(size) for size in set(sizes)}
        multiples = np.repeat(np.asarray(list(map(multiple_of.__getitem__, sizes)), dtype=column.dtype), np.diff(offsets))
        real = segment_sums(tokens, offsets).tolist()
        padded = segment_sums(round_up(tokens, multiples), offsets)
        if self._min_local_rows is not None:  # verl's top-up of each non-empty group's buffer
            floor = np.asarray(sizes, dtype=padded.dtype) * self._min_local_rows
            padded = np.where(np.diff(offsets) > 0, np.maximum(padded, floor), padded)
        if self._packed and self._row_multiple > 1:  # the precision's top-up of each group's buffer
            unit = {size: pass_multiple(multiple_of[size], size, self._row_multiple) for size in multiple_of}
            units = np.asarray(list(map(unit.__getitem__, sizes)), dtype=padded.dtype)
            padded = round_up(padded, units)
        return real, padded.tolist()

    def padded_tokens(self, sample_ids: Sequence[int], cp_size: int) -> int:
        """The padded tokens of one group of `sample_ids` (all within the request) on `cp_size`
        ranks, pass by pass through `group_padded_lengths`, the trainer's own rule: what
        `group_tokens` gives that group."""
        lengths = [self.sequence_lengths[i] for i in sample_ids]
        args = (cp_size, self._tensor_parallel_size, self._cp_layout, self._rule)
        if self._packed:
            return sum(group_padded_lengths(lengths, *args, self._min_local_rows, self._row_multiple))
        padded = sum(sum(group_padded_lengths([n], *args, None, self._row_multiple)) for n in lengths)
        return max(padded, cp_size * self._min_local_rows) if self._min_local_rows is not None and lengths else padded

    def without_alignment(self) -> PlanPadding:
        """The same padding without the precision's: what the layout alone needs."""
        return PlanPadding(self.sequence_lengths, self._tensor_parallel_size, self._cp_layout, self._rule, self._min_local_rows, 1, self._packed)
