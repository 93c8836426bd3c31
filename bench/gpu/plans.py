"""The plans the benchmark compares, as the trainer client hands them out, plus their predictions.

- `hybrid_cp`: the planner's plan (`plan_batch`, Megatron-Core's BalancedCPScheduler). Hybrid CP
  runs every sample of a CP group as its own forward/backward pass and puts a barrier at the end
  of each micro-batch (megatron.core.pipeline_parallel.hybrid_cp_schedule).
- `static_cp{N}`: every sample split over a fixed CP group of N ranks, packed in the original
  order up to max_seqlen_per_dp_cp_rank * N tokens per pack, pack k on DP replica k % DP; one
  pass per pack, no barrier between micro-batches (Megatron's ordinary schedule). This is the
  packing `batch_planner.cost.static_cp_step_cost` prices, so prediction and execution agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from batch_planner.cost import pack_in_order, step_cost
from batch_planner.cost_spec import CostModel
from batch_planner.plan import CpGroup, MicroBatch
from batch_planner.padding import padded_length
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind


@dataclass(frozen=True)
class BenchPlan:
    name: str
    lengths: tuple[int, ...]
    dp_cp_size: int
    micro_batches: tuple[MicroBatch, ...]
    pass_per_sample: bool  # hybrid CP: each sample of a group is its own forward pass
    barrier_between_micro_batches: bool
    max_seqlen_per_dp_cp_rank: int

    def rank_schedule(self, rank: int) -> list[CpGroup | None]:
        """This rank's CP group in every micro-batch, in plan order (None: idle in that one).

        Planner plans never leave a rank idle (docs/design.md, Plan invariants, 2); a static plan whose pack count is
        not a multiple of DP leaves the last micro-batch short.
        """
        return [_group_of_rank_or_none(mb, rank) for mb in self.micro_batches]

    def request(self) -> PlanRequest:
        # The request whose cost `predicted_seconds` prices; DP x CP as the plan runs.
        return PlanRequest.of(self.lengths, self.dp_cp_size, 1, self.max_seqlen_per_dp_cp_rank)

    def predicted_seconds(self, model: CostModel) -> float:
        return step_cost(self.micro_batches, self.request(), model, packed=not self.pass_per_sample)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)


def hybrid_cp_plan(lengths: Sequence[int], dp_cp_size: int, max_seqlen_per_dp_cp_rank: int) -> BenchPlan:
    """The planner's plan, from the same `plan_batch` the service and the client fallback run."""
    from batch_planner.planner import plan_batch

    request = PlanRequest.of(
        tuple(lengths), 1, dp_cp_size, max_seqlen_per_dp_cp_rank, SchedulerKind.HYBRID_CP
    )
    plan = plan_batch(request)
    return BenchPlan(
        "hybrid_cp", tuple(lengths), dp_cp_size, tuple(plan.micro_batches), True, True, max_seqlen_per_dp_cp_rank
    )


def static_cp_plan(
    lengths: Sequence[int], dp_cp_size: int, cp_size: int, max_seqlen_per_dp_cp_rank: int
) -> BenchPlan:
    if dp_cp_size % cp_size:
        raise ValueError(f"cp_size {cp_size} does not divide dp_cp_size {dp_cp_size}")
    dp = dp_cp_size // cp_size
    packs = pack_in_order(lengths, max_seqlen_per_dp_cp_rank * cp_size)
    micro_batches = []
    for start in range(0, len(packs), dp):
        groups = []
        for replica, pack in enumerate(packs[start : start + dp]):
            groups.append(_group(replica * cp_size, cp_size, pack, lengths))
        micro_batches.append(MicroBatch(tuple(groups)))
    return BenchPlan(
        f"static_cp{cp_size}", tuple(lengths), dp_cp_size, tuple(micro_batches), False, False,
        max_seqlen_per_dp_cp_rank,
    )


def _group(first_rank: int, size: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> CpGroup:
    return CpGroup(
        first_rank,
        size,
        tuple(sample_ids),
        sum(lengths[i] for i in sample_ids),
        sum(padded_length(lengths[i], size, 1, CpLayout.ZIGZAG) for i in sample_ids),
    )


def _group_of_rank_or_none(micro_batch: MicroBatch, rank: int) -> CpGroup | None:
    for group in micro_batch.cp_groups:
        if rank in group.ranks:
            return group
    return None


def plan_to_json(plan: BenchPlan) -> dict:
    return asdict(plan)


def plan_from_json(data: dict) -> BenchPlan:
    micro_batches = tuple(
        MicroBatch(tuple(CpGroup(g["first_rank"], g["size"], tuple(g["sample_ids"]), g["real_tokens"], g["padded_tokens"])
                         for g in mb["cp_groups"]))
        for mb in data["micro_batches"]
    )
    return BenchPlan(
        data["name"], tuple(data["lengths"]), data["dp_cp_size"], micro_batches, data["pass_per_sample"],
        data["barrier_between_micro_batches"], data["max_seqlen_per_dp_cp_rank"],
    )


def save_plans(path: str, batches: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(batches, f)


def load_plans(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    for batch in data:
        batch["plans"] = [plan_from_json(p) for p in batch["plans"]]
    return data

