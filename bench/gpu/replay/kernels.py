"""The GPU side of the replay: one rank's kernels, built and run through Megatron-Core's
Transformer Engine layer spec (GPU only: imports torch, Megatron-Core and Transformer Engine).

- `Engine`: one process, one GPU; torch.distributed and Megatron-Core's parallel_state over a world
  of one (TP1: one TP rank's shapes, `shapes.RankShape`), one `TransformerLayer` of
  `get_gpt_layer_with_transformer_engine_spec` in bf16, its RoPE, and the embedding and output layer
  at one TP rank's vocabulary share.
- `Engine.attention_pass`: the layer's own core attention (`TEDotProductAttention`) on one rank's
  share of a CP group's micro-batch, forward and backward; the group's other ranks are
  `in_process_peers.py`'s stand-in.
- `Engine.layer_pass`: the whole layer at CP1 on a micro-batch (the check that the replay's parts
  add up to the layer), and `rest_pass`: the layer with its core attention replaced by a no-op
  that keeps q, k and v in the graph (what a pass costs besides attention: norms, the QKV, output
  and MLP GEMMs, RoPE, residuals).
- `Engine.head_pass`: the embedding lookup, the output layer's GEMM and Megatron-Core's
  vocab-parallel cross-entropy (fp32) at T tokens.

Each `*_pass` returns the median forward and backward seconds over `repeats` runs after `warmup`,
from CUDA events around the forward and around the backward (gradients cleared between runs,
outside the timed spans).
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, Sequence

import torch

from bench.gpu.replay.clock import Timing
from bench.gpu.replay.in_process_peers import CpGroupStandIn, InProcessCpPeersStandIn
from bench.gpu.replay.shapes import RankShape

ROPE_BASE = 500000.0


def init_world_of_one() -> None:
    """torch.distributed and parallel_state over one process on this GPU (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def transformer_config(shape: RankShape):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size or shape.hidden_size,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        apply_rope_fusion=True, gradient_accumulation_fusion=False, init_method_std=0.02, cp_comm_type="p2p",
    )
    if shape.num_experts:
        fields.update(
            num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_top_k, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
            qk_layernorm=True, moe_permute_fusion=False,
        )
    return TransformerConfig(**fields)


class _NoCoreAttention(torch.nn.Module):
    """Core attention's place taken by a no-op: the output is q's values, and k and v stay in the
    graph through a zero-weighted sum (so their RoPE and projections run backward too)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        touch = (key.float().sum() + value.float().sum()) * 0.0
        return query.reshape(query.shape[0], -1) + touch.to(query.dtype)


def packed_params(real: Sequence[int], padded: Sequence[int], cp_size: int, group):
    """Megatron-Core's PackedSeqParams of one CP group's micro-batch (whole sequences' cu_seqlens,
    real and padded) with its dynamic CP size and group: the drop-ins' own (`trainer_client.plans.megatron`)."""
    from batch_planner.request import CpLayout
    from trainer_client.plans.megatron import packed_seq_params

    def cumulative(values: Sequence[int]) -> torch.Tensor:
        out = [0]
        for n in values:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32, device="cuda")

    return packed_seq_params(cumulative(real), cumulative(padded), max(padded), cp_size, group, CpLayout.ZIGZAG)


def attention_inputs(heads: int, kv_heads: int, head_dim: int, real: Sequence[int], padded: Sequence[int], cp_size: int,
                     cp_rank: int, plant: str = ""):
    """q, k, v (requiring grad), the output's gradient and the PackedSeqParams of rank `cp_rank`'s
    share of a CP group's micro-batch, its group a `CpGroupStandIn`: what core attention gets on
    that rank (`Engine.attention_pass` documents `plant`)."""
    if plant == "whole_sequence":  # the group's whole sequences, as if this rank were the group
        cp_size, cp_rank = 1, 0
    group = CpGroupStandIn(cp_size, 0 if plant == "rank_zero" else cp_rank)
    params = packed_params(real, padded, cp_size, group)
    rows = sum(padded) // cp_size
    gen = torch.Generator(device="cuda").manual_seed(11)

    def values(*size: int) -> torch.Tensor:
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = values(rows, heads, head_dim).requires_grad_()
    k = values(rows, kv_heads, head_dim).requires_grad_()
    v = values(rows, kv_heads, head_dim).requires_grad_()
    return q, k, v, values(rows, heads * head_dim), params


def core_attention_forward(core_attention, q, k, v, params):
    """Core attention's forward as Megatron-Core's SelfAttention calls it on packed input (causal)."""
    from megatron.core.transformer.enums import AttnMaskType

    return core_attention(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)


