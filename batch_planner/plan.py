"""Plan and CP-group types, and the plan invariants checked before a plan leaves the planner."""

from __future__ import annotations

from collections import Counter
import threading
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, chain, compress, islice, pairwise
from operator import attrgetter, mod, ne, sub
from typing import Iterator, Sequence, overload

import numpy as np

from batch_planner.columns import INT64_EXACT, lengths_column, run_offsets, segment_sums
from batch_planner.errors import InvariantViolationError
from batch_planner.padding import PlanPadding
from batch_planner.precision import Precision
from batch_planner.request import CapacityBound, CpLayout, PaddingRule, PlanRequest, SchedulerKind
from batch_planner.substitute import Substitution


@dataclass(frozen=True)
class CpGroup:
    """Ranks [first_rank, first_rank + size) run `sample_ids`, each split `size` ways."""

    first_rank: int
    size: int
    sample_ids: tuple[int, ...]
    real_tokens: int
    padded_tokens: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)


def new_cp_group(first_rank: int, size: int, sample_ids: tuple[int, ...], real_tokens: int, padded_tokens: int) -> CpGroup:
    """CpGroup(first_rank, size, sample_ids, real_tokens, padded_tokens), the same object (its
    fields in its instance dict, in order), built without the frozen dataclass's __init__: that
    sets each field through object.__setattr__, and was most of the time of building a plan's
    thousands of groups. CpGroup has no __post_init__ or defaults for it to skip
    (tests/batch_planner/test_plan_columns.py holds both to this)."""
    group = _new_object(CpGroup)
    fields = group.__dict__
    fields["first_rank"] = first_rank
    fields["size"] = size
    fields["sample_ids"] = sample_ids
    fields["real_tokens"] = real_tokens
    fields["padded_tokens"] = padded_tokens
    return group


_new_object = object.__new__


@dataclass(frozen=True)
class MicroBatch:
    cp_groups: tuple[CpGroup, ...]

    def group_of_rank(self, rank: int) -> CpGroup:
        for group in self.cp_groups:
            if group.first_rank <= rank < group.first_rank + group.size:
                return group
        raise KeyError(f"rank {rank} is in no CP group of this micro-batch")


@dataclass(frozen=True)
class PlanStatistics:
    real_tokens: int
    padded_tokens: int
    padding_ratio: float
    micro_batch_count: int
    cp_size_mix: tuple[tuple[int, int, int], ...]  # (cp_size, samples, real_tokens), by cp_size
    predicted_step_cost: float
    lower_bound_cost: float
    balance_efficiency: float
    static_cp_step_cost: float
    predicted_speedup_over_static_cp: float
    # Of padded_tokens, what the precision's alignment added (batch_planner/precision.py).
    alignment_padding_tokens: int = 0


@dataclass(frozen=True)
class CandidateSummary:
    """One of auto's candidates as the response lists it (batch_planner/auto.py)."""

    name: str
    scheduler: SchedulerKind
    max_seqlen_per_dp_cp_rank: int
    min_cp_size: int | None
    context_parallel_size: int
    predicted_step_cost: float | None  # None: not planned
    served: bool = False
    not_planned_reason: str = ""
    # Skipped by auto: a proven lower bound on any plan of this candidate, above a cost already
    # planned (batch_planner/auto.py, `lower_bound`); None when the candidate was planned or failed.
    skipped_lower_bound: float | None = None


@dataclass(frozen=True)
class Plan:
    plan_id: str
    scheduler: SchedulerKind
    scheduler_class: str
    megatron_core_version: str
    dp_cp_size: int
    tensor_parallel_size: int
    cp_layout: CpLayout
    capacity_bound: CapacityBound
    micro_batches: Sequence[MicroBatch]  # a tuple, or MicroBatches: built from the groups' columns on first use
    statistics: PlanStatistics | None = field(default=None, compare=False)
    # SCHEDULER_AUTO: every candidate, in the order they were planned; empty otherwise.
    candidates: tuple[CandidateSummary, ...] = ()
    # Set when the requested scheduler's plan of this batch was not valid and the substitute was
    # served instead (batch_planner/substitute.py); `scheduler` is then the substitute's.
    substitution: Substitution | None = None
    # The padding its padded tokens count (the request's): applying the plan pads the same way.
    padding: PaddingRule = PaddingRule.MEGATRON_CORE
    min_local_rows: int | None = None
    # The precision its passes were padded for, and whether the trainer runs sequence parallelism.
    precision: Precision = Precision.BF16
    sequence_parallel: bool = True

    def sample_cp_sizes(self) -> dict[int, int]:
        """Sample id -> the local CP size it runs with."""
        return {
            sample_id: group.size
            for micro_batch in self.micro_batches
            for group in micro_batch.cp_groups
            for sample_id in group.sample_ids
        }


