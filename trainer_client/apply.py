"""Apply a plan: from the global batch, this rank's micro-batches in plan order.

Input contract: every rank of the DPxCP group holds the SAME global batch (the one the plan was
made for): a `tensordict.TensorDict` (or any mapping of name -> tensor) with batch size [B] whose
`input_ids` is a jagged NestedTensor (`torch.nested.nested_tensor(..., layout=torch.jagged)`), as in
verl. Sample id i is row i. Other jagged fields (shape [L, ...] per sample, any trailing shape) are
per-token fields and are sharded exactly like `input_ids`; dense fields (shape [B, ...]) are
per-sample fields and travel with their sample. No samples move between ranks: each rank picks its
own from the batch it holds (token ids are small next to activations; a loader that shards by DP
rank must gather the global batch first).

Execution units: Megatron-Core's hybrid CP (capacity bound per sample) runs every sample of a CP
group as its own forward pass, so each sample is one RankMicroBatch; packing schedulers (dynamic
CP, static packing) pack all samples of a group into one RankMicroBatch. `last_of_micro_batch`
marks where the plan's micro-batch ends (Megatron-Core synchronises the DPxCP group there).

Sharding (Megatron's THD/CP layout): a sample of length L in a CP group of size c is padded to a
multiple of tp*c (tp*2c for zigzag with c > 1). Zigzag splits it into 2c chunks and group rank r
takes chunks r and 2c-1-r (balanced causal attention); contiguous splits it into c chunks and
rank r takes chunk r. Padding is along the sequence dimension only, never along trailing ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from batch_planner.padding import padded_length
from batch_planner.plan import CpGroup, Plan
from batch_planner.request import CapacityBound, CpLayout, SchedulerKind

CpGroupResolver = Callable[[int], "dist.ProcessGroup | None"]


class BatchMismatchError(ValueError):
    """The batch does not match the plan (sample count, lengths, field shapes)."""


@dataclass
class GlobalBatch:
    """A batch unbound into per-sample tensors once, so every micro-batch can index it cheaply."""

    lengths: tuple[int, ...]
    token_fields: dict[str, list[torch.Tensor]]  # name -> [sample] -> [L, ...]
    sample_fields: dict[str, torch.Tensor]  # name -> [B, ...]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)


def unbind_batch(batch: Mapping[str, Any]) -> GlobalBatch:
    if "input_ids" not in batch.keys():
        raise BatchMismatchError(f"the batch has no 'input_ids' field; fields: {sorted(batch.keys())}")
    input_ids = batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise BatchMismatchError(
            "input_ids must be a jagged NestedTensor (torch.nested.nested_tensor(..., layout=torch.jagged)), "
            f"got a dense tensor of shape {tuple(input_ids.shape)}"
        )
    token_fields: dict[str, list[torch.Tensor]] = {}
    sample_fields: dict[str, torch.Tensor] = {}
    ids = list(input_ids.unbind())
    lengths = tuple(int(t.shape[0]) for t in ids)
    for name in batch.keys():
        value = batch[name]
        if getattr(value, "is_nested", False):
            per_sample = list(value.unbind())
            _check_token_field(name, per_sample, lengths)
            token_fields[name] = per_sample
        else:
            if value.shape[:1] != (len(lengths),):
                raise BatchMismatchError(
                    f"per-sample field {name!r} has shape {tuple(value.shape)}; expected first dimension "
                    f"{len(lengths)} (one row per sample)"
                )
            sample_fields[name] = value
    return GlobalBatch(lengths, token_fields, sample_fields)


def _check_token_field(name: str, per_sample: list[torch.Tensor], lengths: tuple[int, ...]) -> None:
    if len(per_sample) != len(lengths):
        raise BatchMismatchError(f"field {name!r} has {len(per_sample)} samples, input_ids has {len(lengths)}")
    for sample_id, (tensor, length) in enumerate(zip(per_sample, lengths)):
        if tensor.shape[0] != length:
            raise BatchMismatchError(
                f"field {name!r} of sample {sample_id} has {tensor.shape[0]} tokens, its input_ids has {length}"
            )


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
    samples: dict[str, list[torch.Tensor]]  # the unsharded per-token tensors, for engines that shard
    sequence_lengths: tuple[int, ...]  # real lengths of sample_ids
    cu_seqlens: torch.Tensor  # int32, cumulative real lengths of the whole sequences
    cu_seqlens_padded: torch.Tensor  # int32, cumulative padded lengths of the whole sequences
    max_seqlen: int  # longest padded sequence
    real_local_tokens: int  # real tokens in this rank's shard
    global_real_tokens: int  # real tokens of the whole global batch
    packed_seq_params: Any = field(repr=False, default=None)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_fields["input_ids"]

    @property
    def local_tokens(self) -> int:
        return int(self.padding_mask.numel())

    @property
    def padding_local_tokens(self) -> int:
        return self.local_tokens - self.real_local_tokens

    @property
    def shard_lengths(self) -> torch.Tensor:
        """Tokens (padding included) this rank holds of each of `sample_ids`, in packing order."""
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).long() // self.local_cp_size

    def per_token(self, sample_values: torch.Tensor) -> torch.Tensor:
        """Per-sample values `[len(sample_ids), ...]` (e.g. `sample_fields["temperature"]`) repeated
        over this rank's shard tokens of each sample: `[local_tokens, ...]`."""
        if sample_values.shape[0] != len(self.sample_ids):
            raise ValueError(
                f"per_token: got {sample_values.shape[0]} rows for the {len(self.sample_ids)} samples of this micro-batch"
            )
        return sample_values.repeat_interleave(self.shard_lengths.to(sample_values.device), dim=0)


