"""Initialises Megatron-Core's parallel_state with per-size DPxCP groups, whichever release is
installed: 0.19 names them hybrid context parallel, the dev branch dynamic context parallel."""

from __future__ import annotations

import inspect

import torch


def _flag() -> str:
    from megatron.core import parallel_state

    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    return "dynamic_context_parallel" if "dynamic_context_parallel" in params else "hybrid_context_parallel"


def cpu_init_unsupported_reason() -> str | None:
    """Why the DPxCP groups cannot be initialised here, or None.

    The dev branch's dynamic-CP initialisation barriers with device_ids=[torch.cuda.current_device()]
    (megatron/core/parallel_state.py), so it needs CUDA; 0.19's hybrid CP initialises on gloo."""
    if _flag() == "dynamic_context_parallel" and not torch.cuda.is_available():
        return (
            "this Megatron-Core's initialize_model_parallel(dynamic_context_parallel=True) needs CUDA "
            "(it barriers with device_ids=[torch.cuda.current_device()]); no GPU here"
        )
    return None


def initialize_dpxcp_groups(context_parallel_size: int) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=context_parallel_size, **{_flag(): True})