class Engine:
    """One rank's kernels for one model shape (module docstring)."""

    def __init__(self, shape: RankShape, warmup: int = 2, repeats: int = 5) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.transformer.spec_utils import build_module

        init_world_of_one()
        self.shape, self.warmup, self.repeats = shape, warmup, repeats
        self.config = transformer_config(shape)
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=shape.num_experts or None, moe_grouped_gemm=bool(shape.num_experts), qk_layernorm=bool(shape.num_experts),
        )
        self.layer = build_module(spec, config=self.config, layer_number=1).cuda()
        self.core_attention = self.layer.self_attention.core_attention
        self.rope = RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0, rotary_base=ROPE_BASE)
        self.peers = InProcessCpPeersStandIn()
        h, v = shape.hidden_size, shape.vocab_size
        gen = torch.Generator(device="cuda").manual_seed(7)
        self.embedding = (torch.randn(v, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02).requires_grad_()
        self.output_weight = (torch.randn(v, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02).requires_grad_()

    # ---------------------------------------------------------------- timing

    def _timed(self, forward: Callable[[], torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor],
               clear: Sequence[torch.Tensor] = ()) -> Timing:
        fwd, bwd = [], []
        for run in range(self.warmup + self.repeats):
            for p in self.layer.parameters():
                p.grad = None
            for t in clear:
                t.grad = None
            start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            self.peers.phase = "forward"
            out = forward()
            middle.record()
            self.peers.phase = "backward"
            out.backward(grad_of(out))
            end.record()
            self.peers.phase = ""
            torch.cuda.synchronize()
            if run >= self.warmup:
                fwd.append(start.elapsed_time(middle) / 1e3)
                bwd.append(middle.elapsed_time(end) / 1e3)
        return Timing(statistics.median(fwd), statistics.median(bwd))

    # ---------------------------------------------------------------- passes

    def attention_pass(self, real: Sequence[int], padded: Sequence[int], cp_size: int, cp_rank: int,
                       plant: str = "") -> tuple[Timing, list]:
        """This rank's share of the group's attention, forward and backward; and the messages its
        ring sent and received in one forward + backward (the last timed run's).

        `plant` (the fidelity check's planted mistakes, docs/gpu-replay.md): "whole_sequence" runs
        the group's whole sequences' attention on this rank, as if it were the group; "rank_zero" tells
        Transformer Engine every rank is rank 0 of the group, which drops the ring steps where a
        rank attends to half of a peer's keys and values."""
        s = self.shape
        q, k, v, grad, params = attention_inputs(s.num_attention_heads, s.num_kv_heads, s.head_dim, real, padded, cp_size, cp_rank, plant)
        with self.peers:
            self.peers.take()
            timing = self._timed(
                lambda: core_attention_forward(self.core_attention, q, k, v, params),
                lambda out: grad.view_as(out), clear=(q, k, v),
            )
            messages = self.peers.take()
        per_run = len(messages) // (self.warmup + self.repeats)
        return timing, messages[-per_run:] if per_run else []

    def _layer_inputs(self, real: Sequence[int], padded: Sequence[int]):
        group = CpGroupStandIn(1, 0)
        params = packed_params(real, padded, 1, group)
        rotary = self.rope(max(padded), packed_seq=True, cp_group=group)
        gen = torch.Generator(device="cuda").manual_seed(13)
        x = torch.randn(sum(padded), 1, self.shape.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        return params, rotary, x, grad

    def layer_pass(self, real: Sequence[int], padded: Sequence[int]) -> Timing:
        """The whole layer, its real core attention included, on a CP1 micro-batch."""
        params, rotary, x, grad = self._layer_inputs(real, padded)
        with self.peers:
            return self._timed(lambda: self.layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary,
                                                  packed_seq_params=params)[0], lambda out: grad, clear=(x,))

    def rest_pass(self, tokens: int) -> Timing:
        """The layer without its core attention at `tokens` rows (one sequence)."""
        params, rotary, x, grad = self._layer_inputs([tokens], [tokens])
        original = self.layer.self_attention.core_attention
        self.layer.self_attention.core_attention = _NoCoreAttention()
        try:
            with self.peers:
                return self._timed(lambda: self.layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary,
                                                      packed_seq_params=params)[0], lambda out: grad, clear=(x,))
        finally:
            self.layer.self_attention.core_attention = original

    def head_pass(self, tokens: int) -> Timing:
        """Embedding lookup, output GEMM and vocab-parallel cross-entropy at `tokens` rows."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        gen = torch.Generator(device="cuda").manual_seed(17)
        ids = torch.randint(0, self.shape.vocab_size, (tokens,), device="cuda", generator=gen)
        labels = torch.randint(0, self.shape.vocab_size, (tokens, 1), device="cuda", generator=gen)

        def forward() -> torch.Tensor:
            hidden = torch.nn.functional.embedding(ids, self.embedding).unsqueeze(1)
            logits = torch.nn.functional.linear(hidden, self.output_weight)
            return vocab_parallel_cross_entropy(logits.float(), labels).sum()

        return self._timed(forward, lambda out: torch.ones_like(out), clear=(self.embedding, self.output_weight))
