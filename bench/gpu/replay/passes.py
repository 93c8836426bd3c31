"""A plan as the passes its ranks run: `plan_passes`.

Each micro-batch's CP groups, each as the forward+backward passes it runs: one pass over all its
samples when the plan packs (dynamic CP, static packing: capacity bound per rank's sum), one pass per
sample when it does not (hybrid CP: each sample of a group is its own pass, batch_planner/cost.py).
Each pass carries its sequences' real and padded lengths (the plan's own padding rule,
batch_planner/padding.py); every rank of the group holds padded / CP size of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from batch_planner.padding import group_padded_lengths, row_multiple_of
from batch_planner.plan import Plan
from batch_planner.request import CapacityBound


@dataclass(frozen=True)
class GroupPass:
    first_rank: int
    cp_size: int
    real: tuple[int, ...]
    padded: tuple[int, ...]

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp_size)

    @property
    def local_tokens(self) -> int:
        """Rows each rank of the group holds."""
        return sum(self.padded) // self.cp_size


@dataclass(frozen=True)
class GroupWork:
    """One CP group of one micro-batch: its ranks and the passes it runs one after another."""

    first_rank: int
    cp_size: int
    passes: tuple[GroupPass, ...]

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp_size)


def plan_passes(plan: Plan, lengths: Sequence[int]) -> list[list[GroupWork]]:
    """Every micro-batch's CP groups with their passes (module docstring)."""
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    t = plan.tensor_parallel_size
    out = []
    for micro_batch in plan.micro_batches:
        groups = []
        for group in micro_batch.cp_groups:
            real = [lengths[i] for i in group.sample_ids]
            if not real:
                continue
            rule = (group.size, t, plan.cp_layout, plan.padding, plan.min_local_rows, row_multiple_of(plan))
            # one pass's buffer: the group's samples packed, or each sample alone
            padded = group_padded_lengths(real, *rule) if packed else [group_padded_lengths([n], *rule)[0] for n in real]
            if sum(padded) != group.padded_tokens:
                raise ValueError(f"group at rank {group.first_rank}: padded {sum(padded)} tokens, the plan says {group.padded_tokens}")
            if packed:
                passes = (GroupPass(group.first_rank, group.size, tuple(real), tuple(padded)),)
            else:
                passes = tuple(GroupPass(group.first_rank, group.size, (n,), (p,)) for n, p in zip(real, padded))
            groups.append(GroupWork(group.first_rank, group.size, passes))
        out.append(groups)
    return out