class MicroBatches(Sequence[MicroBatch]):
    """A plan's micro-batches held as their groups' GroupColumns, built as MicroBatch objects on
    first use.

    The core checks and prices a plan from its columns, and a response in the columns form
    (batch_planner.v1.PlanForm) is encoded from them and decoded into them, so neither the server
    nor a client that receives a plan builds an object per CP group before something reads one
    (a trainer's `apply` does, once). It reads as the tuple it builds: equal to it, hashed as it,
    indexed, sliced, iterated, added and repeated as it. Pickled, it is its columns, unbuilt.
    """

    __slots__ = ("columns", "_built", "_building")

    def __init__(self, columns: GroupColumns):
        self.columns = columns
        self._built: tuple[MicroBatch, ...] | None = None
        self._building = threading.Lock()  # readers on several threads build it once

    def as_tuple(self) -> tuple[MicroBatch, ...]:
        built = self._built
        if built is None:
            with self._building:
                built = self._built
                if built is None:
                    built = self._built = self.columns.micro_batches()
        return built

    def __len__(self) -> int:
        return len(self.columns.micro_batch_starts) - 1

    @overload
    def __getitem__(self, index: int) -> MicroBatch: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[MicroBatch, ...]: ...
    def __getitem__(self, index):
        return self.as_tuple()[index]

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.as_tuple())

    def __add__(self, other: Sequence[MicroBatch]) -> tuple[MicroBatch, ...]:
        return self.as_tuple() + tuple(other)

    def __radd__(self, other: Sequence[MicroBatch]) -> tuple[MicroBatch, ...]:
        return tuple(other) + self.as_tuple()

    def __mul__(self, times: int) -> tuple[MicroBatch, ...]:
        return self.as_tuple() * times

    __rmul__ = __mul__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MicroBatches):
            other = other.as_tuple()
        return self.as_tuple() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return repr(self.as_tuple())

    def __reduce__(self):
        return MicroBatches, (self.columns,)


def micro_batches_from_assignment(assignment: Sequence[Sequence[Sequence[int]]], padding: PlanPadding) -> tuple[MicroBatches, GroupColumns]:
    """The plan's micro-batches from the scheduler's `sample_id_groups[mb][rank] -> ids`, and
    their groups' columns (GroupColumns.from_assignment says how ranks become groups)."""
    columns = GroupColumns.from_assignment(assignment, padding)
    return MicroBatches(columns), columns


def groups_from_rank_assignment(rank_sample_ids: Sequence[Sequence[int]], padding: PlanPadding) -> tuple[CpGroup, ...]:
    """One micro-batch's `rank -> ids` as CP groups, as `micro_batches_from_assignment` makes them."""
    return micro_batches_from_assignment([rank_sample_ids], padding)[0][0].cp_groups


