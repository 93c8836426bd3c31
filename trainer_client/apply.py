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

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from batch_planner.padding import padded_length
from batch_planner.plan import CpGroup, Plan
from batch_planner.request import CapacityBound, CpLayout
# The Megatron-Core touches live in trainer_client/megatron.py; re-exported here under their old names.
from trainer_client.megatron import CpGroupResolver, megatron_cp_group_resolver
from trainer_client.megatron import packed_seq_params as _packed_seq_params

class BatchMismatchError(ValueError):
    """The batch does not match the plan (sample count, lengths, field shapes)."""


@dataclass(frozen=True)
class JaggedField:
    """One per-token field of the batch, read once: the packed tokens of all samples and where
    each sample starts in them (a jagged NestedTensor's values and offsets; no per-sample unbind)."""

    values: torch.Tensor  # [total tokens, ...]
    starts: tuple[int, ...]  # row in `values` of each sample's first token

    def sample(self, sample_id: int, lengths: tuple[int, ...]) -> torch.Tensor:
        start = self.starts[sample_id]
        return self.values[start : start + lengths[sample_id]]


@dataclass
class GlobalBatch:
    """A batch read into packed per-token fields once, so every micro-batch slices it cheaply."""

    lengths: tuple[int, ...]
    token_fields: dict[str, JaggedField]
    sample_fields: dict[str, torch.Tensor]  # name -> [B, ...]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    def samples(self, name: str, sample_ids: tuple[int, ...]) -> list[torch.Tensor]:
        """The unsharded tokens `[L, ...]` of field `name` for `sample_ids` (views of the batch)."""
        field = self.token_fields[name]
        return [field.sample(i, self.lengths) for i in sample_ids]


def unbind_batch(batch: Mapping[str, Any]) -> GlobalBatch:
    if "input_ids" not in batch.keys():
        raise BatchMismatchError(f"the batch has no 'input_ids' field; fields: {sorted(batch.keys())}")
    input_ids = batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise BatchMismatchError(
            "input_ids must be a jagged NestedTensor (torch.nested.nested_tensor(..., layout=torch.jagged)), "
            f"got a dense tensor of shape {tuple(input_ids.shape)}"
        )
    lengths, _ = _jagged_field(input_ids)
    token_fields: dict[str, JaggedField] = {}
    sample_fields: dict[str, torch.Tensor] = {}
    for name in batch.keys():
        value = batch[name]
        if getattr(value, "is_nested", False):
            field_lengths, token_fields[name] = _jagged_field(value)
            _check_token_field(name, field_lengths, lengths)
        else:
            if value.shape[:1] != (len(lengths),):
                raise BatchMismatchError(
                    f"per-sample field {name!r} has shape {tuple(value.shape)}; expected first dimension "
                    f"{len(lengths)} (one row per sample)"
                )
            sample_fields[name] = value
    return GlobalBatch(lengths, token_fields, sample_fields)


def _jagged_field(nested: torch.Tensor) -> tuple[tuple[int, ...], JaggedField]:
    """(lengths, packed field) of a NestedTensor; its offsets give both without unbinding it."""
    if nested.layout is torch.jagged and getattr(nested, "_ragged_idx", 1) == 1:
        offsets = nested.offsets()
        lengths = nested.lengths()  # not None only for a view with holes between samples
        if lengths is None:
            lengths = offsets.diff()
        return tuple(lengths.tolist()), JaggedField(nested.values(), tuple(offsets[:-1].tolist()))
    # Strided layout (or ragged along another dimension): per-sample tensors, packed once.
    per_sample = list(nested.unbind())
    lengths = tuple(int(t.shape[0]) for t in per_sample)
    starts = tuple(itertools.accumulate(lengths, initial=0))[:-1]
    return lengths, JaggedField(torch.cat(per_sample) if per_sample else torch.empty(0, dtype=nested.dtype), starts)


