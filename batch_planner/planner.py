"""The planning pipeline: request -> validation -> scheduler -> plan + invariants -> statistics.

Both the server's worker processes and the trainer's in-process fallback call `plan_batch`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from batch_planner.auto import RunCandidates, plan_auto, plan_serially
from batch_planner.cost import plan_statistics
from batch_planner.cost_derivation import resolve_cost_model
from batch_planner.cost_spec import CostModel
from batch_planner.exact.verified import SchedulerImplementation
from batch_planner.identity import plan_id
from batch_planner.padding import PlanPadding
from batch_planner.plan import Plan, check_plan_invariants, micro_batches_from_assignment
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import SCHEDULER_SPECS, megatron_core_version, run_scheduler, valid_cp_sizes
from batch_planner.validation import RequestLimits, validate_request


def plan_batch(
    request: PlanRequest,
    limits: RequestLimits | None = None,
    cost_model: CostModel | None = None,
    run_candidates: RunCandidates = plan_serially,
    implementation: SchedulerImplementation | None = None,
) -> Plan:
    """Plans one global batch with Megatron-Core, or raises a PlanningError saying why not.

    `cost_model`: the default when the request names none. `run_candidates`: who plans auto's
    candidates (batch_planner/auto.py): this process one after another, or the server's workers.
    Whatever `run_candidates` raises besides a candidate's PlanningError (its caller went away,
    its workers died) passes through. `implementation`: exact path or upstream's own code for this
    call (None: this process's setting, batch_planner/exact/verified.py).
    """
    limits = limits or RequestLimits()
    validate_request(request, limits)
    model = resolve_cost_model(request.cost_model, cost_model or CostModel(), request.tensor_parallel_size)
    if request.scheduler is SchedulerKind.AUTO:
        plan_one = partial(plan_one_scheduler, limits=limits, cost_model=model, implementation=implementation)
        return plan_auto(request, limits, model, plan_one, run_candidates, megatron_core_version())
    return _plan_validated(request, model, implementation)


def plan_one_scheduler(
    request: PlanRequest, limits: RequestLimits, cost_model: CostModel, implementation: SchedulerImplementation | None = None
) -> Plan:
    """One Megatron-Core scheduler's plan: validation, the scheduler, invariants, statistics (what
    each of auto's candidates runs)."""
    validate_request(request, limits)
    return _plan_validated(request, cost_model, implementation)


def _plan_validated(request: PlanRequest, cost_model: CostModel, implementation: SchedulerImplementation | None) -> Plan:
    spec = SCHEDULER_SPECS[request.scheduler]
    assignment = run_scheduler(request, implementation)
    micro_batches, columns = micro_batches_from_assignment(assignment, PlanPadding.for_request(request))
    plan = Plan(
        plan_id=plan_id(request, megatron_core_version(), scheduler_class=spec.qualified_name),
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
        columns,
    )
    stats = plan_statistics(micro_batches, request, spec.capacity_bound, cost_model, columns)
    return replace(plan, statistics=stats)
