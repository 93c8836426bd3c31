"""What runs inside a planning worker process: bytes in, bytes out, never an exception.

Megatron-Core's schedulers are pure Python and hold the GIL, so the server plans in separate
processes. A worker parses the request itself and returns the serialized response, so the gRPC
process only moves bytes.
"""

from __future__ import annotations

import hashlib
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


def request_digest(request_bytes: bytes) -> str:
    return hashlib.sha256(request_bytes).hexdigest()[:16]


def plan_request_bytes(
    request_bytes: bytes, deadline: float, limits: RequestLimits, cost_model: CostModel
) -> WorkerResult:
    """Plans one serialized PlanRequest; `deadline` is wall-clock seconds since the epoch."""
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
    try:
        request = request_from_proto(message)
        started = time.perf_counter()
        plan = plan_batch(request, limits, cost_model)
        elapsed = time.perf_counter() - started
    except InvariantViolationError as exc:
        log.error("withheld a plan of request %s: %s", digest, exc)
        return WorkerResult(exc.code, message=str(exc), invariant=exc.invariant, **about)
    except PlanningError as exc:
        return WorkerResult(exc.code, message=str(exc), **about)
    except Exception as exc:  # noqa: BLE001 - a bug of ours must not take the worker down
        log.exception("unexpected planning failure")
        return WorkerResult(ErrorCode.INTERNAL, message=f"planner bug: {type(exc).__name__}: {exc}", **about)
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
        **about,
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


def worker_initializer(log_level: str, limits: RequestLimits, cost_model: CostModel, log_format: str = "text") -> None:
    """Runs once in each worker: the server's limits and cost model arrive here rather than being
    pickled with every request."""
    global _settings
    handler = logging.StreamHandler()
    if log_format == "json":
        from planner_server.request_log import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [worker] %(name)s: %(message)s"))
    logging.basicConfig(level=log_level, handlers=[handler])
    _settings = _WorkerSettings(limits, cost_model)
    warm_up()


def plan_in_worker(request_bytes: bytes, deadline: float) -> WorkerResult:
    """What the pool submits to a worker: plan_request_bytes with the worker's settings."""
    return plan_request_bytes(request_bytes, deadline, _settings.limits, _settings.cost_model)
