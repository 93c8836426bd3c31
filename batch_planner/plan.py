"""Plan and CP-group types, and the plan invariants checked before a plan leaves the planner."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from batch_planner.errors import InvariantViolationError
from batch_planner.padding import PlanPadding
from batch_planner.request import CapacityBound, CpLayout, PlanRequest, SchedulerKind


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
    micro_batches: tuple[MicroBatch, ...]
    statistics: PlanStatistics | None = field(default=None, compare=False)
    # SCHEDULER_AUTO: every candidate, in the order they were planned; empty otherwise.
    candidates: tuple[CandidateSummary, ...] = ()

    def sample_cp_sizes(self) -> dict[int, int]:
        """Sample id -> the local CP size it runs with."""
        return {
            sample_id: group.size
            for micro_batch in self.micro_batches
            for group in micro_batch.cp_groups
            for sample_id in group.sample_ids
        }


def groups_from_rank_assignment(rank_sample_ids: list[list[int]], padding: PlanPadding) -> tuple[CpGroup, ...]:
    """Turns one micro-batch of `sample_id_groups[mb][rank] -> ids` into CP groups.

    Ranks that hold an identical id list form one CP group (docs/design.md, Output of the schedulers).
    Only adjacent equal lists are merged; a non-contiguous group shows up as two groups with the
    same samples, which the invariant check then reports.
    """
    lengths = padding.sequence_lengths
    count, ranks = len(lengths), len(rank_sample_ids)
    groups: list[CpGroup] = []
    rank = 0
    while rank < ranks:
        first = rank_sample_ids[rank]
        end = rank + 1
        while end < ranks and rank_sample_ids[end] == first:
            end += 1
        size = end - rank
        ids = tuple(map(int, first))
        # Ids outside the request count for nothing here; the invariant check reports them.
        known = ids if not ids or (min(ids) >= 0 and max(ids) < count) else tuple(i for i in ids if 0 <= i < count)
        real = sum(map(lengths.__getitem__, known))
        groups.append(CpGroup(rank, size, ids, real, padding.padded_tokens(known, size)))
        rank = end
    return tuple(groups)


def check_plan_invariants(plan: Plan, request: PlanRequest, valid_cp_sizes: frozenset[int]) -> None:
    """Raises InvariantViolationError naming the first invariant (docs/design.md, Plan invariants, 1-4) the plan breaks."""
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
