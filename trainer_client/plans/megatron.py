"""The one place the trainer client touches `megatron.core`, imported lazily (the planner-only parts
of the client work without it): `PackedSeqParams`, the process groups and per-size DPxCP groups, the
data-iterator helpers the drop-ins call, the rerun state, and what the installed build can do.
The two builds: docs/design.md ("Megatron-Core builds: what each offers").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from batch_planner.plan import Plan
from batch_planner.request import CpLayout
from trainer_client.errors import InvalidArgumentError, ProcessGroupError

# size -> this rank's process group for that CP size (None: the build runs that size without one)
CpGroupResolver = Callable[[int], "dist.ProcessGroup | None"]


def packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen: int, local_cp_size: int, cp_group, layout: CpLayout):
    """Megatron-Core's own type, so the engine takes it as is (THD: whole-sequence cu_seqlens; the
    attention kernel knows this rank holds its CP shard of each)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    extra = {"cp_partition_mode": layout.value} if _takes_partition_mode() else {}
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


@functools.cache
def _takes_partition_mode() -> bool:
    """Whether the installed PackedSeqParams has `cp_partition_mode` (the dev build), asked once, not per unit."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return any(f.name == "cp_partition_mode" for f in dataclasses.fields(PackedSeqParams))


def parallel_state_initialized() -> bool:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return False
    return parallel_state.model_parallel_is_initialized()


def dp_cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _group_lookup() -> tuple[Callable[[int], Any], bool]:
    """(size -> group, whether size 1 has a group) for the groups this process initialised: the dev
    build's dynamic groups include size 1 (its attention asserts that `cp_group` is set whenever
    `local_cp_size` is); 0.19's hybrid groups start at 2 and CP1 runs without a group."""
    from megatron.core import parallel_state

    dynamic = getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
    if dynamic is not None:
        try:
            dynamic(group_size=1)
            return (lambda size: dynamic(group_size=size)), True
        except KeyError:  # initialised with min_dynamic_context_parallel_size >= 2: no size-1 group
            return (lambda size: dynamic(group_size=size)), False
        except AssertionError:
            pass  # this build has dynamic CP, but parallel_state was initialised without it
    hybrid = getattr(parallel_state, "get_hybrid_data_context_parallel_groups", None)
    if hybrid is not None:
        return (lambda size: hybrid(group_size=size)), False
    raise ProcessGroupError(
        "Megatron-Core's parallel_state has no per-size DPxCP groups: initialise it with "
        "initialize_model_parallel(dynamic_context_parallel=True) (Megatron-LM dev) or "
        "hybrid_context_parallel=True (0.19 releases)"
    )


def static_cp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def in_rerun() -> bool:
    """Whether Megatron-Core's rerun state machine is re-running the current step's forward-backward."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    return get_rerun_state_machine().state not in (RerunState.NOT_RUNNING_YET, RerunState.INITIAL_RUN)


def model_config_of(model: Any) -> Any:
    """The TransformerConfig of a (possibly wrapped) model chunk."""
    from megatron.core.utils import get_model_config

    return get_model_config(model)


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
            raise ProcessGroupError(
                f"this Megatron-Core's parallel_state has no DPxCP group of size {size} (a plan for "
                f"{plan.dp_cp_size} ranks; 0.19's hybrid groups need a power-of-two DPxCP, the dev "
                "build's dynamic groups an even one)"
            ) from None
        first = my_position - my_position % size
        expected = dp_cp_ranks[first : first + size]
        actual = dist.get_process_group_ranks(found)
        if list(actual) != list(expected):
            raise ProcessGroupError(
                f"Megatron-Core's CP group of size {size} for this rank has ranks {actual}; the plan needs "
                f"{expected}: the DPxCP group's rank order differs from parallel_state's"
            )
        return found

    return resolve


@dataclass(frozen=True)
class DataGroups:
    """The process groups Megatron-Core's data-iterator wrappers read, from `parallel_state` or a
    `ProcessGroupCollection` (`pg_collection.dp_cp`, `.dp`, `.tp`, `.pp`), as they read them."""

    dp_cp: Any
    dp: Any
    tp: Any
    pp: Any

    @classmethod
    def of(cls, pg_collection: Any = None) -> DataGroups:
        if pg_collection is not None:
            groups = cls(pg_collection.dp_cp, pg_collection.dp, pg_collection.tp, getattr(pg_collection, "pp", None))
        else:
            from megatron.core import parallel_state

            groups = cls(
                parallel_state.get_data_parallel_group(with_context_parallel=True),
                parallel_state.get_data_parallel_group(),
                parallel_state.get_tensor_model_parallel_group(),
                parallel_state.get_pipeline_model_parallel_group(),
            )
        missing = [name for name in ("dp_cp", "dp", "tp") if getattr(groups, name) is None]
        if missing:
            raise InvalidArgumentError(f"process group(s) {missing} are None: initialise Megatron-Core's parallel_state first")
        return groups


def unpack_hybrid_cp_batch(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The sub-samples of a list of packed samples, cut exactly as Megatron-Core's
    `HybridCPDataLoaderWrapper.unpack_batch` cuts them (its own method; it reads nothing of self)."""
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper

    return HybridCPDataLoaderWrapper.unpack_batch(None, batch)


