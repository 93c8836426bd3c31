"""The planning pipeline: request -> validation -> scheduler -> plan + invariants -> statistics.

Both the server's worker processes and the trainer's in-process fallback call `plan_batch`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from batch_planner.cost import CostModel, plan_statistics
from batch_planner.padding import PlanPadding
from batch_planner.plan import MicroBatch, Plan, check_plan_invariants, groups_from_rank_assignment
from batch_planner.request import PlanRequest
from batch_planner.schedulers import (
    SCHEDULER_SPECS,
    megatron_core_version,
    run_scheduler,
    valid_cp_sizes,
)
from batch_planner.validation import RequestLimits, validate_request

# Bumped when the mapping from scheduler output to a plan changes, so plan ids change with it.
PLAN_FORMAT_VERSION = 1


def plan_id_for(request: PlanRequest) -> str:
    """Deterministic id of the plan for `request`: same request and scheduler, same id.

    Covers every field that shapes the plan, the scheduler class and the Megatron-Core version;
    not the job name, which is only a metric label.
    """
    spec = SCHEDULER_SPECS[request.scheduler]
    canonical = {
        "format": PLAN_FORMAT_VERSION,
        "scheduler": spec.qualified_name,
        "megatron_core": megatron_core_version(),
        "lengths": list(request.sequence_lengths),
        "dp": request.data_parallel_size,
        "cp": request.context_parallel_size,
        "tp": request.tensor_parallel_size,
        "max_seqlen_per_dp_cp_rank": request.max_seqlen_per_dp_cp_rank,
        "cp_layout": request.cp_layout.value,
        "min_cp_size": request.min_cp_size,
        "max_seqs_per_micro_batch": request.max_seqs_per_micro_batch,
        "micro_batch_group_size": request.micro_batch_group_size,
    }
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()[:32]


def plan_batch(
    request: PlanRequest,
    limits: RequestLimits | None = None,
    cost_model: CostModel | None = None,
) -> Plan:
    """Plans one global batch with Megatron-Core, or raises a PlanningError saying why not."""
    validate_request(request, limits or RequestLimits())
    spec = SCHEDULER_SPECS[request.scheduler]
    assignment = run_scheduler(request)
    padding = PlanPadding.for_request(request)  # shared by the groups, the invariants and the statistics
    micro_batches = tuple(MicroBatch(groups_from_rank_assignment(rank_ids, padding)) for rank_ids in assignment)
    plan = Plan(
        plan_id=plan_id_for(request),
        scheduler=request.scheduler,
        scheduler_class=spec.class_name,
        megatron_core_version=megatron_core_version(),
        dp_cp_size=request.dp_cp_size,
        tensor_parallel_size=request.tensor_parallel_size,
        cp_layout=request.cp_layout,
        capacity_bound=spec.capacity_bound,
        micro_batches=micro_batches,
    )
    check_plan_invariants(
        plan,
        request,
        valid_cp_sizes(request.scheduler, request.dp_cp_size, request.context_parallel_size, request.min_cp_size),
    )
    stats = plan_statistics(micro_batches, request, spec.capacity_bound, cost_model or CostModel(), padding)
    return replace(plan, statistics=stats)
