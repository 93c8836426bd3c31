"""CPU stand-in for Transformer Engine's THD attention with a CP group: what Megatron-Core's
`TEDotProductAttention` runs on GPUs, for tests on a machine without CUDA or Transformer Engine.

It replaces only `self_attention.submodules.core_attention` of Megatron-Core's local GPT layer
spec (`layer_spec_with_standin`); `SelfAttention`'s linear layers and its RoPE code stay
Megatron-Core's own. It follows Transformer Engine's documented THD/CP contract (the
`DotProductAttention.forward` docstring's cu_seqlens note and `attn_forward_func_with_cp`'s
DualChunkSwap description), not this project's sharding code:

- `cu_seqlens_q` / `cu_seqlens_kv` count the real tokens of the *whole* sequences;
  `cu_seqlens_q_padded` / `cu_seqlens_kv_padded` their padded extents (equal to the unpadded ones
  when there is no padding). Padding tokens, at the end of each padded sequence, take no part in
  the attention: no query attends to them, and their own output is zero.
- With a CP group of size c, every padded sequence length is a multiple of 2c; the sequence is cut
  into 2c chunks and the rank of group rank r holds chunks r and 2c-1-r, in that order, of every
  sequence, sequences in `cu_seqlens_*_padded` order: sequence i starts at local row
  `cu_seqlens_q_padded[i] / c`.
- The CP group: with `packed_seq_params.local_cp_size` set (dynamic CP), `local_cp_size == 1` runs
  without a group and any other size runs on `packed_seq_params.cp_group`, as
  `TEDotProductAttention.forward` switches Transformer Engine's group per call; without it, the
  static group of the layer's `pg_collection.cp`.
- Transformer Engine takes no partition mode: every THD shard is read as DualChunkSwap (zigzag).
  Megatron-Core's `Attention.forward` (dev build) converts input of the contiguous layout
  (`config.cp_partition_mode="contiguous"`) to zigzag before RoPE and core attention, and marks
  `packed_seq_params.cp_partition_mode="zigzag"` when it does. The stand-in therefore refuses a
  contiguous shard at core attention with CP > 1 instead of reading it as zigzag, as Transformer
  Engine would, silently.

How: K and V are all-gathered over the CP group differentiably on gloo (the backward sums every
member's gradient of a rank's rows and hands it back to that rank), each sequence's 2c chunks are put
back in order, and each query attends causally to the real tokens of its own sequence up to its
position (scaled dot-product attention with an explicit mask). What it does not show: Transformer
Engine's kernels, their numerics and their ring/all-to-all communication (GPU-only).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.gpu.cp_attention import all_gather_with_grad


@dataclasses.dataclass(frozen=True)
class ThdGeometry:
    """Where each local row of a THD shard sits: its sequence and its position there, as Transformer
    Engine's DualChunkSwap lays a CP shard out (module docstring). Rows past the last padded
    sequence, and padding rows, have `real` False."""

    sequence: torch.Tensor  # [rows] long: index of the row's sequence (-1: past the last one)
    position: torch.Tensor  # [rows] long: position in the padded sequence
    real: torch.Tensor  # [rows] bool: a real token (position < the sequence's real length)

    def to(self, device) -> ThdGeometry:
        return ThdGeometry(self.sequence.to(device), self.position.to(device), self.real.to(device))


def thd_geometry(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, rows: int) -> ThdGeometry:
    """The geometry of `rows` local rows of group rank `cp_rank` (module docstring)."""
    real_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    bounds = cu_seqlens_padded.tolist()
    sequence = torch.full((rows,), -1, dtype=torch.long)
    position = torch.zeros(rows, dtype=torch.long)
    real = torch.zeros(rows, dtype=torch.bool)
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        padded = stop - start
        if padded % (2 * cp_size if cp_size > 1 else 1):
            raise ValueError(
                f"cu_seqlens_q_padded: sequence {index} is padded to {padded} tokens, not a multiple of "
                f"2 x CP size = {2 * cp_size} (Transformer Engine's THD attention with CP needs that)"
            )
        if real_lengths[index] > padded:
            raise ValueError(f"cu_seqlens_q: sequence {index} has {real_lengths[index]} tokens, more than its padded {padded}")
        local_start = start // cp_size
        if local_start + padded // cp_size > rows:
            raise ValueError(
                f"the THD shard has {rows} rows; cu_seqlens_q_padded needs {bounds[-1] // cp_size} on each of {cp_size} CP ranks"
            )
        positions = _chunk_positions(padded, cp_size, cp_rank)
        sequence[local_start:local_start + positions.numel()] = index
        position[local_start:local_start + positions.numel()] = positions
        real[local_start:local_start + positions.numel()] = positions < real_lengths[index]
    return ThdGeometry(sequence, position, real)


def _chunk_positions(padded: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions, in a sequence padded to `padded`, of the rows group rank `cp_rank` holds:
    chunks r and 2c-1-r of 2c."""
    if cp_size == 1:
        return torch.arange(padded)
    chunk = padded // (2 * cp_size)
    second = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)])


