"""The `auto` policy: serve the cheapest of Megatron-Core's candidate plans for a request.

No scheduling algorithm lives here. Every candidate is a plan from one of Megatron-Core's
schedulers, validated and checked like any other plan; the only decision made here is which to
serve: the one with the lowest predicted step cost under the request's cost model, ties going to
the earlier candidate. docs/design.md ("The auto policy") lists the candidates and their order
(`candidates`), what happens to one that cannot plan, and the proof that skipping a candidate
whose lower bound (`lower_bound`) is above a cost already planned serves the same plan.

All of auto lives here: the candidates, the two rounds and the skip (`plan_auto`), and the answer
(`serve`). Who plans each candidate is the caller's choice, the one seam (`RunCandidates`): this
process one after another (`plan_serially`, the trainer's fallback), or the server's workers side
by side (planner_server/worker_pool.py), which return each candidate's Outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from batch_planner.cost import static_cp_step_cost
from batch_planner.cost_spec import CostModel
from batch_planner.cp_groups import static_cp_sizes
from batch_planner.errors import BatchNotPlannableError, ErrorCode, InvalidRequestError, PlanningError, SchedulerFailedError
from batch_planner.identity import plan_id
from batch_planner.plan import CandidateSummary, Plan
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import require_scheduler
from batch_planner.validation import RequestLimits, validate_request

# Bumped when the candidate list changes: the same request may then get another winner and id.
CANDIDATES_VERSION = 1
MAX_SEQLEN_FRACTIONS = (1.0, 0.75, 0.5)
DYNAMIC_MIN_CP_SIZE = 2
# Reasons listed in an error when no candidate could plan: enough to act on, bounded in size.
MAX_REASONS_IN_ERROR = 6
# How far (relatively) a lower bound must exceed the best cost before its candidate is skipped:
# far above the rounding error of the float sums on either side, far below any real difference.
SKIP_MARGIN = 1e-9

PlanOne = Callable[[PlanRequest], Plan]


@dataclass(frozen=True)
class Candidate:
    """One variant of the request for one Megatron-Core scheduler."""

    name: str
    request: PlanRequest  # a concrete request (its scheduler is not AUTO)

    def summary(self, cost: float | None, reason: str = "", served: bool = False, skipped_lower_bound: float | None = None) -> CandidateSummary:
        r = self.request
        return CandidateSummary(
            self.name, r.scheduler, r.max_seqlen_per_dp_cp_rank, r.min_cp_size, r.context_parallel_size,
            cost, served, reason, skipped_lower_bound,
        )


@dataclass(frozen=True)
class Outcome:
    """A candidate's plan (and its predicted cost), or why it has none."""

    candidate: Candidate
    plan: Plan | None
    code: str = ""  # the ErrorCode of the failure, when there is no plan
    reason: str = ""
    skipped_lower_bound: float | None = None  # skipped: the bound that proved it cannot win
    seconds: float = 0.0  # how long planning it took, where it ran (what auto costs its planner)

    @property
    def cost(self) -> float | None:
        return self.plan.statistics.predicted_step_cost if self.plan is not None and self.plan.statistics else None

    def summary(self) -> CandidateSummary:
        return self.candidate.summary(self.cost, self.reason, skipped_lower_bound=self.skipped_lower_bound)


# Plans a round of candidates, their outcomes in order. One that has an `expect(count)` method is
# told, once before the first round, how many candidates the request has (the most it will be
# asked to plan): the server reserves the request's slots then, so no round is refused after
# another's work is done.
RunCandidates = Callable[[Sequence[Candidate], PlanOne], list[Outcome]]


def plan_candidate(candidate: Candidate, plan_one: PlanOne) -> Outcome:
    """Plans one candidate with `plan_one` (batch_planner.planner's single-scheduler path); what a
    RunCandidates runs for each candidate, in this process or a worker."""
    started = time.perf_counter()
    try:
        plan: Plan | None = plan_one(candidate.request)
        code = reason = ""
    except PlanningError as error:
        plan, code, reason = None, error.code.value, str(error)
    return Outcome(candidate, plan, code, reason, seconds=time.perf_counter() - started)


def plan_serially(found: Sequence[Candidate], plan_one: PlanOne) -> list[Outcome]:
    return [plan_candidate(candidate, plan_one) for candidate in found]


def plan_auto(
    request: PlanRequest, limits: RequestLimits, model: CostModel, plan_one: PlanOne, run_candidates: RunCandidates, megatron_core: str
) -> Plan:
    """auto's answer for a validated request: its candidates planned by `run_candidates` in two
    rounds, then the cheapest served (`serve`)."""
    return serve(request, plan_candidates(candidates(request), limits, model, plan_one, run_candidates), model, megatron_core)


