"""Apply a plan: from the global batch every rank of the DPxCP group holds, this rank's execution
units in plan order (docs/trainer-client.md, "The input contract"). A unit's samples are padded (along
the sequence dimension only) and sharded as batch_planner/shards.py says.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from batch_planner.padding import group_padded_lengths, row_multiple_of
from batch_planner.plan import CpGroup, Plan
from batch_planner.request import CapacityBound, CpLayout
from batch_planner.shards import padded_unit_shard
from trainer_client.plans.batch import BatchMismatchError, GlobalBatch, JaggedField, unbind_batch
from trainer_client.errors import InvalidArgumentError, UnrunnablePlanError
from trainer_client.plans.megatron import CpGroupResolver, packed_seq_params
from trainer_client.plans.micro_batch import RankMicroBatch


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
    with_packed_seq_params: bool = True,
) -> list[RankMicroBatch]:
    """This DPxCP rank's execution units, in plan order.

    `cp_group_for(size)` returns the process group of this rank for a CP size, 1 included (see
    `trainer_client.plans.megatron.megatron_cp_group_resolver`; None where the build has none for that
    size); without it `cp_group` is None and only `cp_group_ranks` say who the partners are.
    `pack_group_samples` defaults to how the plan's scheduler executes. `with_packed_seq_params`:
    each unit carries Megatron-Core's PackedSeqParams (False: None, and Megatron-Core is not imported;
    the unit's cu_seqlens say the same).
    """
    if not isinstance(batch, GlobalBatch):
        batch = unbind_batch(batch)
    num_samples = len(batch.lengths)
    planned = sum(len(g.sample_ids) for mb in plan.micro_batches for g in mb.cp_groups)
    if planned != num_samples:
        raise BatchMismatchError(f"the plan covers {planned} samples but the batch holds {num_samples}")
    if not 0 <= rank < plan.dp_cp_size:
        raise InvalidArgumentError(f"rank {rank} is outside the plan's DPxCP group of {plan.dp_cp_size} ranks")
    if pack_group_samples is None:
        pack_group_samples = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    units: list[_Unit] = []
    for index, micro_batch in enumerate(plan.micro_batches):
        group = micro_batch.group_of_rank(rank)
        process_group = cp_group_for(group.size) if cp_group_for else None
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
            with_packed_seq_params,
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
    group: CpGroup | None
    cp_size: int
    cp_rank: int
    process_group: Any
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]
    layout: CpLayout
    shard_counts: list[int] = field(default_factory=list)  # rows of each sample in this shard
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
        lengths = tuple(batch.lengths[i] for i in sample_ids)
        multiple = row_multiple_of(plan)
        padded = tuple(group_padded_lengths(lengths, group.size, plan.tensor_parallel_size, plan.cp_layout, plan.padding, plan.min_local_rows,
                                            multiple))
        _check_rows(plan, index, group, sample_ids, padded, multiple)
        layout = plan.cp_layout
        return cls(index, last, group, group.size, rank - group.first_rank, process_group, sample_ids, lengths, padded, layout).sharded()

    def sharded(self) -> "_Unit":
        """This unit with the rows of its rank's shard laid out (batch_planner/shards.py)."""
        self.shard_counts = [0] * len(self.sample_ids)
        for r in padded_unit_shard(self.padded, self.cp_size, self.cp_rank, self.layout):
            self._add_range(r.index, self.sample_ids[r.index], self.lengths[r.index], r.start, r.stop)
        return self

    def _add_range(self, index: int, sample_id: int, length: int, start: int, stop: int) -> None:
        self.shard_counts[index] += stop - start
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
        with_packed_seq_params: bool = True,
    ) -> RankMicroBatch:
        max_seqlen = max(self.padded)
        params = (packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, self.cp_size, self.process_group, self.layout)
                  if with_packed_seq_params else None)
        return RankMicroBatch(
            micro_batch_index=self.index,
            last_of_micro_batch=self.last,
            sample_ids=self.sample_ids,
            local_cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            cp_group_ranks=tuple(self.group.ranks) if self.group is not None else (),
            is_cp_leader=self.cp_rank == 0,
            cp_group=self.process_group,
            token_fields={
                name: _gather_rows(jagged, self.pieces, pad_token_id if name == "input_ids" else 0)
                for name, jagged in batch.token_fields.items()
            },
            position_ids=_arange_ranges(self.positions),
            padding_mask=self.real_rows(self.tokens),
            sample_fields=sample_fields,
            sequence_lengths=self.lengths,
            cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_seqlens_padded,
            max_seqlen=max_seqlen,
            shard_token_counts=tuple(self.shard_counts),
            real_local_tokens=self.real_tokens,
            global_real_tokens=global_real_tokens,
            packed_seq_params=params,
            global_batch=batch,
        )

    def real_rows(self, rows: int) -> torch.Tensor:
        """Bool mask over `rows` rows of this rank's shard (at least the shard's own): True where a
        row holds a real token, False where it is padding (rows past the shard's are padding)."""
        mask = torch.ones(rows, dtype=torch.bool)
        if rows > self.tokens:
            mask[self.tokens :] = False
        for start, stop in self.padding_runs:
            mask[start:stop] = False
        return mask


def _check_rows(plan: Plan, index: int, group: CpGroup, sample_ids: tuple[int, ...], padded: tuple[int, ...], multiple: int) -> None:
    """A bug guard at the boundary: every rank's rows of a pass must be what the plan's precision takes
    (`row_multiple_of`; Transformer Engine's FP8 GEMMs refuse others deep inside the step)."""
    total = sum(padded)
    if total % group.size == 0 and (total // group.size) % multiple == 0:
        return
    rows = total / group.size if total % group.size else total // group.size
    raise UnrunnablePlanError(
        "rows", rows,
        f"micro-batch {index}'s pass of samples {list(sample_ids)} on CP group {list(group.ranks)} gives each rank {rows} rows "
        f"({total} padded tokens over {group.size} ranks), not a multiple of {multiple}, which precision {plan.precision.value} "
        f"needs at tensor_parallel_size={plan.tensor_parallel_size}, sequence_parallel={plan.sequence_parallel} "
        "(batch_planner/precision.py); the padding is wrong: please report it",
    )


def shard_padding_mask(lengths: Sequence[int], padded: Sequence[int], cp_size: int, cp_rank: int, layout: CpLayout) -> torch.Tensor:
    """The padding rule of an execution unit, for a drop-in that builds its own micro-batches
    (verl): rank `cp_rank`'s shard of sequences of real `lengths` padded to `padded` rows (each a
    multiple of `cp_size`), as `sum(padded) // cp_size` rows; True where a row is padding."""
    unit = _Unit(0, True, None, cp_size, cp_rank, None, tuple(range(len(lengths))), tuple(lengths), tuple(padded), layout)
    return ~unit.sharded().real_rows(sum(padded) // cp_size)


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
