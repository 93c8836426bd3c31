"""A small decoder stack (pre-norm attention + MLP blocks) over packed, per-sequence tokens.

Token-wise work (norms, projections, MLP) runs on all of a pass's local tokens at once; attention
runs one sequence at a time, so samples packed into one pass never attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from bench.gpu.cp_attention import SequenceAttention


@dataclass(frozen=True)
class DecoderConfig:
    hidden_size: int = 2048
    num_heads: int = 16
    num_layers: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.attn_norm = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.up = nn.Linear(h, config.mlp_ratio * h, bias=False)
        self.down = nn.Linear(config.mlp_ratio * h, h, bias=False)

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int], attention: SequenceAttention) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(self.attn_norm(x)).view(tokens, 3, self.num_heads, self.head_dim)
        # [3, heads, tokens, head_dim]: one SDPA input layout for every sequence slice.
        qkv = qkv.permute(1, 2, 0, 3)
        outputs = []
        for q, k, v in zip(*(part.split(list(seq_lens), dim=1) for part in qkv)):
            outputs.append(attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)).squeeze(0))
        attn = torch.cat(outputs, dim=1).permute(1, 0, 2).reshape(tokens, -1)
        x = x + self.out(attn)
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


class DecoderStack(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor, seq_lens: Sequence[int], attention: SequenceAttention) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seq_lens, attention)
        return x
