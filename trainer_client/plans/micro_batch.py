"""What one rank runs in one forward/backward pass: its shard of an execution unit
(docs/trainer-client.md, "What a micro-batch carries").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_client.plans.batch import GlobalBatch
from trainer_client.errors import InvalidArgumentError


@dataclass
class RankMicroBatch:
    """What this rank runs in one forward/backward pass."""

    micro_batch_index: int  # index into plan.micro_batches
    last_of_micro_batch: bool
    sample_ids: tuple[int, ...]  # in execution order
    local_cp_size: int
    cp_rank: int  # this rank's position in its CP group
    cp_group_ranks: tuple[int, ...]  # DPxCP ranks of the group
    is_cp_leader: bool  # reports the group's per-sample outputs
    cp_group: Any  # Megatron-Core's process group for local_cp_size; None for CP1
    # This rank's shard of every per-token field, samples packed in order, padded along dim 0.
    token_fields: dict[str, torch.Tensor]
    position_ids: torch.Tensor  # position of each shard token in its (padded) sequence
    padding_mask: torch.Tensor  # bool, True on real tokens
    sample_fields: dict[str, torch.Tensor]  # rows of the per-sample fields, in sample_ids order
    sequence_lengths: tuple[int, ...]  # real lengths of sample_ids
    cu_seqlens: torch.Tensor  # int32, cumulative real lengths of the whole sequences
    cu_seqlens_padded: torch.Tensor  # int32, cumulative padded lengths of the whole sequences
    max_seqlen: int  # longest padded sequence
    shard_token_counts: tuple[int, ...]  # rows of this shard per sample of sample_ids, padding included
    real_local_tokens: int  # real tokens in this rank's shard
    global_real_tokens: int  # real tokens of the whole global batch
    packed_seq_params: Any = field(repr=False, default=None)
    global_batch: GlobalBatch | None = field(repr=False, default=None)  # the batch the unit was cut from

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_fields["input_ids"]

    @property
    def samples(self) -> dict[str, list[torch.Tensor]]:
        """The unsharded per-token tensors `[L, ...]` of `sample_ids`, for engines that shard
        themselves (views of the batch, made on first use: most trainers never read them)."""
        batch = self.global_batch
        if batch is None:
            return {}
        return {name: batch.samples(name, self.sample_ids) for name in batch.token_fields}

    @property
    def local_tokens(self) -> int:
        return int(self.padding_mask.numel())

    @property
    def padding_local_tokens(self) -> int:
        return self.local_tokens - self.real_local_tokens

    @property
    def shard_lengths(self) -> torch.Tensor:
        """Tokens (padding included) this rank holds of each of `sample_ids`, in packing order.
        Under the contiguous layout a rank of a packed unit may hold none of some samples."""
        return torch.tensor(self.shard_token_counts, dtype=torch.long)

    def per_token(self, sample_values: torch.Tensor) -> torch.Tensor:
        """Per-sample values `[len(sample_ids), ...]` (e.g. `sample_fields["temperature"]`) repeated
        over this rank's shard tokens of each sample: `[local_tokens, ...]`."""
        if sample_values.shape[0] != len(self.sample_ids):
            raise InvalidArgumentError(
                f"per_token: got {sample_values.shape[0]} rows for the {len(self.sample_ids)} samples of this micro-batch"
            )
        return sample_values.repeat_interleave(self.shard_lengths.to(sample_values.device), dim=0)
