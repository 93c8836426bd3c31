"""The one place the trainer client touches `megatron.core`.

Everything the client needs from the installed Megatron-Core comes through here: `PackedSeqParams`,
the process groups of `parallel_state` (or a `ProcessGroupCollection`), the per-size DPxCP groups
(hybrid on 0.19.x, dynamic on the dev branch), the data-iterator helpers the drop-in
(`trainer_client.megatron_lm`) calls instead of re-writing them, and what the installed build and
its Transformer Engine can do. Megatron-Core is imported lazily: the planner-only parts of the
client work without it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from batch_planner.plan import Plan
from batch_planner.request import SchedulerKind

CpGroupResolver = Callable[[int], "dist.ProcessGroup | None"]

# Transformer Engine's attention takes a CP group for THD input (cp_comm_type, set_context_parallel_group
# with per-call groups) from this version on; Megatron-Core's TEDotProductAttention checks the same.
MIN_TE_VERSION_FOR_THD_CP = (1, 10)


def packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, local_cp_size, cp_group):
    """Megatron-Core's own PackedSeqParams, so the engine takes it as is (THD: whole-sequence
    cu_seqlens; the attention kernel knows this rank holds its CP shard of each)."""
    from megatron.core.packed_seq_params import PackedSeqParams

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
    )


def megatron_cp_group_resolver(plan: Plan, dp_cp_group: Any = None) -> CpGroupResolver:
    """CP groups from Megatron-Core's own parallel_state, checked against the plan's ranks.

    Dynamic-CP plans use `get_dynamic_data_context_parallel_groups` where the build has it (dev
    branch); otherwise the hybrid DPxCP groups of the 0.19 release. CP1 has no group (None), as in
    Megatron-Core itself.
    """
    from megatron.core import parallel_state

    dynamic = getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
    hybrid = getattr(parallel_state, "get_hybrid_data_context_parallel_groups", None)
    lookup = dynamic if (plan.scheduler is SchedulerKind.DYNAMIC_CP and dynamic) else (hybrid or dynamic)
    if lookup is None:
        raise RuntimeError("this Megatron-Core has neither hybrid nor dynamic DPxCP groups (needs >= 0.15)")
    if dp_cp_group is None:
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_cp_ranks = dist.get_process_group_ranks(dp_cp_group)
    my_position = dp_cp_ranks.index(dist.get_rank())

    def resolve(size: int):
        if size == 1:
            return None
        group = lookup(group_size=size)
        first = my_position - my_position % size
        expected = dp_cp_ranks[first : first + size]
        actual = dist.get_process_group_ranks(group)
        if list(actual) != list(expected):
            raise RuntimeError(
                f"Megatron-Core's CP group of size {size} for this rank has ranks {actual}; the plan needs "
                f"{expected}: the DPxCP group's rank order differs from parallel_state's"
            )
        return group

    return resolve


def parallel_state_initialized() -> bool:
    """Whether Megatron-Core is installed and `initialize_model_parallel` has run."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return False
    return parallel_state.model_parallel_is_initialized()


def dp_cp_group() -> Any:
    """Megatron-Core's DPxCP process group (data parallel with context parallel)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


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
            raise ValueError(f"process group(s) {missing} are None: initialise Megatron-Core's parallel_state first")
        return groups

    @property
    def is_first_tp_rank(self) -> bool:
        return self.tp.rank() == 0


def rerun_data_iterator(items: list[Any]) -> Any:
    """Megatron-Core's RerunDataIterator over `items` (what its schedules expect to be handed)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator(iter(items))


def unpack_hybrid_cp_batch(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The sub-samples of a list of packed samples, cut exactly as Megatron-Core's
    `HybridCPDataLoaderWrapper.unpack_batch` cuts them (its own method; it reads nothing of self)."""
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper

    return HybridCPDataLoaderWrapper.unpack_batch(None, batch)


def unpack_packing_batch(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The sub-samples of the packing schedulers' input, with `original_seq_len` and
    `padded_seq_len`, from the dev branch's own `data_schedule_utils._unpack_batch`."""
    from megatron.core.datasets.data_schedule_utils import _unpack_batch

    return _unpack_batch(batch)


def build_packed_microbatches(samples_with_id, sample_id_groups, dcp_rank, device, is_dynamic_cp):
    """Megatron-Core's (dev) packing of this rank's samples into one THD micro-batch per group."""
    from megatron.core.datasets.data_schedule_utils import build_packed_microbatches as build

    return build(samples_with_id, sample_id_groups, dcp_rank, device, is_dynamic_cp)


def create_packed_data_iterator(new_samples, tp_group, config, is_dynamic_cp):
    """Megatron-Core's (dev) iterator over the packed micro-batches (None on TP ranks > 0)."""
    from megatron.core.datasets.data_schedule_utils import create_data_iterator

    return create_data_iterator(new_samples, tp_group, config, None, is_dynamic_cp)


def broadcast_scalars(values: list, tp_group, device) -> list:
    """Megatron-Core's (dev) broadcast of the step's scalars from TP rank 0 to the TP group."""
    from megatron.core.datasets.data_schedule_utils import broadcast_scalars as broadcast

    return broadcast(values, tp_group, device)


def max_real_seqs_per_micro_batch(config: Any) -> int | None:
    """The real-sequence cap Megatron-Core's wrap_data_iterator gives the static packing scheduler."""
    from megatron.core.datasets.data_schedule import _get_scheduler_max_real_num_seqs

    return _get_scheduler_max_real_num_seqs(config)


def transformer_engine_version() -> tuple[int, ...] | None:
    """The installed Transformer Engine's (major, minor), or None when it is not installed."""
    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return None


@dataclass(frozen=True)
class MegatronBuild:
    """What the installed Megatron-Core build offers the drop-in."""

    version: str
    hybrid_cp_wrapper: bool  # datasets.data_schedule.HybridCPDataLoaderWrapper (0.19.x and dev)
    packing_wrapper: bool  # datasets.data_schedule.wrap_data_iterator (dev branch)
    dynamic_cp_groups: bool  # initialize_model_parallel(dynamic_context_parallel=True) (dev branch)

    @classmethod
    def detect(cls) -> MegatronBuild:
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.datasets import data_schedule

        init = inspect.signature(parallel_state.initialize_model_parallel).parameters
        return cls(
            version=getattr(megatron.core, "__version__", "unknown"),
            hybrid_cp_wrapper=hasattr(data_schedule, "HybridCPDataLoaderWrapper"),
            packing_wrapper=hasattr(data_schedule, "wrap_data_iterator"),
            dynamic_cp_groups="dynamic_context_parallel" in init,
        )
