"""The planning pipeline: request -> validation -> scheduler -> plan + invariants -> statistics.

Both the server's worker processes and the trainer's in-process fallback call `plan_batch`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Sequence

from batch_planner.auto import Candidate, Outcome, best_cost, candidates, deferred, plan_candidate, serve, skip_if_beaten
from batch_planner.cost import plan_statistics
from batch_planner.cost_derivation import resolve_cost_model
from batch_planner.cost_spec import CostModel
from batch_planner.padding import PlanPadding
from batch_planner.plan import MicroBatch, Plan, check_plan_invariants, groups_from_rank_assignment
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.errors import PlanningError
from batch_planner.schedulers import (
    SCHEDULER_SPECS,
    megatron_core_version,
    require_scheduler,
    run_scheduler,
    valid_cp_sizes,
)
from batch_planner.validation import RequestLimits, validate_request

# Bumped when the mapping from scheduler output to a plan changes, so plan ids change with it.
PLAN_FORMAT_VERSION = 2


def canonical_request(request: PlanRequest) -> dict[str, Any]:
    """Every field that shapes the plan, as plain values: the batch (its lengths), the DP size and
    the planning options; not the job name, which is only a metric label. The plan id and the
    ranks' agreement digest (trainer_client/broadcast.py) both hash this."""
    return {"lengths": list(request.sequence_lengths), "dp": request.data_parallel_size, **request.options.canonical()}


def plan_id_for(request: PlanRequest) -> str:
    """Deterministic id of the plan for `request`: same request and scheduler, same id.

    Covers the canonical request, the scheduler class and the Megatron-Core version.
    """
    canonical = {
        "format": PLAN_FORMAT_VERSION,
        "scheduler_class": SCHEDULER_SPECS[request.scheduler].qualified_name,
        "megatron_core": megatron_core_version(),
        **canonical_request(request),
    }
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()[:32]


RunCandidates = Callable[[Sequence[Candidate], Callable[[PlanRequest], Plan]], list[Outcome]]


def plan_serially(found: Sequence[Candidate], plan_one: Callable[[PlanRequest], Plan]) -> list[Outcome]:
    return [plan_candidate(candidate, plan_one) for candidate in found]


def plan_batch(
    request: PlanRequest,
    limits: RequestLimits | None = None,
    cost_model: CostModel | None = None,
    run_candidates: RunCandidates = plan_serially,
) -> Plan:
    """Plans one global batch with Megatron-Core, or raises a PlanningError saying why not.

    `cost_model`: the default when the request names none. `run_candidates`: how auto's candidates
    are planned (in this process one after another; the server hands them to its workers).
    """
    limits = limits or RequestLimits()
    validate_request(request, limits)
    model = resolve_cost_model(request.cost_model, cost_model or CostModel(), request.tensor_parallel_size)
    if request.scheduler is SchedulerKind.AUTO:
        return serve(request, plan_candidates(candidates(request), limits, model, run_candidates), model, megatron_core_version())
    return plan_one_scheduler(request, limits, model)


def plan_candidates(found: Sequence[Candidate], limits: RequestLimits, model: CostModel, run_candidates: RunCandidates) -> list[Outcome]:
    """auto's candidates in two rounds: first every one but the deferred (batch_planner/auto.py),
    then those of the deferred that the first round's best cost does not skip."""
    plan_one = partial(plan_one_scheduler, limits=limits, cost_model=model)
    later = set(deferred(found))
    first = [k for k in range(len(found)) if k not in later]
    outcomes: dict[int, Outcome] = dict(zip(first, run_candidates([found[k] for k in first], plan_one)))
    best = best_cost(o.cost for o in outcomes.values())
    to_plan = []
    for k in sorted(later):
        skipped = skipped_outcome(found[k], limits, model, best)
        if skipped is not None:
            outcomes[k] = skipped
        else:
            to_plan.append(k)
    outcomes.update(zip(to_plan, run_candidates([found[k] for k in to_plan], plan_one)))
    return [outcomes[k] for k in range(len(found))]


def skipped_outcome(candidate: Candidate, limits: RequestLimits, model: CostModel, best: float | None) -> Outcome | None:
    """The candidate as skipped when its lower bound beats `best` (batch_planner.auto.skip_if_beaten)
    and it would plan; None when it must be planned. One that would be refused (validation, a
    scheduler this build lacks) is planned, so that its refusal, not a skip, is what auto lists."""
    skipped = skip_if_beaten(candidate, model, best)
    return skipped if skipped is not None and _would_plan(candidate.request, limits) else None


def _would_plan(request: PlanRequest, limits: RequestLimits) -> bool:
    try:
        validate_request(request, limits)
        require_scheduler(request.scheduler)
    except PlanningError:
        return False
    return True


def plan_one_scheduler(request: PlanRequest, limits: RequestLimits, cost_model: CostModel) -> Plan:
    """One Megatron-Core scheduler's plan: validation, the scheduler, invariants, statistics."""
    validate_request(request, limits)
    spec = SCHEDULER_SPECS[request.scheduler]
    assignment = run_scheduler(request)
    padding = PlanPadding.for_request(request)  # each CP size's padding multiple, once per plan
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
    stats = plan_statistics(micro_batches, request, spec.capacity_bound, cost_model)
    return replace(plan, statistics=stats)