@dataclass(frozen=True, eq=False)
class GroupColumns:
    """A plan's CP groups as columns, micro-batch after micro-batch: what the groups are built
    from, and what the invariant check and the statistics read."""

    micro_batch_starts: list[int]  # each micro-batch's first group, then the number of groups
    first_ranks: list[int]
    sizes: list[int]
    group_sample_ids: list[tuple[int, ...]]
    real_tokens: list[int]
    padded_tokens: list[int]
    sample_ids: list[int]  # every group's, one after another
    # `sample_ids` as int64 when every one is an int id of the request (0..num_samples - 1), else None.
    sample_id_column: np.ndarray | None
    sample_offsets: np.ndarray  # where each group's ids start in `sample_ids`, then their number
    int_ranks: bool  # every first rank and size is an int

    @classmethod
    def of(cls, micro_batches: Sequence[MicroBatch], num_samples: int) -> GroupColumns:
        """The columns of a plan's micro-batches, read from their groups."""
        per_micro_batch = [micro_batch.cp_groups for micro_batch in micro_batches]
        groups = list(chain.from_iterable(per_micro_batch))
        ids = list(map(attrgetter("sample_ids"), groups))
        flat = list(chain.from_iterable(ids))
        return cls(
            micro_batch_starts=list(accumulate(map(len, per_micro_batch), initial=0)),
            first_ranks=list(map(attrgetter("first_rank"), groups)),
            sizes=list(map(attrgetter("size"), groups)),
            group_sample_ids=ids,
            real_tokens=list(map(attrgetter("real_tokens"), groups)),
            padded_tokens=list(map(attrgetter("padded_tokens"), groups)),
            sample_ids=flat,
            sample_id_column=_checked_id_column(flat, num_samples),
            sample_offsets=run_offsets(map(len, ids), len(ids)),
            int_ranks=set(map(type, chain(map(attrgetter("first_rank"), groups), map(attrgetter("size"), groups)))) <= {int},
        )

    @classmethod
    def from_columns(
        cls, micro_batch_starts: list[int], first_ranks: list[int], sizes: list[int], sample_counts: list[int], sample_ids: list[int],
        real_tokens: list[int], padded_tokens: list[int],
    ) -> GroupColumns:
        """Groups given as columns of equal length (group g's ids: the next sample_counts[g] of
        `sample_ids`), as a response in the columns form carries them (batch_planner/convert.py
        checks their shape). Without a request to check the ids against, `sample_id_column` is
        None: an invariant check of such a plan walks it group by group."""
        offsets = list(accumulate(sample_counts, initial=0))
        ids = [tuple(sample_ids[start:end]) for start, end in pairwise(offsets)]
        return cls(
            micro_batch_starts, first_ranks, sizes, ids, real_tokens, padded_tokens, sample_ids, None, np.asarray(offsets, dtype=np.int64),
            int_ranks=True,
        )

    @classmethod
    def from_assignment(cls, assignment: Sequence[Sequence[Sequence[int]]], padding: PlanPadding) -> GroupColumns:
        """The groups of the scheduler's `sample_id_groups[mb][rank] -> ids`.

        Ranks that hold an identical id list form one CP group (docs/design.md, Output of the
        schedulers). Only adjacent equal lists are merged; a non-contiguous group shows up as two
        groups with the same samples, which the invariant check then reports. Ids are made ints
        (a scheduler's numpy integers); ids outside the request count for no tokens here, and the
        invariant check reports them.
        """
        first_ranks: list[int] = []
        sizes: list[int] = []
        firsts: list[Sequence[int]] = []
        micro_batch_starts = [0]
        for rank_ids in assignment:
            starts = _run_starts(rank_ids)
            first_ranks += starts
            sizes += map(sub, [*starts[1:], len(rank_ids)], starts)
            firsts += map(rank_ids.__getitem__, starts)
            micro_batch_starts.append(len(first_ranks))
        flat = list(chain.from_iterable(firsts))
        if set(map(type, flat)) <= {int}:
            ids = list(map(tuple, firsts))
        else:
            ids = [tuple(map(int, group)) for group in firsts]
            flat = list(chain.from_iterable(ids))
        column = _id_column(flat, len(padding.sequence_lengths))
        offsets = run_offsets(map(len, ids), len(ids))
        if column is None:
            known = [tuple(i for i in group if 0 <= i < len(padding.sequence_lengths)) for group in ids]
            real, padded = padding.group_tokens(np.asarray(list(chain.from_iterable(known)), dtype=np.int64), run_offsets(map(len, known), len(known)), sizes)
        else:
            real, padded = padding.group_tokens(column, offsets, sizes)
        return cls(micro_batch_starts, first_ranks, sizes, ids, real, padded, flat, column, offsets, int_ranks=True)

    @cached_property
    def sample_counts(self) -> list[int]:
        return list(map(len, self.group_sample_ids))

    @cached_property
    def size_column(self) -> np.ndarray:
        return np.asarray(self.sizes, dtype=np.int64)

    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """The plan's micro-batches of CpGroups, built from the columns."""
        groups = iter(map(new_cp_group, self.first_ranks, self.sizes, self.group_sample_ids, self.real_tokens, self.padded_tokens))
        return tuple(MicroBatch(tuple(islice(groups, end - start))) for start, end in pairwise(self.micro_batch_starts))


def _run_starts(rank_sample_ids: Sequence[Sequence[int]]) -> list[int]:
    """The ranks where a run of ranks holding an identical id list starts."""
    if not rank_sample_ids:
        return []
    changed = map(ne, islice(rank_sample_ids, 1, None), rank_sample_ids)
    return [0, *compress(range(1, len(rank_sample_ids)), changed)]