def plan_candidates(
    found: Sequence[Candidate], limits: RequestLimits, model: CostModel, plan_one: PlanOne, run_candidates: RunCandidates
) -> list[Outcome]:
    """The candidates in two rounds: first every one but the deferred, then those of the deferred
    that the first round's best cost does not skip."""
    expect = getattr(run_candidates, "expect", None)
    if expect is not None:
        expect(len(found))
    later = set(deferred(found))
    first = [k for k in range(len(found)) if k not in later]
    outcomes: dict[int, Outcome] = dict(zip(first, run_candidates([found[k] for k in first], plan_one)))
    best = best_cost(o.cost for o in outcomes.values())
    to_plan = []
    for k in sorted(later):
        skipped = skip_if_beaten(found[k], limits, model, best)
        if skipped is not None:
            outcomes[k] = skipped
        else:
            to_plan.append(k)
    if to_plan:
        outcomes.update(zip(to_plan, run_candidates([found[k] for k in to_plan], plan_one)))
    return [outcomes[k] for k in range(len(found))]


def candidates(request: PlanRequest) -> list[Candidate]:
    """auto's candidates for `request`, in the documented order."""
    dp_cp = request.dp_cp_size
    static_sizes = static_cp_sizes(dp_cp)
    job_cp = request.context_parallel_size
    found = [_static(request, job_cp)]
    for fraction in MAX_SEQLEN_FRACTIONS:
        budget = max(1, int(request.max_seqlen_per_dp_cp_rank * fraction))
        for min_cp in dict.fromkeys((request.min_cp_size, DYNAMIC_MIN_CP_SIZE)):
            found.append(_variant(request, SchedulerKind.DYNAMIC_CP, budget, min_cp))
    for fraction in MAX_SEQLEN_FRACTIONS:
        budget = max(1, int(request.max_seqlen_per_dp_cp_rank * fraction))
        found.append(_variant(request, SchedulerKind.HYBRID_CP, budget, None))
    found += [_static(request, cp) for cp in static_sizes if cp != job_cp]
    allowed = request.auto_schedulers
    return [c for c in found if not allowed or c.request.scheduler in allowed]


def _variant(request: PlanRequest, kind: SchedulerKind, budget: int, min_cp: int | None) -> Candidate:
    name = f"{kind.value} max_seqlen={budget}" + (f" min_cp={min_cp}" if min_cp else "")
    concrete = request.replace(
        scheduler=kind, max_seqlen_per_dp_cp_rank=budget, min_cp_size=min_cp, max_seqs_per_micro_batch=None, auto_schedulers=(),
        micro_batch_group_size=request.micro_batch_group_size if kind is SchedulerKind.DYNAMIC_CP else None,
    )
    return Candidate(name, concrete)


def _static(request: PlanRequest, cp: int) -> Candidate:
    concrete = request.replace(
        scheduler=SchedulerKind.STATIC_PACKING, context_parallel_size=cp, data_parallel_size=request.dp_cp_size // cp,
        min_cp_size=None, auto_schedulers=(),
    )
    return Candidate(f"static_cp{cp}", concrete)


def lower_bound(request: PlanRequest, model: CostModel) -> float | None:
    """A lower bound on the predicted step cost of every plan hybrid CP can return for `request`
    (None for the other schedulers: their candidates are cheap to plan). The step is at least the
    total rank-seconds of all groups over DPxCP; a sample of length L adds, over the c ranks of its
    group, c times its share of the group's time (cost.unit_features), with its padded length at
    least L and c at least the CP size BalancedCPScheduler gives it (docs/design.md, "Skipping
    candidates that cannot win", has the proof).
    """
    if request.scheduler is not SchedulerKind.HYBRID_CP:
        return None
    lengths = np.asarray(request.sequence_lengths, dtype=np.int64)
    doublings = np.maximum(0, np.ceil(np.log2(lengths / request.max_seqlen_per_dp_cp_rank)).astype(np.int64))
    cp = 2**doublings  # BalancedCPScheduler.gpus_needed: max(1, 2 ** ceil(log2(L / budget)))
    # A pass and at least one ring step: the bound counts the fewest (c - 1 >= 1), as lower_bound.py does.
    fixed = model.seconds_per_pass + np.where(cp > 1, model.cp_seconds_per_micro_batch, 0.0)
    terms = (
        model.seconds_per_token * lengths
        + model.seconds_per_attention_token_pair * (lengths * lengths).astype(np.float64)
        + cp * fixed
        + model.cp_seconds_per_token * lengths * (cp - 1)
    )
    # add.accumulate sums in order, one term after another: the same float sum as a Python loop.
    total = float(np.add.accumulate(terms)[-1]) if len(terms) else 0.0
    return total / request.dp_cp_size


