"""Initialises Megatron-Core's parallel_state with per-size DPxCP groups, whichever build is
installed: 0.19 names them hybrid context parallel, the Megatron-LM dev branch dynamic context
parallel; and looks up the group parallel_state built for a CP size."""

from __future__ import annotations

import inspect

import torch


def _flag() -> str:
    from megatron.core import parallel_state

    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    return "dynamic_context_parallel" if "dynamic_context_parallel" in params else "hybrid_context_parallel"


def is_dynamic_build() -> bool:
    return _flag() == "dynamic_context_parallel"


def _stand_in_for_cuda_calls_on_cpu() -> None:
    """CPU stand-in (named as such): the dev build's group creation calls
    torch.cuda.current_device() (for a barrier's device_ids, which gloo ignores) and
    torch.cuda.synchronize() even on gloo. Without a GPU those two calls raise; nothing else
    of CUDA is used. On a GPU machine the real calls run."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None


def initialize_dpxcp_groups(context_parallel_size: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    from megatron.core import parallel_state

    if is_dynamic_build():
        _stand_in_for_cuda_calls_on_cpu()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **{_flag(): True},
    )


def parallel_state_cp_group(size: int):
    """The process group parallel_state built for CP size `size` on this rank; None for CP1 on
    0.19 (it builds none), the dev build's own size-1 group there."""
    from megatron.core import parallel_state

    if is_dynamic_build():
        return parallel_state.get_dynamic_data_context_parallel_groups(group_size=size)
    return None if size == 1 else parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)
