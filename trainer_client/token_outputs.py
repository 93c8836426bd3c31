"""Per-token outputs (log-probs, entropies, top-k logits `[L, k]`, ...) back as whole samples, in order.

Under CP every member of a sample's group holds a shard of its tokens (zigzag or contiguous, with
padding), so a per-token output of a sample is spread over several ranks. Each rank cuts its
micro-batch outputs `[local_tokens, ...]` into per-sample pieces with the positions they hold
(`token_pieces`), and `restore_token_outputs` gathers the pieces and puts every sample back as
`[L, ...]` in sample order, checking that every real token arrives exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from trainer_client.distributed import is_distributed
from trainer_client.micro_batch import RankMicroBatch
from trainer_client.outputs import OutputRestoreError


@dataclass(frozen=True)
class TokenPiece:
    """The tokens of one sample that one rank holds: positions in the sample and their values."""

    sample_id: int
    positions: torch.Tensor  # long, [n], real tokens only
    values: torch.Tensor  # [n, ...]


def token_pieces(micro_batch: RankMicroBatch, values: torch.Tensor) -> list[TokenPiece]:
    """Cuts a per-token output of this rank's shard (`[local_tokens, ...]`) into per-sample pieces.

    Padding tokens are dropped; every rank of a CP group reports its own pieces (not only the leader).
    """
    if values.shape[0] != micro_batch.local_tokens:
        raise ValueError(
            f"per-token output has {values.shape[0]} rows; the micro-batch shard has {micro_batch.local_tokens} tokens"
        )
    pieces: list[TokenPiece] = []
    start = 0
    for sample_id, size in zip(micro_batch.sample_ids, micro_batch.shard_lengths.tolist()):
        stop = start + size
        real = micro_batch.padding_mask[start:stop]
        pieces.append(
            TokenPiece(
                sample_id,
                micro_batch.position_ids[start:stop][real].to(torch.long),
                values[start:stop][real].detach().cpu(),
            )
        )
        start = stop
    return pieces


def restore_token_outputs(
    pieces: Iterable[TokenPiece], lengths: Sequence[int], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """All ranks call this with their pieces; all get `[L_i, ...]` per sample, in sample order."""
    local = list(pieces)
    if is_distributed(group):
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        local = [piece for part in gathered for piece in part]
    by_sample: dict[int, list[TokenPiece]] = {}
    for piece in local:
        if not 0 <= piece.sample_id < len(lengths):
            raise OutputRestoreError(f"per-token output for unknown sample id {piece.sample_id} (batch has 0..{len(lengths) - 1})")
        by_sample.setdefault(piece.sample_id, []).append(piece)
    missing = [i for i in range(len(lengths)) if i not in by_sample]
    if missing:
        raise OutputRestoreError(f"per-token outputs missing for sample ids {missing[:20]} ({len(missing)} in all)")
    restored: list[torch.Tensor] = []
    for sample_id, length in enumerate(lengths):
        parts = by_sample[sample_id]
        positions = torch.cat([p.positions for p in parts])
        values = torch.cat([p.values for p in parts])
        counts = torch.bincount(positions, minlength=length)
        if positions.numel() != length or counts.numel() != length or not bool((counts == 1).all()):
            raise OutputRestoreError(
                f"per-token outputs of sample {sample_id} cover {int((counts > 0).sum())} distinct of its {length} "
                f"tokens with {positions.numel()} rows; every token must come back exactly once"
            )
        out = torch.empty((length, *values.shape[1:]), dtype=values.dtype)
        out[positions] = values
        restored.append(out)
    return restored
