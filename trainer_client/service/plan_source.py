"""Where a step's plan comes from: the service, or in-process planning when the service fails
(the same `plan_batch` and Megatron-Core scheduler: the same plan where both run the same Megatron-Core
build). While the service is failing, a circuit breaker plans in-process for `fallback_cooldown_seconds`,
then lets one step probe the service (docs/trainer-client.md, "Faults"); an outage is logged once when
it starts and once when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from batch_planner.convert import plan_from_proto, request_to_proto
from batch_planner.errors import PlanningError
from batch_planner.plan import MicroBatches, Plan, structure_problem
from batch_planner.padding import PADDING_KEY_FIELDS, padding_key
from batch_planner.exact.prepare import prepare
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.service.config import PlannerClientConfig
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.service.rpc_client import PlannerRpcClient, PlanRejectedError, ServiceFailedError
from trainer_client.errors import PlannerUnavailableError

log = logging.getLogger(__name__)

SERVICE = "service"
FALLBACK = "fallback"
# fallbacks_total{reason}: the lower-cased gRPC status of the failure, "circuit_open" for a step
# planned in-process during the cool-down, "no_endpoint" when no service is configured,
# "malformed_response" for an answer that is not a readable PlanResponse (a bug of the server's).
CIRCUIT_OPEN = "circuit_open"
NO_ENDPOINT = "no_endpoint"
MALFORMED_RESPONSE = "malformed_response"


@dataclass(frozen=True)
class SourcedPlan:
    plan: Plan
    source: str  # SERVICE or FALLBACK
    response: bytes = b""  # from the service: the serialized PlanResponse it sent


class PlanSource:
    def __init__(self, config: PlannerClientConfig, metrics: TrainerMetrics):
        self.config = config
        self.metrics = metrics
        self.rpc = PlannerRpcClient(config, metrics) if config.planner_endpoint else None
        if config.fallback or self.rpc is None:
            prepare(implementation=config.scheduler_implementation)  # the fallback's compilation, paid now rather than on its first plan
        self._lock = threading.Lock()
        self._outage_reason: str | None = None
        self._retry_service_at = 0.0

    def close(self) -> None:
        if self.rpc is not None:
            self.rpc.close()

    def plan(self, request: PlanRequest) -> SourcedPlan:
        if self.rpc is None:
            return self._fallback(request, NO_ENDPOINT)
        with self._lock:
            if self._outage_reason is not None and time.monotonic() < self._retry_service_at:
                return self._fallback(request, CIRCUIT_OPEN)
        try:
            response = self.rpc.plan_bytes(request_to_proto(request, pb.PLAN_FORM_COLUMNS))
            plan = _read(response, request)
        except ServiceFailedError as failure:
            self._enter_outage(failure)
            return self._fallback(request, failure.reason)
        self._leave_outage()
        self.metrics.plans.labels(self.metrics.job, SERVICE).inc()
        return SourcedPlan(plan, SERVICE, response)

    def _enter_outage(self, failure: ServiceFailedError) -> None:
        if not self.config.fallback:
            raise PlannerUnavailableError(f"{failure}; fallback to in-process planning is off") from failure
        if not failure.whole_service:
            return  # one replica failed this step's plan: the next step asks the service again
        with self._lock:
            if self._outage_reason is None:
                log.warning(
                    "batch planner service at %s failed (%s); planning in-process until it answers again",
                    self.config.planner_endpoint, failure,
                )
            self._outage_reason = failure.reason
            self._retry_service_at = time.monotonic() + self.config.fallback_cooldown_seconds

    def _leave_outage(self) -> None:
        with self._lock:
            if self._outage_reason is not None:
                log.warning("batch planner service at %s answers again; using it", self.config.planner_endpoint)
            self._outage_reason = None

    def _fallback(self, request: PlanRequest, reason: str) -> SourcedPlan:
        if reason != NO_ENDPOINT:
            self.metrics.fallbacks.labels(self.metrics.job, reason).inc()
        try:
            plan = plan_batch(request, implementation=self.config.scheduler_implementation)  # this client's own setting
        except PlanningError as error:
            # The trainer's own Megatron-Core cannot plan it either: say both sides' reasons.
            raise PlanRejectedError(error.code.value, str(error)) from error
        self.metrics.plans.labels(self.metrics.job, FALLBACK).inc()
        return SourcedPlan(plan, FALLBACK)


def _shown(value):
    return getattr(value, "value", value)


def _read(response: bytes, request: PlanRequest) -> Plan:
    """The plan of the service's answer to `request`. An answer that is not a readable
    PlanResponse, or whose plan cannot be applied to the request's batch (plan.structure_problem),
    fails like the call (ServiceFailedError), rather than a rank failing alone in `apply` while its
    peers wait in a collective, or a sample going untrained."""
    try:
        plan = plan_from_proto(pb.PlanResponse.FromString(response))
    except (DecodeError, KeyError, ValueError) as exc:  # ValueError: convert.MalformedPlanError among others
        raise ServiceFailedError(MALFORMED_RESPONSE, f"its answer is not a readable PlanResponse ({type(exc).__name__}: {exc})") from exc
    problem = structure_problem(plan, request.num_samples, request.dp_cp_size)
    if problem is not None:
        raise ServiceFailedError(MALFORMED_RESPONSE, f"its plan cannot be applied to this batch: {problem}")
    # The plan pads as the trainer's engine does (a server that predates an option answers without
    # it: padding, min_local_rows, precision), so the plan is made in process instead.
    asked, got = padding_key(request), padding_key(plan)
    if got != asked:
        raise ServiceFailedError(
            MALFORMED_RESPONSE,
            f"its plan pads for ({', '.join(PADDING_KEY_FIELDS)}) = {tuple(_shown(v) for v in got)}, "
            f"the request asked for {tuple(_shown(v) for v in asked)}",
        )
    if isinstance(plan.micro_batches, MicroBatches):
        plan.micro_batches.as_tuple()  # built here, on the thread that fetched it (plan-ahead's), not in the step
    return plan
