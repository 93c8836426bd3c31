"""The process groups of a loop without Megatron-Core's parallel_state, as Megatron-Core orders and
cuts them: a drop-in for Megatron-LM or Bridge reads its groups from parallel_state instead."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from batch_planner.cp_groups import megatron_cp_group_sizes
from trainer_client.errors import InvalidArgumentError, ProcessGroupError
from trainer_client.megatron import CpGroupResolver, DataGroups


def dpxcp_groups(cp_size: int) -> tuple[DataGroups, CpGroupResolver]:
    """The groups of a world that is all DPxCP (no TP, no pipeline) in Megatron's rank order, DP rank d
    holding ranks d * cp .. d * cp + cp - 1 (CP siblings, which load the same samples); and this rank's
    CP group of every size a plan may use: an aligned block of ranks, as Megatron-Core's dynamic groups
    are, size 1 included (the dynamic-CP attention and RoPE ask for a group there too). Collective:
    every rank creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
        raise InvalidArgumentError(f"cp_size: {cp_size!r} is not allowed; allowed: a divisor of the world size {world} (DP = world / CP)")
    dp_groups = [dist.new_group(list(range(cp_rank, world, cp_size))) for cp_rank in range(cp_size)]
    mine: dict[int, Any] = {}
    for size in sorted(megatron_cp_group_sizes(world)):
        for first in range(0, world - size + 1, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine[size] = group

    def cp_group_for(size: int) -> Any:
        try:
            return mine[size]
        except (KeyError, TypeError):
            raise ProcessGroupError(
                f"no CP group of size {size!r} in a DPxCP world of {world} ranks; its sizes: {sorted(mine)}"
            ) from None

    # tp: read only where every TP rank reads a step (StepPlanner.start's every_tp_rank_reads).
    return DataGroups(dp_cp=dist.group.WORLD, dp=dp_groups[rank % cp_size], tp=None, pp=None), cp_group_for
