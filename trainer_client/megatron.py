"""The trainer client's touches of Megatron-Core: its DPxCP process groups and `PackedSeqParams`.

Two builds are in use (docs/design.md, "What each Megatron-Core build offers"):
- the Megatron-LM dev branch: `initialize_model_parallel(dynamic_context_parallel=True)` builds
  the groups `get_dynamic_data_context_parallel_groups(group_size=k)` returns, a group of size 1
  included (its attention asserts that `cp_group` is set whenever `local_cp_size` is), and
  `PackedSeqParams` takes `cp_partition_mode`;
- the 0.19 releases: `hybrid_context_parallel=True` builds
  `get_hybrid_data_context_parallel_groups(group_size=k)` for k > 1; CP1 runs without a group.

A plan from either scheduler runs on whichever groups the trainer's build initialised: a packed
dynamic-CP plan runs on 0.19's hybrid groups (power-of-two DPxCP), a plan for 24 ranks needs the
dev build's groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.distributed as dist

from batch_planner.plan import Plan
from batch_planner.request import CpLayout

# size -> this rank's process group for that CP size (None: the build runs that size without one)
CpGroupResolver = Callable[[int], "dist.ProcessGroup | None"]


def packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen: int, local_cp_size: int, cp_group, layout: CpLayout):
    """Megatron-Core's own type, so the engine takes it as is (THD: whole-sequence cu_seqlens; the
    attention kernel knows this rank holds its CP shard of each)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    extra = {"cp_partition_mode": layout.value} if _has_field(PackedSeqParams, "cp_partition_mode") else {}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        local_cp_size=local_cp_size,
        cp_group=cp_group,
        **extra,
    )


def _has_field(cls, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls))


def parallel_state_initialized() -> bool:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return False
    return parallel_state.model_parallel_is_initialized()


def dp_cp_group() -> Any:
    """Megatron-Core's DPxCP group (data parallel with context parallel)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _group_lookup() -> tuple[Callable[[int], Any], bool]:
    """(size -> group, whether size 1 has a group) for the groups this process initialised."""
    from megatron.core import parallel_state

    dynamic = getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
    if dynamic is not None:
        try:
            dynamic(group_size=1)
            return (lambda size: dynamic(group_size=size)), True
        except (KeyError, AssertionError):
            pass  # this build has dynamic CP, but parallel_state was initialised without it
    hybrid = getattr(parallel_state, "get_hybrid_data_context_parallel_groups", None)
    if hybrid is not None:
        return (lambda size: hybrid(group_size=size)), False
    raise RuntimeError(
        "Megatron-Core's parallel_state has no per-size DPxCP groups: initialise it with "
        "initialize_model_parallel(dynamic_context_parallel=True) (Megatron-LM dev) or "
        "hybrid_context_parallel=True (0.19 releases)"
    )


def megatron_cp_group_resolver(plan: Plan, group: Any = None) -> CpGroupResolver:
    """CP groups from Megatron-Core's own parallel_state, checked against the plan's ranks.

    `group`: the DPxCP group the plan covers (default: parallel_state's). Called for every CP size
    of the plan, 1 included.
    """
    lookup, has_cp1_group = _group_lookup()
    dp_cp_ranks = dist.get_process_group_ranks(group if group is not None else dp_cp_group())
    my_position = dp_cp_ranks.index(dist.get_rank())

    def resolve(size: int):
        if size == 1 and not has_cp1_group:
            return None
        try:
            found = lookup(size)
        except KeyError:
            raise RuntimeError(
                f"this Megatron-Core's parallel_state has no DPxCP group of size {size} (a plan for "
                f"{plan.dp_cp_size} ranks; 0.19's hybrid groups need a power-of-two DPxCP, the dev "
                "build's dynamic groups an even one)"
            ) from None
        first = my_position - my_position % size
        expected = dp_cp_ranks[first : first + size]
        actual = dist.get_process_group_ranks(found)
        if list(actual) != list(expected):
            raise RuntimeError(
                f"Megatron-Core's CP group of size {size} for this rank has ranks {actual}; the plan needs "
                f"{expected}: the DPxCP group's rank order differs from parallel_state's"
            )
        return found

    return resolve