def _checked_id_column(ids: list, num_samples: int) -> np.ndarray | None:
    """`_id_column` of ids of any type: None unless every one is an int (numpy would truncate a float)."""
    return _id_column(ids, num_samples) if set(map(type, ids)) <= {int} else None


def _id_column(ids: list[int], num_samples: int) -> np.ndarray | None:
    """`ids` (ints) as an int64 column when every one is 0..num_samples - 1, else None."""
    try:
        column = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id past int64
        return None
    if len(column) and (column.min() < 0 or column.max() >= num_samples):
        return None
    return column


def check_plan_invariants(plan: Plan, request: PlanRequest, valid_cp_sizes: frozenset[int], columns: GroupColumns | None = None) -> None:
    """Raises InvariantViolationError naming the first invariant (docs/design.md, Plan invariants, 1-4) the plan breaks.

    Every invariant is checked over the plan's columns at once (`columns`: those of the plan's
    micro-batches, GroupColumns.of them or the ones they were built from, when the caller has
    them); only a plan that may break one is walked group by group, to name the first
    (`_raise_first_violation`).
    """
    if not _invariants_hold(plan, request, valid_cp_sizes, columns or GroupColumns.of(plan.micro_batches, request.num_samples)):
        _raise_first_violation(plan, request, valid_cp_sizes)


def _invariants_hold(plan: Plan, request: PlanRequest, valid_cp_sizes: frozenset[int], columns: GroupColumns) -> bool:
    """True only if the plan keeps every invariant; False where it may not, or where the columns
    cannot tell (values other than ints, numbers too large for int64)."""
    ids = columns.sample_id_column
    return (
        ids is not None
        and columns.int_ranks
        and _groups_tile_ranks(columns, plan.dp_cp_size, valid_cp_sizes)
        and _each_sample_once(ids, request.num_samples)
        and _within_capacity(columns, ids, request, plan.capacity_bound)
    )


def _groups_tile_ranks(columns: GroupColumns, dp_cp_size: int, valid_cp_sizes: frozenset[int]) -> bool:
    """Invariants 2 and 3: each micro-batch's groups cover ranks 0..DPxCP-1 one after another,
    none idle, each of a buildable size and starting at a multiple of it."""
    sizes, first_ranks = columns.sizes, columns.first_ranks
    if 0 in columns.sample_counts or not all(map(valid_cp_sizes.__contains__, sizes)) or min(sizes, default=1) < 1:
        return False
    if any(map(mod, first_ranks, sizes)):
        return False
    for start, end in pairwise(columns.micro_batch_starts):
        covered = list(accumulate(sizes[start:end], initial=0))
        if covered[-1] != dp_cp_size or covered[:-1] != first_ranks[start:end]:
            return False
    return True


def _each_sample_once(ids: np.ndarray, num_samples: int) -> bool:
    """Invariant 1 (every id is one of the request's): the groups hold every sample exactly once."""
    if len(ids) != num_samples:
        return False
    seen = np.zeros(num_samples, dtype=bool)
    seen[ids] = True
    return bool(seen.all())


def _within_capacity(columns: GroupColumns, ids: np.ndarray, request: PlanRequest, capacity_bound: CapacityBound) -> bool:
    """Invariant 4 (every group holds samples of the request): each group's real tokens, summed
    (packed) or its longest sample's, at most max_seqlen_per_dp_cp_rank x its size."""
    if not columns.sizes:
        return True
    limit = request.max_seqlen_per_dp_cp_rank
    lengths = lengths_column(request.sequence_lengths, request.dp_cp_size, request.tensor_parallel_size)
    if lengths.dtype != np.int64 or abs(limit) * max(columns.sizes) >= INT64_EXACT:
        return False
    tokens = lengths[ids]
    if capacity_bound is CapacityBound.PER_RANK_SUM:
        real = segment_sums(tokens, columns.sample_offsets)
    else:
        real = np.maximum.reduceat(tokens, columns.sample_offsets[:-1])
    return not bool((real > columns.size_column * limit).any())