def unpack_packing_batch(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The sub-samples of the packing schedulers' input, with `original_seq_len` and
    `padded_seq_len`, from the dev branch's own `data_schedule_utils._unpack_batch` (a private name:
    the Megatron-LM drop-in's version gate looks it up)."""
    from megatron.core.datasets.data_schedule_utils import _unpack_batch

    return _unpack_batch(batch)


def build_packed_microbatches(samples_with_id, sample_id_groups, dcp_rank, device, is_dynamic_cp):
    """Megatron-Core's (dev) packing of this rank's samples into one THD micro-batch per group."""
    from megatron.core.datasets.data_schedule_utils import build_packed_microbatches as build

    return build(samples_with_id, sample_id_groups, dcp_rank, device, is_dynamic_cp)


def create_packed_data_iterator(new_samples, tp_group, config, is_dynamic_cp, vpp_needs_data=None):
    """Megatron-Core's (dev) iterator over the packed micro-batches (None on TP ranks > 0); with
    virtual stages, one per virtual stage (`vpp_needs_data`: which get the data, not only metadata)."""
    from megatron.core.datasets.data_schedule_utils import create_data_iterator

    return create_data_iterator(new_samples, tp_group, config, vpp_needs_data, is_dynamic_cp)


def mtp_stages(config: Any, vpp_size: int) -> tuple[bool, tuple[bool, ...]]:
    """Whether this pipeline stage holds MTP layers, and which of its `vpp_size` virtual stages do:
    Megatron-Core's own `mtp_on_this_rank` (parallel_state's pipeline rank, the config's layout)."""
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    layout, layers = getattr(config, "pipeline_model_parallel_layout", None), getattr(config, "mtp_num_layers", None)
    if layout is None and layers is None:
        return False, (False,) * vpp_size  # upstream's answer, without asking parallel_state
    stage = bool(mtp_on_this_rank(layout, layers, ignore_virtual=True))
    if vpp_size == 1:
        return stage, (stage,)
    return stage, tuple(bool(mtp_on_this_rank(layout, layers, ignore_virtual=False, vp_stage=v)) for v in range(vpp_size))


def broadcast_scalars(values: list, tp_group, device) -> list:
    """Megatron-Core's (dev) broadcast of the step's scalars from TP rank 0 to the TP group."""
    from megatron.core.datasets.data_schedule_utils import broadcast_scalars as broadcast

    return broadcast(values, tp_group, device)


def max_real_seqs_per_micro_batch(config: Any) -> int | None:
    """The real-sequence cap Megatron-Core's wrap_data_iterator gives the static packing scheduler
    (a private name: the Megatron-LM drop-in's version gate looks it up; Bridge's does not yet)."""
    from megatron.core.datasets.data_schedule import _get_scheduler_max_real_num_seqs

    return _get_scheduler_max_real_num_seqs(config)