def deferred(found: Sequence[Candidate]) -> tuple[int, ...]:
    """The candidates planned last, so that the best cost of the others may skip them: those with a
    lower bound (hybrid CP's, the slowest to plan)."""
    return tuple(k for k, c in enumerate(found) if c.request.scheduler is SchedulerKind.HYBRID_CP)


def best_cost(costs: Iterable[float | None]) -> float | None:
    planned = [cost for cost in costs if cost is not None]
    return min(planned) if planned else None


def skip_if_beaten(candidate: Candidate, limits: RequestLimits, model: CostModel, best: float | None) -> Outcome | None:
    """The candidate as skipped when its lower bound exceeds `best` (a cost already planned) and it
    would plan, else None: it must be planned. One that would be refused (validation, a scheduler
    this build lacks) is planned, so that its refusal, not a skip, is what auto lists."""
    bound = lower_bound(candidate.request, model) if best is not None else None
    if bound is None or best is None or not bound > best * (1.0 + SKIP_MARGIN) or not _would_plan(candidate.request, limits):
        return None
    reason = f"skipped: no plan of it can cost less than {bound:.6g} s, above {best:.6g} s already planned"
    return Outcome(candidate, None, "", reason, skipped_lower_bound=bound)


def _would_plan(request: PlanRequest, limits: RequestLimits) -> bool:
    try:
        validate_request(request, limits)
        require_scheduler(request.scheduler)
    except PlanningError:
        return False
    return True


def serve(request: PlanRequest, outcomes: Sequence[Outcome], cost_model: CostModel, megatron_core: str) -> Plan:
    """The cheapest candidate's plan as auto's answer (ties go to the earlier candidate): its own id,
    every candidate listed, its speedup counted against the job's static-CP candidate (or, when
    static CP cannot run the batch, the estimate at the job's CP size). Raises the no-plan error
    when no candidate has a plan."""
    summaries = [o.summary() for o in outcomes]
    planned = [(cost, k) for k, o in enumerate(outcomes) if (cost := o.cost) is not None]
    if not planned:
        raise _no_plan_error(summaries, [o.code for o in outcomes])
    cost, winner_index = min(planned)
    first = summaries[0] if summaries else None
    job_static = first.predicted_step_cost if first is not None and first.name == f"static_cp{request.context_parallel_size}" else None
    if job_static is None:
        job_static = static_cp_step_cost(request, cost_model)
    winner = outcomes[winner_index]
    assert winner.plan is not None and winner.plan.statistics is not None
    stats = replace(winner.plan.statistics, static_cp_step_cost=job_static, predicted_speedup_over_static_cp=job_static / cost)
    return replace(
        winner.plan,
        plan_id=auto_plan_id(request, winner.candidate, cost_model, megatron_core),
        statistics=stats,
        candidates=tuple(replace(s, served=k == winner_index) for k, s in enumerate(summaries)),
    )


def auto_plan_id(request: PlanRequest, winner: Candidate, cost_model: CostModel, megatron_core: str) -> str:
    """Same request, same winner, same id from any replica: the canonical request (options
    included), the candidate list's version, the winner and the coefficients that chose it."""
    coefficients = {name: getattr(cost_model, name) for name in cost_model.__dataclass_fields__}
    return plan_id(request, megatron_core, auto=CANDIDATES_VERSION, winner=winner.name, coefficients=coefficients)


def _no_plan_error(summaries: Sequence[CandidateSummary], codes: Sequence[str]) -> PlanningError:
    reasons = "; ".join(f"{s.name}: {s.not_planned_reason}" for s in summaries[:MAX_REASONS_IN_ERROR])
    more = f"; and {len(summaries) - MAX_REASONS_IN_ERROR} more" if len(summaries) > MAX_REASONS_IN_ERROR else ""
    message = f"scheduler: auto found no candidate that can plan this batch ({reasons}{more})"
    # The caller's fault only when every candidate refused the request itself; the batch's (OUT_OF_RANGE)
    # when upstream refused it on some candidate and validation refused the others; ours otherwise.
    refusals = (ErrorCode.INVALID_ARGUMENT.value, ErrorCode.FAILED_PRECONDITION.value)
    if all(code in refusals for code in codes):
        return InvalidRequestError(message, field="scheduler")
    if all(code in (*refusals, ErrorCode.OUT_OF_RANGE.value) for code in codes):
        return BatchNotPlannableError(message, field="scheduler")
    return SchedulerFailedError(message, field="scheduler")
