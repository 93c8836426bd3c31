"""What runs inside a planning worker process: bytes in, bytes out, never an exception.

Megatron-Core's schedulers are pure Python and hold the GIL, so the server plans in separate
processes. A worker parses the request itself and returns the serialized response, so the gRPC
process only moves bytes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

from google.protobuf.message import DecodeError

from batch_planner.auto import answer, auto_plan_id, candidates, deferred, plan_candidate
from batch_planner.convert import auto_patch_to_proto, plan_to_proto, request_from_proto, scheduler_label
from batch_planner.cost import static_cp_step_cost
from batch_planner.cost_derivation import resolve_cost_model
from batch_planner.cost_spec import CostModel
from batch_planner.errors import ErrorCode, InvariantViolationError, PlanningError
from batch_planner.plan import CandidateSummary
from batch_planner.planner import plan_batch, plan_one_scheduler, skipped_outcome
from batch_planner.request import SchedulerKind
from batch_planner.exact.verified import select_implementation
from batch_planner.schedulers import megatron_core_version
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import JOB_NAME_PATTERN, RequestLimits, validate_request

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class WorkerResult:
    code: ErrorCode
    response: bytes = b""  # serialized PlanResponse when OK
    message: str = ""
    scheduler: str = "unknown"
    job: str = ""
    request_digest: str = ""  # names the request in logs and in a withheld plan's request file
    plan_id: str = ""
    samples: int = 0
    ranks: int = 0
    invariant: str = ""
    scheduler_seconds: float = 0.0
    real_tokens: int = 0
    padded_tokens: int = 0
    padding_ratio: float = 0.0
    balance_efficiency: float = 0.0
    speedup: float = 0.0
    micro_batches: int = 0
    cp_size_samples: tuple[tuple[int, int], ...] = ()
    auto_winner: str = ""  # auto: the scheduler of the plan served
    auto_not_planned: tuple[str, ...] = ()  # auto: the scheduler of each candidate without a plan
    planning_seconds: float = 0.0  # parse to serialized response, in the worker (the measured plan rates)


def request_digest(request_bytes: bytes) -> str:
    return hashlib.sha256(request_bytes).hexdigest()[:16]


def plan_request_bytes(
    request_bytes: bytes, deadline: float, limits: RequestLimits, cost_model: CostModel
) -> WorkerResult:
    """Plans one serialized PlanRequest; `deadline` is wall-clock seconds since the epoch."""
    return plan_part(request_bytes, deadline, None, limits, cost_model)[0]


def plan_part(
    request_bytes: bytes, deadline: float, index: int | None, limits: RequestLimits, cost_model: CostModel,
    best: float | None = None,
) -> tuple[WorkerResult, AutoPart | None]:
    """With `index`: candidate `index` of an auto request, its WorkerResult and its AutoPart
    (`best`: the cheapest cost already planned, which may skip a deferred candidate). A request
    that is not auto, or refused as a whole, or `index` None: planned (or refused) in full, with
    no AutoPart."""
    received = time.perf_counter()
    parsed = _parse(request_bytes, deadline)
    if isinstance(parsed, WorkerResult):
        return parsed, None
    message, about = parsed
    try:
        request = request_from_proto(message)
        if index is not None and request.scheduler is SchedulerKind.AUTO:
            validate_request(request, limits)
            return _plan_candidate(request, index, limits, cost_model, about, best)
        started = time.perf_counter()
        plan = plan_batch(request, limits, cost_model)
        elapsed = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - translated, never raised out of the worker
        return _failure(exc, about), None
    return replace(_success(plan, elapsed, about), planning_seconds=time.perf_counter() - received), None


def _parse(request_bytes: bytes, deadline: float) -> tuple[pb.PlanRequest, dict] | WorkerResult:
    digest = request_digest(request_bytes)
    if time.time() >= deadline:
        return WorkerResult(ErrorCode.DEADLINE_EXCEEDED, message="the request's deadline passed while it waited for a worker",
                            request_digest=digest)
    message = pb.PlanRequest()
    try:
        message.ParseFromString(request_bytes)
    except (DecodeError, ValueError, RuntimeError) as exc:
        return WorkerResult(ErrorCode.INVALID_ARGUMENT, message=f"request: not a valid PlanRequest message ({exc})",
                            request_digest=digest)
    # The job name becomes a metric label even when the request is refused; a name validation
    # would refuse (100 kB, label syntax) must not reach the registry or every scrape.
    about = dict(
        scheduler=scheduler_label(message.scheduler),
        job=message.job if JOB_NAME_PATTERN.match(message.job) else "",
        request_digest=digest,
        samples=len(message.sequence_lengths),
        ranks=message.layout.data_parallel_size * max(1, message.layout.context_parallel_size),
    )
    return message, about


def _failure(exc: Exception, about: dict) -> WorkerResult:
    if isinstance(exc, InvariantViolationError):
        log.error("withheld a plan of request %s: %s", about["request_digest"], exc)
        return WorkerResult(exc.code, message=str(exc), invariant=exc.invariant, **about)
    if isinstance(exc, PlanningError):
        return WorkerResult(exc.code, message=str(exc), **about)
    log.exception("unexpected planning failure", exc_info=exc)  # a bug of ours must not take the worker down
    return WorkerResult(ErrorCode.INTERNAL, message=f"planner bug: {type(exc).__name__}: {exc}", **about)


def _success(plan, elapsed: float, about: dict) -> WorkerResult:
    stats = plan.statistics
    samples: dict[int, int] = {}
    for size, count, _ in stats.cp_size_mix:
        samples[size] = samples.get(size, 0) + count
    return WorkerResult(
        ErrorCode.OK,
        response=plan_to_proto(plan).SerializeToString(deterministic=True),
        plan_id=plan.plan_id,
        scheduler_seconds=elapsed,
        real_tokens=stats.real_tokens,
        padded_tokens=stats.padded_tokens,
        padding_ratio=stats.padding_ratio,
        balance_efficiency=stats.balance_efficiency,
        speedup=stats.predicted_speedup_over_static_cp,
        micro_batches=stats.micro_batch_count,
        cp_size_samples=tuple(sorted(samples.items())),
        **_auto_fields(plan.candidates),
        **about,
    )


@dataclass(frozen=True)
class AutoPart:
    """One of auto's candidates planned in a worker: small enough to send back for every
    candidate; the winner's serialized plan travels in the WorkerResult next to it."""

    count: int  # how many candidates the request has
    job_cp: int  # the job's CP size (whose static-CP candidate the speedup is counted against)
    summary: CandidateSummary
    code: str  # the ErrorCode of the candidate's failure ("" when planned)
    plan_id: str  # auto's plan id, should this candidate win
    static_estimate: float  # static CP at the job's CP size, estimated (candidate 0 only)
    deferred: tuple[int, ...] = ()  # the candidates to plan after the others (batch_planner.auto.deferred)


