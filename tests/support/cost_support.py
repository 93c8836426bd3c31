"""The cost of one CP group from its samples' lengths, as the tests price groups by hand."""

from __future__ import annotations

from typing import Sequence

from batch_planner.cost import group_work_seconds
from batch_planner.cost_spec import CostModel
from batch_planner.padding import padded_length
from batch_planner.request import CpLayout


def group_seconds(model: CostModel, lengths: Sequence[int], cp_size: int, tp: int, layout: CpLayout, packed: bool) -> float:
    """One rank's time for a CP group running `lengths`."""
    padded = sum(padded_length(length, cp_size, tp, layout) for length in lengths)
    return group_work_seconds(model, padded, sum(length * length for length in lengths), cp_size, len(lengths), packed)
