"""The process groups of a loop without Megatron-Core's parallel_state, as Megatron-Core orders and
cuts them: a drop-in for Megatron-LM or Bridge reads its groups from parallel_state instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from batch_planner.cp_groups import megatron_cp_group_sizes
from trainer_client.errors import InvalidArgumentError, ProcessGroupError
from trainer_client.plans.megatron import CpGroupResolver, DataGroups


@dataclass(frozen=True)
class RankLayout:
    """A world of TP x CP x DP x PP ranks in Megatron-Core's default order ("tp-cp-ep-dp-pp"): TP
    varies fastest, then CP, then DP, then the pipeline stage. Each group lists its ranks in that
    order, so a DPxCP group's position j is CP rank j % cp of DP rank j // cp."""

    world: int  # the number of ranks
    tp: int  # tensor-parallel size
    cp: int  # context-parallel size (the static CP: DP ranks of CP siblings load the same samples)
    pp: int  # pipeline stages

    @classmethod
    def of(cls, world: int, cp_size: int, tp_size: int = 1, pp_size: int = 1) -> RankLayout:
        """The layout, each size checked in turn (TP, PP, CP): an InvalidArgumentError names the
        setting, its value and what is allowed."""
        _check("tp_size", tp_size, world, f"the world size {world}")
        _check("pp_size", pp_size, world // tp_size, f"world / TP = {world // tp_size}" if tp_size > 1 else f"the world size {world}")
        rest = world // (tp_size * pp_size)
        _check("cp_size", cp_size, rest, f"the world size {world} (DP = world / CP)" if rest == world
               else f"world / (TP x PP) = {rest} (DP = world / (TP x CP x PP))")
        return cls(world, tp_size, cp_size, pp_size)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    def rank(self, tp: int, cp: int, dp: int, pp: int) -> int:
        """The global rank of these coordinates."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def dp_cp_groups(self) -> list[list[int]]:
        """Every DPxCP group (the ranks of one TP rank and stage): the ranks a plan spans."""
        return [[self.rank(t, j % self.cp, j // self.cp, p) for j in range(self.dp * self.cp)]
                for p in range(self.pp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Every DP group (one TP rank, CP rank and stage): the ranks that load different samples."""
        return [[self.rank(t, c, d, p) for d in range(self.dp)] for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(t, c, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(t, c, d, p) for p in range(self.pp)] for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]


def dpxcp_groups(cp_size: int, *, tp_size: int = 1, pp_size: int = 1) -> tuple[DataGroups, CpGroupResolver]:
    """The groups of a world of TP x CP x DP x PP ranks in Megatron-Core's order (`RankLayout`), DP
    rank d of a DPxCP group holding its positions d * cp .. d * cp + cp - 1 (CP siblings, which load
    the same samples); and this rank's CP group of every size a plan may use: an aligned block of its
    DPxCP group, as Megatron-Core's dynamic groups are, size 1 included (the dynamic-CP attention and
    RoPE ask for a group there too). `tp` and `pp` are None at size 1; with TP > 1 every TP rank
    reads the same samples (StepPlanner.start's every_tp_rank_reads), and with PP > 1 every stage
    reads and plans the step (the stages agree on its plan). Collective: every rank creates every
    group, in the same order; a size that does not fit the world is refused on every rank first."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = RankLayout.of(world, cp_size, tp_size, pp_size)
    dp_cp_size = layout.dp * cp_size
    dp_cp = _new_groups(layout.dp_cp_groups(), rank) if dp_cp_size < world else dist.group.WORLD
    dp = _new_groups(layout.dp_groups(), rank)
    tp = _new_groups(layout.tp_groups(), rank) if tp_size > 1 else None
    pp = _new_groups(layout.pp_groups(), rank) if pp_size > 1 else None
    mine: dict[int, Any] = {}
    for ranks in layout.dp_cp_groups():
        for size in sorted(megatron_cp_group_sizes(len(ranks))):
            for first in range(0, len(ranks) - size + 1, size):
                group = dist.new_group(ranks[first:first + size])
                if rank in ranks[first:first + size]:
                    mine[size] = group

    def cp_group_for(size: int) -> Any:
        try:
            return mine[size]
        except (KeyError, TypeError):
            raise ProcessGroupError(
                f"no CP group of size {size!r} in a DPxCP group of {dp_cp_size} ranks; its sizes: {sorted(mine)}"
            ) from None

    return DataGroups(dp_cp=dp_cp, dp=dp, tp=tp, pp=pp), cp_group_for


def _check(name: str, value: Any, among: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or among % value:
        raise InvalidArgumentError(f"{name}: {value!r} is not allowed; allowed: a divisor of {what}")


def _new_groups(groups: list[list[int]], rank: int) -> Any:
    """Creates every group of `groups` (collective: every rank, in the same order); returns the one holding `rank`."""
    made = [dist.new_group(ranks) for ranks in groups]
    return next(group for group, ranks in zip(made, groups) if rank in ranks)