def _check_token_field(name: str, field_lengths: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    if len(field_lengths) != len(lengths):
        raise BatchMismatchError(f"field {name!r} has {len(field_lengths)} samples, input_ids has {len(lengths)}")
    if field_lengths == lengths:
        return
    sample_id, (tokens, length) = next((i, pair) for i, pair in enumerate(zip(field_lengths, lengths)) if pair[0] != pair[1])
    raise BatchMismatchError(f"field {name!r} of sample {sample_id} has {tokens} tokens, its input_ids has {length}")


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


def shard_ranges(
    length: int, cp_size: int, cp_rank: int, tensor_parallel_size: int, layout: CpLayout
) -> list[tuple[int, int]]:
    """`[start, stop)` ranges of the padded sequence that rank `cp_rank` holds, in order; adjacent
    ranges (zigzag's middle rank) are merged."""
    padded = padded_length(length, cp_size, tensor_parallel_size, layout)
    if cp_size == 1:
        return [(0, padded)]
    if layout is CpLayout.ZIGZAG:
        chunk = padded // (2 * cp_size)
        second = 2 * cp_size - 1 - cp_rank
        if second == cp_rank + 1:
            return [(cp_rank * chunk, (second + 1) * chunk)]
        return [(cp_rank * chunk, (cp_rank + 1) * chunk), (second * chunk, (second + 1) * chunk)]
    chunk = padded // cp_size
    return [(cp_rank * chunk, (cp_rank + 1) * chunk)]


def shard_positions(length: int, cp_size: int, cp_rank: int, tensor_parallel_size: int, layout: CpLayout) -> torch.Tensor:
    """Positions (in the padded sequence) of the tokens rank `cp_rank` holds."""
    return _arange_ranges(shard_ranges(length, cp_size, cp_rank, tensor_parallel_size, layout))


def _arange_ranges(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """torch.cat([torch.arange(a, b) for a, b in ranges]); for many ranges (packed units) in four
    ops: a cumulative sum of steps that are 1 inside a range and jump where the next one starts."""
    if len(ranges) <= 2:
        return torch.cat([torch.arange(a, b) for a, b in ranges]) if len(ranges) == 2 else torch.arange(*ranges[0])
    steps = torch.ones(sum(b - a for a, b in ranges), dtype=torch.long)
    jump_at, jump_to, offset, previous_stop = [], [], 0, 1
    for start, stop in ranges:
        if stop > start:
            jump_at.append(offset)
            jump_to.append(start - previous_stop + 1)
            offset, previous_stop = offset + stop - start, stop
    steps[jump_at] = torch.tensor(jump_to, dtype=torch.long)
    return steps.cumsum(0)


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
    units: list[_Unit] = []
    for index, micro_batch in enumerate(plan.micro_batches):
        group = micro_batch.group_of_rank(rank)
        process_group = cp_group_for(group.size) if (cp_group_for and group.size > 1) else None
        per_unit = [group.sample_ids] if pack_group_samples else [(i,) for i in group.sample_ids]
        for position, sample_ids in enumerate(per_unit):
            units.append(_Unit.of(plan, batch, rank, index, position == len(per_unit) - 1, group, sample_ids, process_group))
    if not units:
        return []
    # The tiny per-unit tensors come from one tensor each, split into views.
    cu_seqlens = _cumulative_per_unit([u.lengths for u in units])
    cu_seqlens_padded = _cumulative_per_unit([u.padded for u in units])
    samples_per_unit = [len(u.sample_ids) for u in units]
    all_sample_ids = torch.tensor([i for u in units for i in u.sample_ids], dtype=torch.long)
    sample_fields = {
        name: rows.index_select(0, all_sample_ids).split(samples_per_unit) for name, rows in batch.sample_fields.items()
    }
    global_real_tokens = batch.real_tokens
    return [
        unit.build(
            batch,
            pad_token_id,
            cu_seqlens[k],
            cu_seqlens_padded[k],
            {name: rows[k] for name, rows in sample_fields.items()},
            global_real_tokens,
        )
        for k, unit in enumerate(units)
    ]


@dataclass
class _Unit:
    """One execution unit of this rank, in plain Python ints: which rows of the packed batch its
    shard holds (real tokens), where padding goes, and which padded-sequence positions it covers.
    Its tensors are then built with a few ops each (one cat of contiguous slices per field)."""

    index: int  # of the plan's micro-batch
    last: bool  # of that micro-batch
    group: CpGroup
    cp_rank: int
    process_group: Any
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]
    pieces: list[tuple[int, int, int] | int] = field(default_factory=list)  # (sample_id, start, stop) rows, or a pad count
    padding_runs: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) in the shard
    positions: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) in the padded sequences
    tokens: int = 0
    real_tokens: int = 0

    @classmethod
    def of(
        cls, plan: Plan, batch: GlobalBatch, rank: int, index: int, last: bool, group: CpGroup,
        sample_ids: tuple[int, ...], process_group: Any,
    ) -> "_Unit":
        cp_rank = rank - group.first_rank
        tp, layout = plan.tensor_parallel_size, plan.cp_layout
        lengths = tuple(batch.lengths[i] for i in sample_ids)
        padded = tuple(padded_length(n, group.size, tp, layout) for n in lengths)
        unit = cls(index, last, group, cp_rank, process_group, sample_ids, lengths, padded)
        for sample_id, length in zip(sample_ids, lengths):
            for start, stop in shard_ranges(length, group.size, cp_rank, tp, layout):
                unit._add_range(sample_id, length, start, stop)
        return unit

    def _add_range(self, sample_id: int, length: int, start: int, stop: int) -> None:
        self.positions.append((start, stop))
        real_stop = min(stop, length)
        if start < real_stop:
            self.pieces.append((sample_id, start, real_stop))
            self.real_tokens += real_stop - start
        pad_start = max(start, length)
        if stop > pad_start:  # the range reaches into the sequence's padding
            self.pieces.append(stop - pad_start)
            self.padding_runs.append((self.tokens + pad_start - start, self.tokens + stop - start))
        self.tokens += stop - start

    def build(
        self,
        batch: GlobalBatch,
        pad_token_id: int,
        cu_seqlens: torch.Tensor,
        cu_seqlens_padded: torch.Tensor,
        sample_fields: dict[str, torch.Tensor],
        global_real_tokens: int,
    ) -> RankMicroBatch:
        padding_mask = torch.ones(self.tokens, dtype=torch.bool)
        for start, stop in self.padding_runs:
            padding_mask[start:stop] = False
        max_seqlen = max(self.padded)
        return RankMicroBatch(
            micro_batch_index=self.index,
            last_of_micro_batch=self.last,
            sample_ids=self.sample_ids,
            local_cp_size=self.group.size,
            cp_rank=self.cp_rank,
            cp_group_ranks=tuple(self.group.ranks),
            is_cp_leader=self.cp_rank == 0,
            cp_group=self.process_group,
            token_fields={
                name: _gather_rows(jagged, self.pieces, pad_token_id if name == "input_ids" else 0)
                for name, jagged in batch.token_fields.items()
            },
            position_ids=_arange_ranges(self.positions),
            padding_mask=padding_mask,
            sample_fields=sample_fields,
            sequence_lengths=self.lengths,
            cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_seqlens_padded,
            max_seqlen=max_seqlen,
            real_local_tokens=self.real_tokens,
            global_real_tokens=global_real_tokens,
            packed_seq_params=_packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, self.group.size, self.process_group),
            global_batch=batch,
        )


