"""Causal attention for one sequence on a CP group: zigzag sharding, ring attention, references.

A sequence on a CP group of size c is cut into 2c chunks; rank r keeps chunks r and 2c-1-r
(Megatron's zigzag THD layout, the same as PyTorch's head-tail load balancer), so every rank
gets the same share of the causal triangle.

Engines, chosen by `make_attention`:
- `LocalAttention`: c == 1, plain SDPA on the rank.
- `RingAttention`: c > 1 on CUDA, PyTorch's own ring attention
  (`torch.distributed.tensor.experimental.context_parallel`) on a DeviceMesh of the CP group.
- `AllGatherAttention`: c > 1 on CPU. PyTorch's ring attention dispatches only the CUDA SDPA
  kernels (flash, efficient, cuDNN); on CPU its DTensor dispatcher raises NotImplementedError for
  `_scaled_dot_product_flash_attention_for_cpu`. So CPU tests run the same sharding and plan
  execution with K/V all-gathered over the group (gloo) and an explicit causal mask.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from batch_planner.request import CpLayout
from batch_planner.shards import unit_shard


def zigzag_positions(length: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token positions held by `cp_rank` (length must be a multiple of 2 * cp_size): the
    planner's own shard geometry (batch_planner/shards.py), as the trainer client applies it."""
    if cp_size > 1 and length % (2 * cp_size):
        raise ValueError(f"length {length} is not a multiple of 2 * cp_size = {2 * cp_size}")
    ranges = unit_shard([length], cp_size, cp_rank, 1, CpLayout.ZIGZAG)
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in ranges])


def zigzag_shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This rank's zigzag shard of `x` along `dim`."""
    if cp_size == 1:
        return x
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp_size, cp_rank, x.device))


class SequenceAttention(Protocol):
    """Causal attention of one sequence: q, k, v are [1, heads, local_len, head_dim]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def pass_context(self) -> contextlib.AbstractContextManager: ...


class LocalAttention:
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def pass_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class RingAttention:
    """PyTorch's ring attention over `mesh`; inputs are zigzag shards of one sequence each.

    `context_parallel` shards all its buffers with one layout taken from the first buffer, which
    would let samples of a pack attend across their boundaries. So each sequence is sharded here
    (zigzag_shard, per sequence) and the context gets only a placeholder buffer of length 2c: it
    still switches on the head-tail load-balanced ring for every SDPA call inside the pass.
    Forward and backward must both run inside `pass_context()`.
    """

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    @contextlib.contextmanager
    def pass_context(self) -> Iterator[None]:
        from torch.distributed.tensor.experimental import context_parallel

        placeholder = torch.zeros(2 * self.mesh.size(), device=self.mesh.device_type)
        with context_parallel(
            self.mesh, buffers=[placeholder], buffer_seq_dims=[0], no_restore_buffers={placeholder}
        ):
            yield

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Looked up at call time: context_parallel patches torch.nn.functional's attribute.
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class AllGatherAttention:
    """CPU stand-in for ring attention (see module doc): gathers K/V, masks by global position."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp_size = dist.get_world_size(group)
        self.cp_rank = dist.get_rank(group)

    def pass_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        local = q.shape[2]
        length = local * self.cp_size
        keys = all_gather_with_grad(k, self.group, dim=2)
        values = all_gather_with_grad(v, self.group, dim=2)
        q_pos = zigzag_positions(length, self.cp_size, self.cp_rank, q.device)
        k_pos = torch.cat([zigzag_positions(length, self.cp_size, r, q.device) for r in range(self.cp_size)])
        mask = q_pos[:, None] >= k_pos[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The group's `x` concatenated along `dim` in group-rank order, differentiably: the backward
    sums every member's gradient of this rank's slice and hands it back to this rank (the
    tests' CPU attention stand-in, tests/support/cp_attention_standin.py, gathers K and V with it too)."""
    return _GatherAlongDim.apply(x, group, dim)


class _GatherAlongDim(torch.autograd.Function):
    """All-gather along `dim`; backward sums the full gradient and keeps this rank's slice
    (all_reduce: gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        mine = grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine, None, None


def make_attention(cp_size: int, group: dist.ProcessGroup | None, device: torch.device) -> SequenceAttention:
    if cp_size == 1:
        return LocalAttention()
    if group is None:
        raise ValueError(f"a CP group of size {cp_size} needs a process group")
    if device.type == "cuda":
        from torch.distributed.device_mesh import DeviceMesh

        return RingAttention(DeviceMesh.from_group(group, "cuda"))
    return AllGatherAttention(group)
