"""A request's bytes in, a WorkerResult (the serialized response, or the status and message) out.

The schedulers hold the GIL, so a worker process parses, plans and serializes (`plan_in_worker`)
and the gRPC process moves bytes; it parses a request once (`parse`) to route it, and its digest
goes to the worker with the bytes: each process parses a request at most once, and one of them
hashes it. Every failure is answered by `failure`, through batch_planner.errors.status_of; every plan by
`plan_parsed`, which sets its timings. An auto request is assembled in the handler by the core's
`plan_batch`, its candidates on the workers (`plan_parsed` with the pool's `run_candidates`).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from google.protobuf.message import DecodeError

from batch_planner import bounded
from batch_planner.auto import Candidate, Outcome, PlanOne, RunCandidates, plan_candidate, plan_serially
from batch_planner.convert import JOB_METADATA_KEY, dp_cp_ranks, plan_to_proto, request_from_proto, scheduler_label, wants_columns
from batch_planner.cost_spec import CostModel
from batch_planner.errors import ErrorCode, InvalidRequestError, InvariantViolationError, PlanningError, status_of
from batch_planner.plan import CandidateSummary, Plan, PlanStatistics
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from batch_planner.exact.verified import DEFAULT_IMPLEMENTATION, select_implementation
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import RequestLimits, job_name_refusal
from planner_server.logging_setup import configure_logging

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class About:
    """What the logs and metrics say about a request, refused or planned."""

    scheduler: str = "unknown"
    job: str = ""  # "" unless the message's job is a name validation accepts: it becomes a metric label
    request_digest: str = ""  # names the request in logs and in a withheld plan's request file
    samples: int = 0
    ranks: int = 0


@dataclass(frozen=True)
class WorkerResult:
    code: ErrorCode
    response: bytes = b""  # serialized PlanResponse when OK
    message: str = ""
    about: About = About()
    plan_id: str = ""
    invariant: str = ""
    # The planning core (batch_planner.planner.plan_batch: validation, Megatron-Core's scheduler,
    # the plan's invariants and statistics), where it ran; auto on the workers: its candidates'.
    scheduler_seconds: float = 0.0
    statistics: PlanStatistics | None = None  # the plan's, when OK
    auto_winner: str = ""  # auto: the scheduler of the plan served
    auto_not_planned: tuple[str, ...] = ()  # auto: the scheduler of each candidate without a plan
    # From when this process took the request to its serialized response; auto on the workers: its
    # candidates' worker time (the measured plan rates). Both timings are set by `plan_parsed`.
    planning_seconds: float = 0.0
    # The substitute was served (batch_planner/substitute.py): the scheduler asked for, and why.
    substituted_for: str = ""
    substitute_reason: str = ""
    precision: str = ""  # the plan's precision (Precision's value), when OK: a bounded metric label


def request_digest(request_bytes: bytes) -> str:
    return hashlib.sha256(request_bytes).hexdigest()[:16]


@dataclass(frozen=True)
class Parsed:
    """A request parsed once in this process: its message and what is said about it."""

    message: pb.PlanRequest
    about: About

    def check_job(self, admitted_job: str) -> None:
        """`admitted_job`: the job name the request was admitted under (its metadata); the
        message's own must agree."""
        job = self.message.job
        if admitted_job and job and job != admitted_job:
            raise InvalidRequestError(
                f"job: {job[:80]!r} differs from the request metadata's {JOB_METADATA_KEY} {admitted_job!r}, under which "
                "it was admitted; send the same job name in both, or leave one of them empty", field="job",
            )


