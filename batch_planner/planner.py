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
from batch_planner.cp_groups import static_cp_sizes
from batch_planner.domain import per_batch
from batch_planner.errors import BatchNotPlannableError, InvariantViolationError, PlanningError
from batch_planner.identity import plan_id
from batch_planner.padding import PlanPadding
from batch_planner.plan import Plan, check_plan_invariants, micro_batches_from_assignment
from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
from batch_planner.schedulers import SCHEDULER_SPECS, megatron_core_version, run_scheduler, valid_cp_sizes
from batch_planner.substitute import SUBSTITUTE_SCHEDULER, SubstituteReason, Substitution, UpstreamPlanInvalid
from batch_planner.validation import RequestLimits, validate_request

# Invariants whose violation by upstream's plan, on a layout planned batch by batch, is a CP group
# layout parallel_state does not build (docs/design.md, Plan invariants): the substitute is served.
# Any other violation (a sample lost or over capacity) is our bug, answered INTERNAL.
GROUP_INVARIANTS = frozenset({"2", "3"})


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
    try:
        return _plan_validated(request, model, implementation)
    except UpstreamPlanInvalid as failure:
        return _plan_substitute(request, limits, model, failure, implementation)


def plan_one_scheduler(
    request: PlanRequest, limits: RequestLimits, cost_model: CostModel, implementation: SchedulerImplementation | None = None
) -> Plan:
    """One Megatron-Core scheduler's plan: validation, the scheduler, invariants, statistics (what
    each of auto's candidates runs). No substitute: a candidate whose plan is not valid for the
    batch is listed as not planned (UpstreamPlanInvalid), and auto serves another."""
    validate_request(request, limits)
    return _plan_validated(request, cost_model, implementation)


def _plan_substitute(
    request: PlanRequest, limits: RequestLimits, cost_model: CostModel, failure: UpstreamPlanInvalid,
    implementation: SchedulerImplementation | None,
) -> Plan:
    """The substitute for a batch whose plan by `request.scheduler` is not valid: Megatron-Core's
    static-packing plan of the same batch, on the job's CP size or, when the longest sample needs
    more, the smallest static CP size that holds it (`substitute_cp_size`), named in the plan, with
    its own id (the request, the substitute's class and the scheduler it stands in for). When
    static packing cannot plan the batch either, OUT_OF_RANGE names both failures."""
    substitution = Substitution(request.scheduler, failure.reason, failure.detail)
    cp = substitute_cp_size(request)
    concrete = request.replace(
        scheduler=SUBSTITUTE_SCHEDULER, context_parallel_size=cp, data_parallel_size=request.dp_cp_size // cp,
        min_cp_size=None, max_seqs_per_micro_batch=None, auto_schedulers=(),
    )
    try:
        validate_request(concrete, limits)
        plan = _plan_validated(concrete, cost_model, implementation)
    except PlanningError as refused:
        raise BatchNotPlannableError(
            f"scheduler: {request.scheduler.value}'s plan of this batch is not valid ({failure.reason.value}: {failure.detail}), "
            f"and its substitute, {SUBSTITUTE_SCHEDULER.value}, cannot plan it either ({refused}); send a batch "
            "static packing can hold at the job's CP size, or a power-of-two DPxCP",
            field="scheduler",
        ) from refused
    spec = SCHEDULER_SPECS[SUBSTITUTE_SCHEDULER]
    identity = plan_id(request, megatron_core_version(), scheduler_class=spec.qualified_name, substitute_for=request.scheduler.value)
    return replace(plan, plan_id=identity, substitution=substitution)


def substitute_cp_size(request: PlanRequest) -> int:
    """The CP size of the substitute: the smallest static CP size (cp_groups.static_cp_sizes: a
    group size parallel_state builds that tiles the ranks) from the job's CP size up on which static
    packing can plan the batch: its capacity, max_seqlen_per_dp_cp_rank x CP, holds the longest
    sample, and there are at least DP x micro_batch_group_size samples (validation.py's rules for
    static_packing). That is the job's own CP size whenever parallel_state builds it and the batch
    fits. When none can, the smallest size from the job's up (static packing then refuses the
    batch, by name)."""
    job_cp, dp_cp = request.context_parallel_size, request.dp_cp_size
    longest, samples = max(request.sequence_lengths), len(request.sequence_lengths)
    sizes = [cp for cp in static_cp_sizes(dp_cp) if cp >= job_cp]  # never empty: the whole group is one
    fitting = [
        cp for cp in sizes
        if longest <= request.max_seqlen_per_dp_cp_rank * cp and samples >= dp_cp // cp * (request.micro_batch_group_size or 1)
    ]
    return (fitting or sizes)[0]


def _plan_validated(request: PlanRequest, cost_model: CostModel, implementation: SchedulerImplementation | None) -> Plan:
    spec = SCHEDULER_SPECS[request.scheduler]
    assignment = run_scheduler(request, implementation)
    packed = spec.capacity_bound is CapacityBound.PER_RANK_SUM
    micro_batches, columns = micro_batches_from_assignment(assignment, PlanPadding.for_request(request, packed))
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
        padding=request.padding,
        min_local_rows=request.min_local_rows,
        precision=request.precision,
        sequence_parallel=request.sequence_parallel,
    )
    try:
        check_plan_invariants(
            plan,
            request,
            valid_cp_sizes(request.scheduler, request.dp_cp_size, request.context_parallel_size, request.min_cp_size),
            columns,
        )
    except InvariantViolationError as broken:
        if broken.invariant in GROUP_INVARIANTS and per_batch(request.scheduler, request.dp_cp_size):
            raise UpstreamPlanInvalid(
                SubstituteReason.UNBUILDABLE_CP_GROUP,
                f"Megatron-Core {spec.class_name} ({megatron_core_version()}) placed a CP group parallel_state does not "
                f"build on DPxCP {request.dp_cp_size}: {broken}",
            ) from broken
        raise
    stats = plan_statistics(micro_batches, request, spec.capacity_bound, cost_model, columns)
    return replace(plan, statistics=stats)
