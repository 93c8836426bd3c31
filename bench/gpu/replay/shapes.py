"""The model a replay prices, as one tensor-parallel rank runs it.

Megatron-Core splits attention heads, key/value groups, the MLP's width and the vocabulary over
the TP group (column- and row-parallel linear layers; vocab-parallel embedding and output layer).
One TP rank's GEMMs are therefore those of a TP1 layer with 1/t of the heads, key/value groups, MLP
width and vocabulary, and the same hidden size: that is the layer `measure.py` builds and times on
one GPU. What TP adds on top, its collectives, is a link (`links.py`). With sequence parallelism the
norms and dropouts run on T / t rows; the TP1 layer runs them on T rows (an overstatement of their
small share, said in docs/gpu-replay.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from batch_planner.cost_spec import MODEL_PROFILES, ModelProfile

# The models the replay prices, with the TP size their users run them at.
REPLAY_TP: dict[str, int] = {"llama3-8b": 1, "llama3-70b": 8, "qwen3-30b-a3b": 1}
BF16_BYTES = 2


@dataclass(frozen=True)
class RankShape:
    """One TP rank's share of a model: what its GEMMs and its attention see."""

    model: str
    tensor_parallel_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int  # per TP rank
    num_kv_heads: int  # per TP rank
    head_dim: int
    ffn_hidden_size: int  # per TP rank; 0 for an all-MoE model
    vocab_size: int  # per TP rank
    num_experts: int = 0  # MoE: experts of the layer (all on this GPU: expert parallelism 1)
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0  # per TP rank

    @classmethod
    def of(cls, model: str, tensor_parallel_size: int | None = None) -> RankShape:
        profile: ModelProfile = MODEL_PROFILES[model]
        t = REPLAY_TP.get(model, 1) if tensor_parallel_size is None else tensor_parallel_size
        for name, value in (("num_attention_heads", profile.num_attention_heads), ("num_kv_heads", profile.num_kv_heads),
                            ("ffn_hidden_size", profile.ffn_hidden_size), ("vocab_size", profile.vocab_size),
                            ("moe_ffn_hidden_size", profile.moe_ffn_hidden_size)):
            if value % t:
                raise ValueError(f"{model}: {name} {value} is not divisible by tensor_parallel_size {t}")
        return cls(
            model=model, tensor_parallel_size=t, num_layers=profile.num_layers, hidden_size=profile.hidden_size,
            num_attention_heads=profile.num_attention_heads // t, num_kv_heads=profile.num_kv_heads // t,
            head_dim=profile.head_dim, ffn_hidden_size=profile.ffn_hidden_size // t, vocab_size=profile.vocab_size // t,
            num_experts=profile.num_experts, moe_top_k=profile.moe_top_k, moe_ffn_hidden_size=profile.moe_ffn_hidden_size // t,
        )

    @property
    def key(self) -> str:
        """The name measurements are filed under: "<model>-tp<t>"."""
        return f"{self.model}-tp{self.tensor_parallel_size}"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values in one layer on this rank (what a CP ring step sends
        per token of the sender's shard, forward)."""
        return 2 * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def activation_bytes_per_token(self) -> int:
        """Bytes of one token's hidden state (what a TP all-gather or reduce-scatter moves per token)."""
        return self.hidden_size * BF16_BYTES
