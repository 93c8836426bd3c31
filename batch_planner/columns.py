"""A request's numbers as numpy columns whose arithmetic gives Python's results, bit for bit.

Padding, the plan invariants and the statistics sum and price thousands of samples and groups;
numpy does that without a Python loop per sample, but only while its fixed-width arithmetic agrees
with Python's ints and floats. int64 sums and products are exact below 2**63; an int64 -> float64
conversion rounds as Python's `float(int)` does; an int64 / int64 division rounds as Python's
int / int does while both operands are below 2**53. `column_dtype` is int64 when every padded
token sum of the request, times any CP size, stays below 2**53 and every sum of squared lengths
below 2**63; else it is object, and numpy applies Python's own operators element by element: the
same results, slower. Sums of floats are never left to numpy's reductions (pairwise, not Python's
left to right); they are built with `np.add.accumulate` or in Python.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import numpy as np

FLOAT_EXACT = 2**53  # integers below this convert to float64 exactly
INT64_EXACT = 2**63


class _Lengths:
    """A request's lengths with their extremes and, when they are ints that fit, their int64 column."""

    def __init__(self, lengths: Sequence[int]):
        self.lengths = lengths
        self.int64: np.ndarray | None = None
        self.shortest, self.longest = 0, 0
        # numpy finds the dtype: int64 for ints (numpy's too) that fit, another for floats, strings
        # or ints past int64, which only Python's ints hold.
        column = np.array(lengths) if len(lengths) else np.zeros(0, dtype=np.int64)
        if column.dtype == np.int64 and column.ndim == 1:
            self.int64 = column
            column.flags.writeable = False
            if len(column):
                self.shortest, self.longest = int(column.min()), int(column.max())
        elif lengths:
            self.shortest, self.longest = min(lengths), max(lengths)


# The last request's lengths of each thread: a plan's stages ask for their column several times.
# Kept for tuples only (immutable, so the same object always has the same lengths), by identity, and
# per thread, so that threads planning side by side (a trainer's plan-ahead threads, the server's
# gRPC threads) neither share nor replace each other's.
_last = threading.local()


def _lengths(lengths: Sequence[int]) -> _Lengths:
    last: _Lengths | None = getattr(_last, "lengths", None)
    if last is not None and last.lengths is lengths:
        return last
    found = _Lengths(lengths)
    if type(lengths) is tuple:
        _last.lengths = found
    return found


def column_dtype(lengths: Sequence[int], largest_cp_size: int, tensor_parallel_size: int) -> type:
    """int64 where the request's token sums stay exact as int64 and as float64 (module doc), on CP
    groups of at most `largest_cp_size` ranks; else object."""
    known = _lengths(lengths)
    count, longest = len(lengths), known.longest
    largest_multiple = 2 * tensor_parallel_size * largest_cp_size  # zigzag over the largest group
    padded_tokens = count * (longest + largest_multiple)
    exact = padded_tokens * largest_cp_size < FLOAT_EXACT and count * longest * longest < INT64_EXACT
    return np.int64 if exact and known.shortest >= 0 and known.int64 is not None else object


def lengths_column(lengths: Sequence[int], largest_cp_size: int, tensor_parallel_size: int) -> np.ndarray:
    """`lengths` as a read-only numpy column of their `column_dtype`."""
    known = _lengths(lengths)
    if known.int64 is not None and column_dtype(lengths, largest_cp_size, tensor_parallel_size) is np.int64:
        return known.int64
    column = np.array(lengths, dtype=object)
    column.flags.writeable = False
    return column


def run_offsets(counts: Iterable[int], runs: int) -> np.ndarray:
    """Where each of `runs` runs of consecutive values starts, run i of `counts[i]` values, then the
    total number of values: (runs + 1,) int64."""
    offsets = np.zeros(runs + 1, dtype=np.int64)
    np.cumsum(np.fromiter(counts, dtype=np.int64, count=runs), out=offsets[1:])
    return offsets


def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sums of the runs of `values` (integers) that `offsets` (`run_offsets`) delimits; 0 for an empty run."""
    totals = np.zeros(len(values) + 1, dtype=values.dtype)
    np.cumsum(values, out=totals[1:])
    return totals[offsets[1:]] - totals[offsets[:-1]]


def round_up(values: np.ndarray, multiples: np.ndarray | int) -> np.ndarray:
    """Each value rounded up to its multiple: padding.padded_length's arithmetic on columns."""
    return -(-values // multiples) * multiples
