"""What the drop-in's multi-rank tests and benchmark share: deterministic per-DP-rank packed
samples (each DP rank loads different ones, as Megatron-LM's samplers shard by DP rank), and the
oracle that rebuilds the global batch from the same seeds to check what each rank received."""

from __future__ import annotations

from types import SimpleNamespace

import torch

MAX_SEQLEN_PER_RANK = 512


def _lengths(step: int, dp_rank: int, samples: int) -> list[list[int]]:
    """Sub-sample lengths of each packed sample: mostly short, a long tail that needs CP2-CP4."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    packed = []
    for j in range(samples):
        count = 1 + int(torch.randint(0, 3, (1,), generator=g))
        lengths = [int(x) for x in torch.randint(16, 400, (count,), generator=g)]
        if (step + dp_rank + j) % 4 == 0:
            lengths[0] = int(torch.randint(600, 1500, (1,), generator=g))
        packed.append(lengths)
    return packed


def packed_sample(step: int, dp_rank: int, index: int, lengths: list[int], zero_gap: bool = False) -> dict:
    """One packed sample as Megatron-LM's SFT dataset makes it: 1-D fields, cu_seqlens over them."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * dp_rank + index)
    total = sum(lengths)
    tokens = torch.randint(0, 50_000, (total,), generator=g, dtype=torch.int64)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
        if zero_gap and len(bounds) == 2:
            bounds.append(bounds[-1])  # a zero-length sub-sample, which Megatron-Core skips
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1),
        "loss_mask": torch.rand(total, generator=g),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
    }


def local_packed_batch(step: int, dp_rank: int, samples: int = 2) -> list[dict]:
    return [
        packed_sample(step, dp_rank, j, lengths, zero_gap=(j == 1))
        for j, lengths in enumerate(_lengths(step, dp_rank, samples + dp_rank % 2))
    ]


def global_subsamples(step: int, dp_size: int, samples: int = 2) -> list[dict]:
    """The oracle: every DP rank's sub-samples in DP rank order (Megatron-Core's global ids)."""
    out = []
    for dp_rank in range(dp_size):
        for sample in local_packed_batch(step, dp_rank, samples):
            cu = sample["cu_seqlens"].tolist()
            for a, b in zip(cu, cu[1:]):
                if b > a:
                    out.append({k: v[a:b] for k, v in sample.items() if k != "cu_seqlens"})
    return out


def megatron_config(**overrides) -> SimpleNamespace:
    """The fields of Megatron's model-parallel config the wrappers read."""
    values = dict(
        max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK,
        tensor_model_parallel_size=1,
        context_parallel_size=2,
        sequence_packing_scheduler=None,
        min_dynamic_context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        thd_max_packed_sequences=None,
        pad_packed_seq_alignment=None,
        calculate_per_token_loss=True,
    )
    values.update(overrides)
    return SimpleNamespace(**values)