def _plan_candidate(
    request, index: int, limits: RequestLimits, cost_model: CostModel, about: dict, best: float | None
) -> tuple[WorkerResult, AutoPart]:
    found = candidates(request)
    model = resolve_cost_model(request.cost_model, cost_model, request.tensor_parallel_size)
    candidate = found[index]
    started = time.perf_counter()
    outcome = skipped_outcome(candidate, limits, model, best) or plan_candidate(
        candidate, partial(plan_one_scheduler, limits=limits, cost_model=model)
    )
    elapsed = time.perf_counter() - started
    estimate = static_cp_step_cost(request, model) if index == 0 else 0.0
    part = AutoPart(
        len(found), request.context_parallel_size,
        candidate.summary(outcome.cost, outcome.reason, skipped_lower_bound=outcome.skipped_lower_bound), outcome.code,
        auto_plan_id(request, candidate, model, megatron_core_version()), estimate,
        deferred(found) if index == 0 else (),
    )
    if outcome.skipped_lower_bound is not None:
        result = WorkerResult(ErrorCode.OK, message=outcome.reason, **about)
    elif outcome.plan is None:
        result = WorkerResult(ErrorCode(outcome.code), message=outcome.reason, **about)
    else:
        result = _success(outcome.plan, elapsed, about)
    return replace(result, planning_seconds=elapsed), part


