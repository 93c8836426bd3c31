"""CP attention against a single-device reference: forward output and input gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.gpu.cp_attention import make_attention, zigzag_shard


@dataclass(frozen=True)
class AttentionCheck:
    cp_size: int
    length: int
    dtype: str
    output_rel_error: float
    grad_q_rel_error: float
    grad_kv_rel_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        worst = max(self.output_rel_error, self.grad_q_rel_error, self.grad_kv_rel_error)
        return worst == worst and worst <= self.tolerance  # NaN never passes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_cp_attention(
    group: dist.ProcessGroup, length: int, heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, seed: int, tolerance: float,
) -> AttentionCheck:
    """Every rank draws the same q, k, v; the CP result on this rank's shard must match the rows
    (and gradient rows) of the full single-device attention that belong to the shard."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (
        torch.randn(1, heads, length, head_dim, generator=generator, device=device, dtype=dtype)
        for _ in range(3)
    )
    grad_out = torch.randn(1, heads, length, head_dim, generator=generator, device=device, dtype=dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=True)
    reference.backward(grad_out)

    local = [zigzag_shard(t, cp_size, cp_rank, dim=2).detach().clone().requires_grad_() for t in (q, k, v)]
    attention = make_attention(cp_size, group, device)
    with attention.pass_context():
        out = attention(*local)
        out.backward(zigzag_shard(grad_out, cp_size, cp_rank, dim=2))
    shard = lambda t: zigzag_shard(t, cp_size, cp_rank, dim=2)  # noqa: E731
    grad_kv = torch.cat([local[1].grad, local[2].grad])
    return AttentionCheck(
        cp_size, length, str(dtype).removeprefix("torch."),
        _rel(out.detach(), shard(reference.detach())),
        _rel(local[0].grad, shard(full[0].grad)),
        _rel(grad_kv, torch.cat([shard(full[1].grad), shard(full[2].grad)])),
        tolerance,
    )