def structure_problem(plan: Plan, num_samples: int, dp_cp_size: int) -> str | None:
    """What keeps a plan received from elsewhere (a service's answer) from being applied to a batch
    of `num_samples` on `dp_cp_size` ranks without a rank failing alone or a sample lost: its
    DPxCP size, its groups tiling each micro-batch's ranks (sizes >= 1, each group at a multiple of
    its size, none empty) and every sample in exactly one group. None when it holds. Invariants 3
    and 4 (the sizes Megatron-Core builds, capacity) depend on the scheduler's own knobs, which only
    the planner that made the plan checks."""
    if plan.dp_cp_size != dp_cp_size:
        return f"the plan covers {plan.dp_cp_size} DPxCP ranks, the request {dp_cp_size}"
    micro_batches = plan.micro_batches
    columns = micro_batches.columns if isinstance(micro_batches, MicroBatches) else GroupColumns.of(micro_batches, num_samples)
    if not columns.int_ranks or not _groups_tile_ranks(columns, dp_cp_size, frozenset(range(1, dp_cp_size + 1))):
        return f"the CP groups of some micro-batch do not tile ranks 0..{dp_cp_size - 1} (each group at a multiple of its size, none empty)"
    ids = _checked_id_column(columns.sample_ids, num_samples)
    if ids is None or not _each_sample_once(ids, num_samples):
        return f"the CP groups do not hold each of the batch's {num_samples} samples exactly once"
    return None


def _raise_first_violation(plan: Plan, request: PlanRequest, valid_cp_sizes: frozenset[int]) -> None:
    """Walks the plan group by group and raises InvariantViolationError for the first invariant it breaks."""
    num_samples = request.num_samples
    limit = request.max_seqlen_per_dp_cp_rank
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    seen: Counter[int] = Counter()
    for mb_index, micro_batch in enumerate(plan.micro_batches):
        covered = 0
        for group in micro_batch.cp_groups:
            # Invariant 2: every rank in exactly one group, no idle rank.
            if group.first_rank != covered:
                raise InvariantViolationError(
                    "2", f"{_where(mb_index, group)}: expected a group starting at rank {covered}"
                )
            if not group.sample_ids:
                raise InvariantViolationError(
                    "2", f"{_where(mb_index, group)}: ranks {group.first_rank}..{group.first_rank + group.size - 1} are idle"
                )
            covered += group.size
            # Invariant 3: aligned, buildable group size.
            if group.size not in valid_cp_sizes:
                raise InvariantViolationError(
                    "3",
                    f"{_where(mb_index, group)}: size {group.size} has no Megatron-Core process group "
                    f"(buildable sizes: {sorted(valid_cp_sizes)})",
                )
            if group.first_rank % group.size != 0:
                raise InvariantViolationError(
                    "3", f"{_where(mb_index, group)}: first rank is not a multiple of the group size {group.size}"
                )
            ids = group.sample_ids
            if min(ids) < 0 or max(ids) >= num_samples:
                sample_id = next(i for i in ids if not 0 <= i < num_samples)
                raise InvariantViolationError(
                    "1", f"{_where(mb_index, group)}: sample id {sample_id} is not in the request (0..{num_samples - 1})"
                )
            seen.update(ids)
            # Invariant 4: capacity, in the reading that matches execution, on real tokens - what
            # Megatron-Core's schedulers budget and what the contract promises
            # (PlanRequest.max_seqlen_per_dp_cp_rank). THD/CP padding then adds less than one
            # padding unit per sample shard on top; the proto says so.
            real = (sum if packed else max)(map(request.sequence_lengths.__getitem__, ids))
            if real > limit * group.size:
                raise InvariantViolationError(
                    "4",
                    f"{_where(mb_index, group)}: {real / group.size:.1f} real tokens per rank "
                    f"({plan.capacity_bound.value} bound) exceed max_seqlen_per_dp_cp_rank={limit}",
                )
        if covered != plan.dp_cp_size:
            raise InvariantViolationError(
                "2", f"micro-batch {mb_index}: groups cover ranks 0..{covered - 1}, plan has {plan.dp_cp_size}"
            )
    duplicated = sorted(i for i, n in seen.items() if n > 1)
    if duplicated:
        raise InvariantViolationError("1", f"sample ids {duplicated[:10]} appear more than once")
    missing = sorted(set(range(num_samples)) - set(seen))
    if missing:
        raise InvariantViolationError("1", f"sample ids {missing[:10]} are in no CP group ({len(missing)} missing)")


def _where(mb_index: int, group: CpGroup) -> str:
    # Built only for an error message: formatting it for every group costs more than the checks.
    return f"micro-batch {mb_index}, CP group at rank {group.first_rank}"