def parse(request_bytes: bytes, deadline: float, digest: str = "") -> Parsed:
    """The message and what the logs and metrics say about it; DEADLINE_EXCEEDED at or past
    `deadline` (wall-clock seconds since the epoch), InvalidRequestError for bytes that are not a
    PlanRequest. `digest`: the bytes' request_digest, where another process has computed it."""
    if time.time() >= deadline:
        raise PlanningError("the request's deadline passed while it waited for a worker", code=ErrorCode.DEADLINE_EXCEEDED)
    try:
        message = pb.PlanRequest.FromString(request_bytes)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidRequestError(f"request: not a valid PlanRequest message ({exc})", field="request") from None
    # The job name becomes a metric label even when the request is refused; a name validation
    # would refuse (100 kB, label syntax) must not reach the registry or every scrape.
    return Parsed(message, About(
        scheduler=scheduler_label(message.scheduler),
        job=message.job if job_name_refusal(message.job) is None else "",
        request_digest=digest or request_digest(request_bytes),
        samples=len(message.sequence_lengths),
        ranks=dp_cp_ranks(message.layout),
    ))


def refusal(exc: PlanningError, request_bytes: bytes, digest: str = "") -> WorkerResult:
    """The answer to a request refused before it parsed (`parse`'s refusals)."""
    return failure(exc, About(request_digest=digest or request_digest(request_bytes)))


def plan_request_bytes(
    request_bytes: bytes, deadline: float, limits: RequestLimits, cost_model: CostModel, admitted_job: str = "",
    run_candidates: RunCandidates = plan_serially, digest: str = "",
) -> WorkerResult:
    """Plans one serialized PlanRequest in this process; `deadline` is wall-clock seconds since the
    epoch, `digest` the bytes' request_digest where the caller has it."""
    received = time.perf_counter()
    try:
        parsed = parse(request_bytes, deadline, digest)
    except PlanningError as exc:
        return refusal(exc, request_bytes, digest)
    with bounded.request_deadline(deadline):  # upstream's own code is cut off in time for the substitute
        return plan_parsed(parsed, limits, cost_model, run_candidates, admitted_job=admitted_job, received=received)


def plan_parsed(
    parsed: Parsed, limits: RequestLimits, cost_model: CostModel, run_candidates: RunCandidates = plan_serially, *,
    admitted_job: str = "", passes: tuple[type[BaseException], ...] = (), finish: Callable[[Plan], Plan] = lambda plan: plan,
    received: float | None = None, worker_seconds: Callable[[], float] | None = None,
) -> WorkerResult:
    """Plans a parsed request (`parse`): the core's plan_batch, its answer serialized, every
    failure answered by `failure`. `passes`: what `run_candidates` may raise that is not a planning
    result (the pool's overload, timeout and lost workers), raised on to the caller. `finish`: gives
    the served plan back what `run_candidates` held apart (`plan_candidate_in_worker`).

    The one place a plan's timings are set: scheduler_seconds is plan_batch's time here, and
    planning_seconds runs from `received` (time.perf_counter() when this process took the request;
    by default, now) to the serialized response. `worker_seconds`: auto's candidates planned on the
    workers, their summed worker time once planned, which is then both: what the request cost the
    replica, so the plan rates GetCapabilities reports for auto say how many a replica plans per
    second."""
    received = time.perf_counter() if received is None else received
    try:
        parsed.check_job(admitted_job)
        request = request_from_proto(parsed.message)
        started = time.perf_counter()
        plan = finish(plan_batch(request, limits, cost_model, run_candidates))
        elapsed = time.perf_counter() - started
    except passes:
        raise
    except Exception as exc:  # noqa: BLE001 - answered with its status, never raised out of the worker
        return failure(exc, parsed.about)
    response = plan_to_proto(plan, wants_columns(parsed.message)).SerializeToString(deterministic=True)
    if worker_seconds is None:
        planning_seconds = time.perf_counter() - received
    else:
        elapsed = planning_seconds = worker_seconds()
    substitution = plan.substitution
    if substitution is not None:
        log.warning("request %s: %s", parsed.about.request_digest, substitution.describe())
    return WorkerResult(ErrorCode.OK, response, about=parsed.about, plan_id=plan.plan_id, scheduler_seconds=elapsed,
                        statistics=plan.statistics, planning_seconds=planning_seconds, precision=plan.precision.value,
                        substituted_for=substitution.requested.value if substitution else "",
                        substitute_reason=substitution.reason.value if substitution else "",
                        **_auto_fields(plan.candidates))


