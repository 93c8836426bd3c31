"""CPU stand-ins, named as such, for where Megatron-Core asks for CUDA on a machine that has none:
`CudaDeviceRequestsOnCpu`, a `TorchFunctionMode` that keeps tensors asked for on a CUDA device on
the CPU (Bridge's batch helpers, DDP's grad buffer, the optimizer; RoPE's `get_emb` moves
`inv_freq` to `torch.cuda.current_device()`), and `CpuStandInStream`, the one stream of a CPU
(DDP's grad sync waits on the current stream; MoE's token dispatcher copies to the host on a side
stream, tests/support/moe_on_cpu.py)."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device is a CUDA ordinal


# A mode is not active inside the function it handles, so backward (Megatron-Core's autograd
# functions: the all-to-all of the CP layout conversion asks for a tensor on
# `torch.cuda.current_device()`) runs with `torch.cuda.current_device()` answering the CPU instead.
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward)


class CudaDeviceRequestsOnCpu(TorchFunctionMode):
    """A tensor asked for on a CUDA device is made, or kept, on the CPU. Only the device of such
    requests changes; every function runs as called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD:
            with _current_device_on_cpu():
                return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)) and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _current_device_on_cpu():
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


class _CompleteEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class CpuStandInStream:
    """CPU stand-in for a CUDA stream: nothing to wait for, every event it records already complete."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _CompleteEvent:
        return _CompleteEvent()

    def synchronize(self) -> None:
        pass
