"""Stand-in for NCCL's point-to-point between ranks that share one GPU (named as such):
`CpuStagedPointToPointStandIn`, for the GPU tests' ranks, which run on one GPU over gloo.

Why a stand-in: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and gloo's collectives
take CUDA tensors but its send and receive do not (`writev ... Bad address`). Megatron-Core's
pipeline schedules and Transformer Engine's ring attention (`cp_comm_type="p2p"`, the one THD path
with a CP group) both move CUDA tensors with `torch.distributed.isend` / `irecv` /
`batch_isend_irecv` / `P2POp`. Inside the stand-in those calls copy a CUDA tensor to the CPU, send
or receive it with gloo, and copy a received one back (docs/gpu-benchmark.md, "What is real, what is
stood in"). Everything that runs on the GPU, Transformer Engine's kernels and ring schedule
included, is real; what is stood in is the transport between the ranks.

Ordering, so that no exchange waits on another that cannot start:
- a lone `isend` / `irecv` completes before it returns, in the order the ranks call them. Both
  callers order lone exchanges by rank parity (even ranks send first, odd ranks receive first:
  Transformer Engine's `flash_attn_p2p_communicate`, Megatron-Core's `_p2p_ops`), so each blocking
  send meets a receive;
- `batch_isend_irecv` posts every operation of the batch before it waits for any (gloo's CPU sends
  and receives are asynchronous), then completes them all before it returns, as NCCL's group calls
  complete together. A batch may list its sends first on both peers (Megatron-Core's
  `_batched_p2p_ops`, the shape exchange of `variable_seq_lengths`).
Completing each call before it returns also keeps at most one message in flight between two ranks,
so two messages of different sizes can never be matched to each other's receive. The price is
overlap: nothing here is a timing.

Before a CUDA tensor is read for sending, and after a received one is written, the whole device is
synchronised: Transformer Engine computes on its own CP stream.

One collective is stood in too: gloo has no coalesced all-reduce of CUDA tensors
(`allreduce_coalesced: unsupported device type cuda`), which Megatron-Core's DDP runs over each
bucket group (`_coalescing_manager` in `param_and_grad_buffer`). Inside the stand-in that manager
lets each all-reduce run on its own as it is called (gloo all-reduces CUDA tensors), so the grad sync
gives the same sums.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

_NAMES = ("isend", "irecv", "batch_isend_irecv", "P2POp")


@dataclass
class StagedP2POp:
    """What `torch.distributed.P2POp` holds, without its check that `op` is torch's own isend or
    irecv (the stand-in's are not)."""

    op: Callable
    tensor: torch.Tensor
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


class _Done:
    """A completed exchange's work object."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _Staged:
    """One exchange: its gloo work on a CPU tensor, and what completes it (the copy back of a receive)."""

    def __init__(self, work, finish: Callable[[], None] | None):
        self.work = work
        self.finish = finish

    def complete(self) -> None:
        self.work.wait()
        if self.finish is not None:
            self.finish()


class CpuStagedPointToPointStandIn:
    """Context manager: `torch.distributed`'s point-to-point calls staged through CPU tensors over
    gloo while it is active (module docstring); CPU tensors go through gloo as they are."""

    def __init__(self, stage_cpu_tensors: bool = False) -> None:
        # stage_cpu_tensors: CPU tensors take the staging path too (copied out and back), so that the
        # stand-in's own test exercises it on a machine without a GPU.
        self._stage = (lambda t: True) if stage_cpu_tensors else (lambda t: t.is_cuda)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CpuStagedPointToPointStandIn:
        self._saved = {name: getattr(dist, name) for name in _NAMES}
        dist.isend, dist.irecv = self.isend, self.irecv
        dist.batch_isend_irecv, dist.P2POp = self.batch_isend_irecv, StagedP2POp
        from megatron.core.distributed import param_and_grad_buffer

        self._saved_coalescing = param_and_grad_buffer._coalescing_manager
        param_and_grad_buffer._coalescing_manager = _one_by_one
        return self

    def __exit__(self, *exc) -> None:
        for name, value in self._saved.items():
            setattr(dist, name, value)
        from megatron.core.distributed import param_and_grad_buffer

        param_and_grad_buffer._coalescing_manager = self._saved_coalescing

    def isend(self, tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> _Done:
        self._post_send(tensor, dst, group, tag, group_dst).complete()
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> _Done:
        self._post_recv(tensor, src, group, tag, group_src).complete()
        return _Done()

    def batch_isend_irecv(self, ops: list) -> list[_Done]:
        posted = [
            self._post_send(op.tensor, op.peer, op.group, op.tag, op.group_peer) if _is_send(op.op)
            else self._post_recv(op.tensor, op.peer, op.group, op.tag, op.group_peer)
            for op in ops
        ]
        for staged in posted:
            staged.complete()
        return [_Done() for _ in ops]

    def _post_send(self, tensor, peer, group, tag, group_peer) -> _Staged:
        staged = tensor
        if self._stage(tensor):
            _synchronize(tensor)
            staged = tensor.detach().to("cpu", copy=True)
        return _Staged(self._saved["isend"](staged, peer, group=group, tag=tag, group_dst=group_peer), None)

    def _post_recv(self, tensor, peer, group, tag, group_peer) -> _Staged:
        if not self._stage(tensor):
            return _Staged(self._saved["irecv"](tensor, peer, group=group, tag=tag, group_src=group_peer), None)
        staged = torch.empty(tensor.shape, dtype=tensor.dtype)

        def copy_back() -> None:
            with torch.no_grad():  # a pipeline's receive buffer is a leaf that requires grad
                tensor.copy_(staged)
            _synchronize(tensor)

        return _Staged(self._saved["irecv"](staged, peer, group=group, tag=tag, group_src=group_peer), copy_back)


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops: bool = False) -> Iterator[_Done]:
    """`torch.distributed._coalescing_manager` without coalescing: the collectives inside run one by
    one as they are called, and its handle's `wait()` has nothing left to wait for."""
    yield _Done()


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize()


def _is_send(op: Callable) -> bool:
    name = getattr(op, "__name__", "")
    return name in ("isend", "send")
