"""What runs inside a planning worker process: bytes in, bytes out, never an exception.

Megatron-Core's schedulers are pure Python and hold the GIL, so the server plans in separate
processes. A worker parses the request itself and returns the serialized response, so the gRPC
process only moves bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from batch_planner.convert import plan_to_proto, request_from_proto, scheduler_label
from batch_planner.cost import CostModel
from batch_planner.errors import ErrorCode, InvariantViolationError, PlanningError
from batch_planner.planner import plan_batch
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import JOB_NAME_PATTERN, RequestLimits

log = logging.getLogger(__name__)

DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
OK = "OK"


@dataclass(frozen=True)
class WorkerResult:
    code: str  # "OK" or a grpc.StatusCode name
    response: bytes = b""  # serialized PlanResponse when OK
    message: str = ""
    scheduler: str = "unknown"
    job: str = ""
    invariant: str = ""
    scheduler_seconds: float = 0.0
    real_tokens: int = 0
    padded_tokens: int = 0
    padding_ratio: float = 0.0
    balance_efficiency: float = 0.0
    speedup: float = 0.0
    micro_batches: int = 0
    cp_size_samples: tuple[tuple[int, int], ...] = ()
    samples: int = 0  # the request's size, for the measured plan rates (GetCapabilities)
    dp_cp_size: int = 0
    planning_seconds: float = 0.0  # parse to serialized response, in the worker


def plan_request_bytes(
    request_bytes: bytes, deadline: float, limits: RequestLimits, cost_model: CostModel
) -> WorkerResult:
    """Plans one serialized PlanRequest; `deadline` is wall-clock seconds since the epoch."""
    received = time.perf_counter()
    if time.time() >= deadline:
        return WorkerResult(DEADLINE_EXCEEDED, message="the request's deadline passed while it waited for a worker")
    message = pb.PlanRequest()
    try:
        message.ParseFromString(request_bytes)
    except (DecodeError, ValueError, RuntimeError) as exc:
        return WorkerResult(ErrorCode.INVALID_ARGUMENT.value, message=f"request: not a valid PlanRequest message ({exc})")
    label = scheduler_label(message.scheduler)
    # The job name becomes a metric label even when the request is refused; a name validation
    # would refuse (100 kB, label syntax) must not reach the registry or every scrape.
    job = message.job if JOB_NAME_PATTERN.match(message.job) else ""
    try:
        request = request_from_proto(message)
        started = time.perf_counter()
        plan = plan_batch(request, limits, cost_model)
        elapsed = time.perf_counter() - started
    except InvariantViolationError as exc:
        log.error("withheld a plan: %s", exc)
        return WorkerResult(exc.code.value, message=str(exc), scheduler=label, job=job, invariant=exc.invariant)
    except PlanningError as exc:
        return WorkerResult(exc.code.value, message=str(exc), scheduler=label, job=job)
    except Exception as exc:  # noqa: BLE001 - a bug of ours must not take the worker down
        log.exception("unexpected planning failure")
        return WorkerResult(
            ErrorCode.INTERNAL.value, message=f"planner bug: {type(exc).__name__}: {exc}", scheduler=label, job=job
        )
    stats = plan.statistics
    samples: dict[int, int] = {}
    for size, count, _ in stats.cp_size_mix:
        samples[size] = samples.get(size, 0) + count
    response = plan_to_proto(plan).SerializeToString(deterministic=True)
    return WorkerResult(
        OK,
        response=response,
        scheduler=label,
        job=job,
        scheduler_seconds=elapsed,
        real_tokens=stats.real_tokens,
        padded_tokens=stats.padded_tokens,
        padding_ratio=stats.padding_ratio,
        balance_efficiency=stats.balance_efficiency,
        speedup=stats.predicted_speedup_over_static_cp,
        micro_batches=stats.micro_batch_count,
        cp_size_samples=tuple(sorted(samples.items())),
        samples=request.num_samples,
        dp_cp_size=request.dp_cp_size,
        planning_seconds=time.perf_counter() - received,
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


def worker_initializer(log_level: str, limits: RequestLimits, cost_model: CostModel) -> None:
    """Runs once in each worker: the server's limits and cost model arrive here rather than being
    pickled with every request."""
    global _settings
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [worker] %(name)s: %(message)s")
    _settings = _WorkerSettings(limits, cost_model)
    warm_up()


def plan_in_worker(request_bytes: bytes, deadline: float) -> WorkerResult:
    """What the pool submits to a worker: plan_request_bytes with the worker's settings."""
    return plan_request_bytes(request_bytes, deadline, _settings.limits, _settings.cost_model)