def _gather_rows(jagged: JaggedField, pieces: list[tuple[int, int, int] | int], pad_value: int | float) -> torch.Tensor:
    """One cat of contiguous slices of the packed field (adjacent ones merged) and filler rows."""
    values = jagged.values
    spans: list[tuple[int, int] | int] = []
    for piece in pieces:
        if isinstance(piece, int):
            spans.append(piece)
            continue
        sample_id, start, stop = piece
        offset = jagged.starts[sample_id]
        last = spans[-1] if spans else None
        if isinstance(last, tuple) and last[1] == offset + start:
            spans[-1] = (last[0], offset + stop)
        else:
            spans.append((offset + start, offset + stop))
    if len(spans) == 1 and isinstance(spans[0], tuple):
        return values[spans[0][0] : spans[0][1]].clone()
    trailing = values.shape[1:]
    return torch.cat(
        [values.new_full((span, *trailing), pad_value) if isinstance(span, int) else values[span[0] : span[1]] for span in spans]
    )


def _cumulative_per_unit(values_per_unit: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    """int32 `[0, v0, v0+v1, ...]` of every unit, from one tensor."""
    flat = [total for values in values_per_unit for total in itertools.accumulate(values, initial=0)]
    return torch.tensor(flat, dtype=torch.int32).split([len(values) + 1 for values in values_per_unit])