def assemble_auto(parts: list[tuple[WorkerResult, AutoPart]], job_cp: int) -> WorkerResult:
    """auto's answer from its candidates planned side by side: the winner's serialized plan with a
    patch appended (protobuf merges concatenated messages: the patch sets the plan id, adds the
    candidates and overrides the static-CP comparison), equal to what in-process planning gives."""
    first_result, first = parts[0]
    try:
        result = answer([p.summary for _, p in parts], [p.code for _, p in parts], job_cp, lambda: first.static_estimate)
    except PlanningError as exc:
        return replace(first_result, code=exc.code, message=str(exc), response=b"", invariant="")
    winner, part = parts[result.winner]
    patch = auto_patch_to_proto(part.plan_id, result)
    return replace(
        winner, response=winner.response + patch.SerializeToString(deterministic=True), plan_id=part.plan_id,
        speedup=result.predicted_speedup_over_static_cp, scheduler=first_result.scheduler,
        scheduler_seconds=sum(r.scheduler_seconds for r, _ in parts),
        # The worker time of every candidate: what one auto request costs the replica, so the plan
        # rates GetCapabilities reports for auto say how many a replica plans per second.
        planning_seconds=sum(r.planning_seconds for r, _ in parts),
        **_auto_fields(result.candidates),
    )


def _auto_fields(summaries: Sequence[CandidateSummary]) -> dict:
    """The metrics' view of auto's answer: the winner's scheduler, the candidates without a plan."""
    if not summaries:
        return {}
    return dict(
        auto_winner=next(c.scheduler.value for c in summaries if c.served),
        auto_not_planned=tuple(c.scheduler.value for c in summaries if c.predicted_step_cost is None),
    )


def warm_up() -> None:
    """Imports Megatron-Core and plans one small batch, so the first real request is not slow."""
    from batch_planner.request import PlanRequest
    from batch_planner.schedulers import discover_schedulers

    discover_schedulers()
    plan_batch(PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096))


@dataclass(frozen=True)
class _WorkerSettings:
    limits: RequestLimits
    cost_model: CostModel


_settings = _WorkerSettings(RequestLimits(), CostModel())


def worker_initializer(
    log_level: str, limits: RequestLimits, cost_model: CostModel, log_format: str = "text", scheduler_implementation: str = "exact"
) -> None:
    """Runs once in each worker: the server's limits, cost model and scheduler implementation arrive
    here rather than being pickled with every request."""
    global _settings
    select_implementation(scheduler_implementation)
    handler = logging.StreamHandler()
    if log_format == "json":
        from planner_server.request_log import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [worker] %(name)s: %(message)s"))
    logging.basicConfig(level=log_level, handlers=[handler])
    _settings = _WorkerSettings(limits, cost_model)
    warm_up()


def plan_part_in_worker(
    request_bytes: bytes, deadline: float, index: int, best: float | None = None
) -> tuple[WorkerResult, AutoPart | None]:
    """What the pool submits for one of auto's candidates (plan_part with the worker's settings)."""
    return plan_part(request_bytes, deadline, index, _settings.limits, _settings.cost_model, best)


def plan_in_worker(request_bytes: bytes, deadline: float) -> WorkerResult:
    """What the pool submits to a worker: plan_request_bytes with the worker's settings."""
    return plan_request_bytes(request_bytes, deadline, _settings.limits, _settings.cost_model)