def shard_positions(length: int, cp_size: int, cp_rank: int, tensor_parallel_size: int, layout: CpLayout) -> torch.Tensor:
    """Positions (in the padded sequence) of the tokens rank `cp_rank` holds."""
    padded = padded_length(length, cp_size, tensor_parallel_size, layout)
    if cp_size == 1:
        return torch.arange(padded)
    if layout is CpLayout.ZIGZAG:
        chunk = padded // (2 * cp_size)
        first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
        second_index = 2 * cp_size - 1 - cp_rank
        second = torch.arange(second_index * chunk, (second_index + 1) * chunk)
        return torch.cat([first, second])
    chunk = padded // cp_size
    return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)


def _shard(tensor: torch.Tensor, positions: torch.Tensor, pad_value: int | float) -> torch.Tensor:
    length = tensor.shape[0]
    padded = int(positions.max()) + 1 if positions.numel() else 0
    if padded > length:
        filler = torch.full((padded - length, *tensor.shape[1:]), pad_value, dtype=tensor.dtype, device=tensor.device)
        tensor = torch.cat([tensor, filler])
    return tensor[positions]


def micro_batches_for_rank(
    plan: Plan,
    batch: GlobalBatch | Mapping[str, Any],
    rank: int,
    cp_group_for: CpGroupResolver | None = None,
    pad_token_id: int = 0,
    pack_group_samples: bool | None = None,
) -> list[RankMicroBatch]:
    """This DPxCP rank's execution units, in plan order.

    `cp_group_for(size)` returns the process group of this rank for a CP size > 1 (see
    `megatron_cp_group_resolver`); without it `cp_group` is None and only `cp_group_ranks` say who
    the partners are. `pack_group_samples` defaults to how the plan's scheduler executes.
    """
    if not isinstance(batch, GlobalBatch):
        batch = unbind_batch(batch)
    num_samples = len(batch.lengths)
    planned = sum(len(g.sample_ids) for mb in plan.micro_batches for g in mb.cp_groups)
    if planned != num_samples:
        raise BatchMismatchError(f"the plan covers {planned} samples but the batch holds {num_samples}")
    if not 0 <= rank < plan.dp_cp_size:
        raise ValueError(f"rank {rank} is outside the plan's DPxCP group of {plan.dp_cp_size} ranks")
    if pack_group_samples is None:
        pack_group_samples = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    result: list[RankMicroBatch] = []
    for index, micro_batch in enumerate(plan.micro_batches):
        group = micro_batch.group_of_rank(rank)
        units = [group.sample_ids] if pack_group_samples else [(i,) for i in group.sample_ids]
        process_group = cp_group_for(group.size) if (cp_group_for and group.size > 1) else None
        for position, sample_ids in enumerate(units):
            result.append(
                _build(plan, batch, rank, index, position == len(units) - 1, group, sample_ids, process_group, pad_token_id)
            )
    return result


