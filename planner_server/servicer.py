"""The thin gRPC servicer: moves bytes to the planning pool and ends a failed call with its status
(every refusal is a PlanningError: batch_planner.errors.status_of, then planner_server/status.py).

Plan is registered without a request deserializer and response serializer: the pool
(planner_server/worker_pool.py) parses and hashes a request no larger than a valid one, to route
it, and a worker parses it again (its digest comes with it), plans it and serializes the response.
An auto request is assembled in this process (docs/design.md, "The auto policy"): tens of
milliseconds of its GIL at 16,384 samples.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from batch_planner.convert import JOB_METADATA_KEY, SCHEDULER_TO_PROTO, cost_model_to_proto
from batch_planner.cost_spec import preset_names
from batch_planner.errors import ErrorCode, InvalidRequestError, PlanningError
from batch_planner.precision import Precision
from batch_planner.request import SchedulerKind
from batch_planner.exact.verified import exact_path_status
from batch_planner.schedulers import discover_schedulers, megatron_core_version
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import job_name_refusal
from planner_server import __version__
from planner_server.config import ServerConfig
from planner_server.metrics import PlannerMetrics
from planner_server.plan_rates import PlanRates
from planner_server.planning_worker import WorkerResult, failure
from planner_server.request_log import ViolationDump, log_request
from planner_server.status import abort
from planner_server.worker_pool import JobShareExceeded, PlanningPool, PoolOverloaded

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BatchPlanner"].full_name


class PlannerServicer:
    def __init__(self, config: ServerConfig, pool: PlanningPool, metrics: PlannerMetrics):
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.rates = PlanRates()
        # Set when the drain starts, before health goes NOT_SERVING: a request that arrives after
        # a client saw NOT_SERVING, but before gRPC stops accepting, is refused too.
        self.draining = threading.Event()
        self.violations = ViolationDump(config.violations_dir, config.violations_kept)

    def plan(self, request_bytes: bytes, context: grpc.ServicerContext) -> bytes:
        started = time.perf_counter()
        try:
            self._refuse_if_draining()
            result = self._plan(request_bytes, context)
        except Exception as exc:  # noqa: BLE001 - every failure is answered with its status, never a crash
            result = failure(exc)
            self._count_refusal(exc)
        self._record(result, time.perf_counter() - started)
        if result.invariant:
            self.violations.write(request_bytes, result)
        if result.code is not ErrorCode.OK:
            abort(context, result.code, result.message)
        return result.response

    def _refuse_if_draining(self) -> None:
        """A replica that will not plan any more answers at once with UNAVAILABLE, which the client
        retries on another replica, rather than hold the call. (One warming up gets no call: the
        server opens its port once warm.)"""
        if self.draining.is_set():
            raise PlanningError("planner is shutting down; retry on another replica", code=ErrorCode.UNAVAILABLE)

    def _plan(self, request_bytes: bytes, context: grpc.ServicerContext) -> WorkerResult:
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e8:
            remaining = self.config.default_deadline_seconds
        job = ""
        for key, value in context.invocation_metadata() or ():
            if key == JOB_METADATA_KEY:
                job = value  # the last one wins, as a repeated field in protobuf
        refusal = job_name_refusal(job)
        if refusal is not None:
            raise InvalidRequestError(f"metadata {JOB_METADATA_KEY}: {refusal}, or leave it out (the shared bucket)", field=JOB_METADATA_KEY)
        try:
            # add_callback fires when the RPC ends for any reason - a cancelled or disconnected
            # caller included - and the pool then stops the work nobody waits for.
            return self.pool.plan(request_bytes, time.time() + remaining, remaining, on_abandon=context.add_callback, job=job)
        except TimeoutError:
            if not context.is_active():
                raise PlanningError("the caller cancelled the request", code=ErrorCode.CANCELLED) from None
            raise PlanningError(f"planning took longer than the deadline ({remaining:.3f} s)", code=ErrorCode.DEADLINE_EXCEEDED) from None

    def _count_refusal(self, exc: Exception) -> None:
        if isinstance(exc, JobShareExceeded):
            self.metrics.job_share_rejections.labels(self.metrics.job_label(exc.job)).inc()
        elif isinstance(exc, PoolOverloaded):
            self.metrics.queue_rejections.inc()

    def _record(self, result: WorkerResult, seconds: float) -> None:
        m = self.metrics
        series = m.child
        job = m.job_label(result.about.job)
        scheduler = result.about.scheduler
        series(m.requests, scheduler, result.code.value, job).inc()
        series(m.plan_latency, scheduler).observe(seconds)
        log_request(result, seconds, job)
        if result.invariant:
            series(m.invariant_violations, scheduler, result.invariant).inc()
        if result.code is not ErrorCode.OK:
            return
        series(m.scheduler_latency, scheduler).observe(result.scheduler_seconds)
        self.rates.record(scheduler, result.about.samples, result.about.ranks, result.planning_seconds)
        stats = result.statistics
        series(m.planned_tokens, scheduler, job).inc(stats.real_tokens)
        series(m.padding_tokens, scheduler, job).inc(stats.padded_tokens - stats.real_tokens)
        if result.precision and result.precision != Precision.BF16.value:  # what FP8's row alignment added of it
            series(m.alignment_padding_tokens, scheduler, result.precision, job).inc(stats.alignment_padding_tokens)
        series(m.micro_batches, scheduler).inc(stats.micro_batch_count)
        for cp_size, samples, _ in stats.cp_size_mix:
            series(m.planned_samples, scheduler, str(cp_size)).inc(samples)
        series(m.padding_ratio, scheduler).observe(stats.padding_ratio)
        series(m.balance_efficiency, scheduler).observe(stats.balance_efficiency)
        series(m.speedup, scheduler).observe(stats.predicted_speedup_over_static_cp)
        series(m.last_speedup, scheduler, job).set(stats.predicted_speedup_over_static_cp)
        if result.substitute_reason:
            series(m.substituted, result.substituted_for, result.substitute_reason).inc()
        if result.auto_winner:
            series(m.auto_winners, result.auto_winner).inc()
            for dropped in result.auto_not_planned:
                series(m.auto_not_planned, dropped).inc()

    def get_capabilities(self, request_bytes: bytes, context: grpc.ServicerContext) -> bytes:
        # Parsed here rather than by a registered deserializer: gRPC answers a deserializer's
        # failure with INTERNAL, and bytes that are not a request are the caller's error.
        try:
            pb.GetCapabilitiesRequest.FromString(request_bytes)
        except DecodeError as exc:
            abort(context, ErrorCode.INVALID_ARGUMENT, f"request: not a valid GetCapabilitiesRequest message ({exc})")
        return capabilities(self.config, self.rates, self.pool.workers).SerializeToString()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Plan": grpc.unary_unary_rpc_method_handler(self.plan),
                "GetCapabilities": grpc.unary_unary_rpc_method_handler(self.get_capabilities),
            },
        )


def capabilities(config: ServerConfig, rates: PlanRates | None = None, workers: int = 0) -> pb.Capabilities:
    """What GetCapabilities answers; `rates`: the plan rates measured so far, `workers`: planning workers."""
    limits = config.limits
    result = pb.Capabilities(
        server_version=__version__,
        megatron_core_version=megatron_core_version(),
        limits=pb.Limits(
            max_samples_per_request=limits.max_samples_per_request,
            max_dp_cp_size=limits.max_dp_cp_size,
            max_sequence_length=limits.max_sequence_length,
            max_receive_message_bytes=config.max_receive_message_bytes,
            max_tensor_parallel_size=limits.max_tensor_parallel_size,
            max_micro_batch_group_size=limits.max_micro_batch_group_size,
        ),
        cost_model=cost_model_to_proto(config.cost_model),
        planning_workers=workers,
    )
    for rate in rates.snapshot() if rates is not None else []:
        result.plan_rates.add(
            scheduler=SCHEDULER_TO_PROTO[SchedulerKind(rate.scheduler)],
            samples=rate.samples,
            dp_cp_size=rate.dp_cp_size,
            plans_measured=rate.plans_measured,
            seconds_per_plan=rate.seconds_per_plan,
            plans_per_second=max(1, workers) / rate.seconds_per_plan,
        )
    for kind, availability in discover_schedulers().items():
        result.schedulers.add(
            scheduler=SCHEDULER_TO_PROTO[kind],
            available=availability.available,
            megatron_core_class=availability.spec.qualified_name,
            unavailable_reason=availability.reason,
            implementation=exact_path_status(kind).implementation.value,
            implementation_reason=exact_path_status(kind).reason,
        )
    # auto is not a Megatron-Core class: the cheapest of the schedulers above (batch_planner/auto.py).
    result.schedulers.add(scheduler=pb.SCHEDULER_AUTO, available=True, megatron_core_class="")
    result.cost_model_presets.extend(preset_names())
    return result