def failure(exc: Exception, about: About = About()) -> WorkerResult:
    """A failed call's answer: its status and message by `status_of`, the one mapping. A withheld
    plan and anything that is not a PlanningError (our bug) are logged here."""
    code, message = status_of(exc)
    if isinstance(exc, InvariantViolationError):
        log.error("withheld a plan of request %s: %s", about.request_digest, exc)
    elif not isinstance(exc, PlanningError):
        log.exception("unexpected planning failure", exc_info=exc)  # a bug of ours must not take the worker down
    return WorkerResult(code, message=message, about=about, invariant=getattr(exc, "invariant", ""))


def _auto_fields(summaries: Sequence[CandidateSummary]) -> dict:
    """The metrics' view of auto's answer: the winner's scheduler, the candidates without a plan."""
    if not summaries:
        return {}
    return dict(
        auto_winner=next(c.scheduler.value for c in summaries if c.served),
        auto_not_planned=tuple(c.scheduler.value for c in summaries if c.predicted_step_cost is None),
    )


def warm_up() -> None:
    """Imports Megatron-Core, compiles the compiled exact path where this process runs it, and plans
    one small batch, so the first real request is not slow."""
    from batch_planner.exact.prepare import prepare
    from batch_planner.schedulers import discover_schedulers

    discover_schedulers()
    prepare()
    plan_batch(PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096))


_settings: tuple[RequestLimits, CostModel] = (RequestLimits(), CostModel())  # the server's, once per worker


def worker_initializer(
    log_level: str, limits: RequestLimits, cost_model: CostModel, log_format: str = "text",
    scheduler_implementation: str = DEFAULT_IMPLEMENTATION.value,
) -> None:
    """Runs once in each worker: the server's limits, cost model and scheduler implementation arrive
    here rather than being pickled with every request."""
    global _settings
    select_implementation(scheduler_implementation)
    configure_logging(log_level, log_format, process="worker")
    _settings = (limits, cost_model)
    warm_up()


def plan_candidate_in_worker(candidate: Candidate, plan_one: PlanOne, deadline: float | None = None) -> tuple[Outcome, bytes]:
    """One of auto's candidates planned in a worker for the handler's run_candidates: its Outcome,
    with the plan's micro-batches held apart as pickled bytes. They are most of a plan; the handler
    loads only the served plan's (docs/design.md, "The auto policy", says what that saves).
    `deadline`: the request's (seconds since the epoch), before which upstream's own code is cut off."""
    with bounded.request_deadline(deadline):
        outcome = plan_candidate(candidate, plan_one)
    if outcome.plan is None:
        return outcome, b""
    return replace(outcome, plan=replace(outcome.plan, micro_batches=())), pickle.dumps(outcome.plan.micro_batches, protocol=5)


def plan_in_worker(request_bytes: bytes, deadline: float, admitted_job: str = "", digest: str = "") -> WorkerResult:
    """What the pool submits to a worker for a request: plan_request_bytes with the worker's settings,
    `digest` the one the handler's parse computed ("" for bytes it did not parse). An auto request
    reaches a worker only when it is larger than the handler parses (a valid one never is): it is
    refused rather than have one worker plan every candidate on one slot."""
    return plan_request_bytes(request_bytes, deadline, *_settings, admitted_job, _refuse_auto, digest)


def _refuse_auto(found: Sequence[Candidate], plan_one: PlanOne) -> list[Outcome]:
    raise InvalidRequestError(
        "request: an auto request larger than any request within this server's limits, though its samples are within "
        "them (fields batch_planner.v1.PlanRequest does not have?); send only the request's own fields", field="request",
    )