def _build(
    plan: Plan,
    batch: GlobalBatch,
    rank: int,
    index: int,
    last: bool,
    group: CpGroup,
    sample_ids: tuple[int, ...],
    process_group: Any,
    pad_token_id: int,
) -> RankMicroBatch:
    cp_rank = rank - group.first_rank
    tp = plan.tensor_parallel_size
    lengths = tuple(batch.lengths[i] for i in sample_ids)
    positions = [shard_positions(length, group.size, cp_rank, tp, plan.cp_layout) for length in lengths]
    token_fields = {
        name: torch.cat(
            [
                _shard(per_sample[i], pos, pad_token_id if name == "input_ids" else 0)
                for i, pos in zip(sample_ids, positions)
            ]
        )
        for name, per_sample in batch.token_fields.items()
    }
    padding_mask = torch.cat([pos < length for pos, length in zip(positions, lengths)])
    padded = [padded_length(length, group.size, tp, plan.cp_layout) for length in lengths]
    cu_seqlens = _cumulative(lengths)
    cu_seqlens_padded = _cumulative(padded)
    index_tensor = torch.tensor(sample_ids, dtype=torch.long)
    return RankMicroBatch(
        micro_batch_index=index,
        last_of_micro_batch=last,
        sample_ids=sample_ids,
        local_cp_size=group.size,
        cp_rank=cp_rank,
        cp_group_ranks=tuple(group.ranks),
        is_cp_leader=cp_rank == 0,
        cp_group=process_group,
        token_fields=token_fields,
        position_ids=torch.cat(positions),
        padding_mask=padding_mask,
        sample_fields={name: rows.index_select(0, index_tensor) for name, rows in batch.sample_fields.items()},
        samples={name: [per_sample[i] for i in sample_ids] for name, per_sample in batch.token_fields.items()},
        sequence_lengths=lengths,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=max(padded),
        real_local_tokens=int(padding_mask.sum()),
        global_real_tokens=batch.real_tokens,
        packed_seq_params=_packed_seq_params(cu_seqlens, cu_seqlens_padded, max(padded), group.size, process_group),
    )


def _cumulative(values) -> torch.Tensor:
    out = torch.zeros(len(values) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int64), 0).to(torch.int32)
    return out


def _packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, local_cp_size, cp_group):
    # Megatron-Core's own type, so the engine takes it as is (THD: whole-sequence cu_seqlens; the
    # attention kernel knows this rank holds its CP shard of each).
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        local_cp_size=local_cp_size,
        cp_group=cp_group,
    )


def megatron_cp_group_resolver(plan: Plan, dp_cp_group: Any = None) -> CpGroupResolver:
    """CP groups from Megatron-Core's own parallel_state, checked against the plan's ranks.

    Dynamic-CP plans use `get_dynamic_data_context_parallel_groups` where the build has it (dev
    branch); otherwise the hybrid DPxCP groups of the 0.19 release. CP1 has no group (None), as in
    Megatron-Core itself.
    """
    from megatron.core import parallel_state

    dynamic = getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
    hybrid = getattr(parallel_state, "get_hybrid_data_context_parallel_groups", None)
    lookup = dynamic if (plan.scheduler is SchedulerKind.DYNAMIC_CP and dynamic) else (hybrid or dynamic)
    if lookup is None:
        raise RuntimeError("this Megatron-Core has neither hybrid nor dynamic DPxCP groups (needs >= 0.15)")
    if dp_cp_group is None:
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_cp_ranks = dist.get_process_group_ranks(dp_cp_group)
    my_position = dp_cp_ranks.index(dist.get_rank())

    def resolve(size: int):
        if size == 1:
            return None
        group = lookup(group_size=size)
        first = my_position - my_position % size
        expected = dp_cp_ranks[first : first + size]
        actual = dist.get_process_group_ranks(group)
        if list(actual) != list(expected):
            raise RuntimeError(
                f"Megatron-Core's CP group of size {size} for this rank has ranks {actual}; the plan needs "
                f"{expected}: the DPxCP group's rank order differs from parallel_state's"
            )
        return group

    return resolve
