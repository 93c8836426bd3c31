"""CP process groups for the plan's group sizes: Megatron-Core's hybrid groups where possible."""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger(__name__)


def build_cp_groups(world_size: int, sizes: set[int], prefer_megatron: bool = True) -> tuple[dict[tuple[int, int], dist.ProcessGroup], str]:
    """(first_rank, size) -> group for every aligned rank range of each size > 1, and the source.

    Megatron-Core 0.19.2 builds the hybrid-CP groups in `initialize_model_parallel(...,
    hybrid_context_parallel=True)`; it has no group of size 1 (a CP1 micro-batch uses none). When
    Megatron-Core is not importable (the GPU machine lacks it unless carried), the same rank ranges
    become plain torch.distributed groups. Every rank must call this with the same arguments.
    """
    sizes = {s for s in sizes if s > 1}
    if prefer_megatron:
        try:
            return _megatron_groups(world_size, sizes), "megatron-core hybrid CP groups"
        except Exception as exc:  # noqa: BLE001 - not installed or not initialisable here: say so, fall back
            log.warning("Megatron-Core hybrid CP groups unavailable (%s: %s); using torch.distributed groups",
                        type(exc).__name__, exc)
    groups = {}
    for size in sorted(sizes):
        for first in range(0, world_size, size):
            group = dist.new_group(list(range(first, first + size)))
            groups[(first, size)] = group
    return groups, "torch.distributed groups"


def _megatron_groups(world_size: int, sizes: set[int]) -> dict[tuple[int, int], dist.ProcessGroup]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            context_parallel_size=world_size, hybrid_context_parallel=True
        )
    rank = dist.get_rank()
    groups = {}
    for size in sorted(sizes):
        group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)
        # Megatron returns this rank's group of that size; the plan only asks a rank for its own.
        groups[(rank - rank % size, size)] = group
    return groups
