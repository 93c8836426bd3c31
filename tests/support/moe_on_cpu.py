"""CPU stand-ins, each named as such, for what Megatron-Core's MoE alltoall token dispatcher asks
of CUDA (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher):

- `torch.cuda.Stream()` / `current_stream()` / `stream(...)`: the dispatcher copies its split
  sizes to the host on a side stream and waits for it with an event. On a CPU there is one stream:
  one `CpuStandInStream` (tests/support/cuda_requests_on_cpu.py) answers both.
- `maybe_move_tensor_to_cpu(tensor, as_numpy=True)`: upstream converts only CUDA tensors to numpy;
  on a CPU the split sizes stay tensors, and gloo's `all_to_all_single` refuses tensors as split
  sizes (TypeError: incompatible function arguments). The stand-in converts CPU tensors too.
"""

from __future__ import annotations

import contextlib

import torch

from tests.support.cuda_requests_on_cpu import CpuStandInStream

_THE_STREAM = CpuStandInStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def stand_in_for_moe_calls_on_cpu() -> None:
    """Installs the stand-ins of the module docstring (nothing where CUDA is available)."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = lambda *args, **kwargs: _THE_STREAM
    torch.cuda.current_stream = lambda *args, **kwargs: _THE_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    moe_utils.maybe_move_tensor_to_cpu = _host_copy
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