class TeThdCpAttentionStandIn(torch.nn.Module):
    """CPU stand-in for Transformer Engine's THD attention with a CP group (module docstring).
    Takes Megatron-Core's core-attention constructor and forward arguments."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self", cp_comm_type=None,
                 softmax_scale: float | None = None, pg_collection=None, **unused) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.static_cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("TeThdCpAttentionStandIn takes THD input only: packed_seq_params with qkv_format='thd'")
        if attention_bias is not None:
            raise ValueError("TeThdCpAttentionStandIn takes no attention_bias")
        q, k, v = (x.reshape(x.shape[0], x.shape[-2], x.shape[-1]) for x in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves a group of query heads
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        group = self._cp_group(packed_seq_params)
        cp_size = 1 if group is None else dist.get_world_size(group)
        cp_rank = 0 if group is None else dist.get_rank(group)
        mode = getattr(packed_seq_params, "cp_partition_mode", "zigzag")
        if cp_size > 1 and mode != "zigzag":
            raise ValueError(
                f"packed_seq_params.cp_partition_mode={mode!r} reached core attention with a CP group of {cp_size}: "
                "Transformer Engine reads every THD shard as zigzag (DualChunkSwap); Megatron-Core converts "
                "contiguous input to zigzag before core attention only when config.cp_partition_mode='contiguous'"
            )
        cu_q = _or(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q)
        cu_kv = _or(packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv)
        if not torch.equal(cu_q, cu_kv) or not torch.equal(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv):
            raise ValueError("TeThdCpAttentionStandIn is self-attention: the q and kv cu_seqlens must be equal")
        mine = thd_geometry(packed_seq_params.cu_seqlens_q, cu_q, cp_size, cp_rank, q.shape[0]).to(q.device)
        if cp_size > 1:
            k, v = (all_gather_with_grad(x, group, dim=0) for x in (k, v))
            geometries = [thd_geometry(packed_seq_params.cu_seqlens_q, cu_q, cp_size, r, q.shape[0]).to(q.device) for r in range(cp_size)]
        else:
            geometries = [mine]
        key_sequence = torch.cat([g.sequence for g in geometries])
        key_position = torch.cat([g.position for g in geometries])
        key_real = torch.cat([g.real for g in geometries])
        out = torch.zeros_like(q)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        for index in range(cu_q.numel() - 1):
            rows = ((mine.sequence == index) & mine.real).nonzero().squeeze(1)  # padding rows keep a zero output
            keys = ((key_sequence == index) & key_real).nonzero().squeeze(1)
            if rows.numel() == 0 or keys.numel() == 0:
                continue
            mask = key_position[keys][None, :] <= mine.position[rows][:, None]  # causal within the sequence
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None], v[keys].transpose(0, 1)[None],
                attn_mask=mask, scale=scale,
            )[0].transpose(0, 1)
            out = out.index_copy(0, rows, attended)
        return out.reshape(out.shape[0], -1)

    def _cp_group(self, packed_seq_params):
        """The group Transformer Engine would run on (module docstring); None: no CP."""
        if packed_seq_params.local_cp_size is not None:
            return None if packed_seq_params.local_cp_size == 1 else packed_seq_params.cp_group
        group = self.static_cp_group
        return group if group is not None and dist.get_world_size(group) > 1 else None


def _or(first, second):
    return first if first is not None else second


def layer_spec_with_standin(num_experts: int | None = None):
    """Megatron-Core's local GPT layer spec (with an MoE MLP of `num_experts` experts when given)
    with only `self_attention.submodules.core_attention` replaced by the stand-in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=TeThdCpAttentionStandIn)
    return spec
