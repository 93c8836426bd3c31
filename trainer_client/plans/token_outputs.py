"""Per-token outputs (log-probs, entropies, top-k logits `[L, k]`, ...) back as whole samples, in order:
each rank cuts its CP shard's outputs into per-sample pieces (`token_pieces`), `restore_token_outputs`
gathers them (docs/trainer-client.md, "Per-sample side data travels with its sample").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from batch_planner.errors import InvalidRequestError
from batch_planner.validation import sequence_lengths_of
from trainer_client.plans.distributed import is_distributed
from trainer_client.errors import ArgumentTypeError, InvalidArgumentError
from trainer_client.plans.micro_batch import RankMicroBatch
from trainer_client.plans.outputs import OutputRestoreError
from trainer_client.plans.together import fail_together, naming_rank


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
    if not isinstance(micro_batch, RankMicroBatch):
        raise ArgumentTypeError(f"micro_batch: got a {type(micro_batch).__name__}; expected a RankMicroBatch of micro_batches()")
    if not isinstance(values, torch.Tensor) or values.dim() == 0:
        raise ArgumentTypeError(f"values: got {type(values).__name__}; expected a tensor [local_tokens, ...] of this rank's shard")
    if values.shape[0] != micro_batch.local_tokens:
        raise InvalidArgumentError(
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
    checked = _checked_lengths(lengths)
    local, problem = _listed_pieces(pieces)
    if isinstance(checked, InvalidArgumentError):
        problem, local = checked, []
    if is_distributed(group):
        gathered = fail_together(naming_rank(problem, group), group, local, context="{message}")
        local = [piece for part in gathered for piece in part]
    elif problem is not None:
        raise problem
    if isinstance(checked, InvalidArgumentError):  # raised above already, on every rank
        raise checked
    return _restored(local, checked)


def _checked_lengths(lengths: Any) -> tuple[int, ...] | InvalidArgumentError:
    """The lengths by the planner's own rule, or what is wrong with them (named `lengths`)."""
    try:
        return sequence_lengths_of(lengths)
    except InvalidRequestError as error:
        return InvalidArgumentError("lengths" + str(error).removeprefix("sequence_lengths"))


def _listed_pieces(pieces: Any) -> tuple[list[TokenPiece], ArgumentTypeError | None]:
    """The pieces as a list, or what is wrong with them."""
    if not isinstance(pieces, Iterable) or isinstance(pieces, (str, bytes, torch.Tensor)):
        return [], ArgumentTypeError(f"pieces: got a {type(pieces).__name__}; expected the TokenPieces of token_pieces()")
    listed = list(pieces)
    for index, piece in enumerate(listed):
        if not isinstance(piece, TokenPiece):
            return [], ArgumentTypeError(f"pieces: item {index} is a {type(piece).__name__}; expected the TokenPieces of token_pieces()")
        if not _well_formed(piece):
            return [], ArgumentTypeError(
                f"pieces: item {index} (sample_id {piece.sample_id!r:.40}) is not a piece of token_pieces(): it needs an "
                "int sample_id, 1-D integer positions and values with one row per position"
            )
    return listed, None


def _well_formed(piece: TokenPiece) -> bool:
    positions, values = piece.positions, piece.values
    return (
        type(piece.sample_id) is int and isinstance(positions, torch.Tensor) and isinstance(values, torch.Tensor)
        and positions.dim() == 1 and not positions.dtype.is_floating_point and not positions.dtype.is_complex
        and positions.dtype is not torch.bool and values.dim() >= 1 and values.shape[0] == positions.shape[0]
    )


def _restored(local: list[TokenPiece], lengths: tuple[int, ...]) -> list[torch.Tensor]:
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
        if len({(p.values.shape[1:], p.values.dtype) for p in parts}) > 1:
            raise OutputRestoreError(
                f"per-token outputs of sample {sample_id} come in pieces of different shapes or dtypes "
                f"{sorted({(tuple(p.values.shape[1:]), str(p.values.dtype)) for p in parts})}; every rank must report the same"
            )
        positions = torch.cat([p.positions for p in parts]).to(torch.long)
        values = torch.cat([p.values for p in parts])
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= length):
            raise OutputRestoreError(
                f"per-token outputs of sample {sample_id} hold positions outside 0..{length - 1} "
                f"({int(positions.min())}..{int(positions.max())}); positions are the tokens' places in the sample"
            )
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
