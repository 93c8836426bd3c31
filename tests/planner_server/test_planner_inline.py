"""Inline planning: small requests are planned in the gRPC handler thread instead of a worker.

- the bytes an inline plan answers with are exactly those a worker answers with, for plans and for
  refusals, and a worker uses the limits and cost model it was given once, at start-up;
- requests past the inline bound still go to a worker;
- each plan's timings are set where it ran, and a worker does not hash a request the handler hashed;
- an inline request counts as in flight: it holds a slot of the overload bound (a request past the
  bound gets RESOURCE_EXHAUSTED), shows in batch_planner_in_flight_requests, and is counted in
  batch_planner_requests_total like any other.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.convert import plan_to_proto, request_to_proto
from batch_planner.cost_spec import CostModel
from batch_planner.distributions import sample_lengths
from batch_planner.errors import ErrorCode
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from batch_planner.validation import RequestLimits
from planner_server.planning_worker import plan_request_bytes, request_digest
from planner_server.worker_pool import InlineBound, PlanningPool
from tests.support.planner_process import PlannerProcess, start_planner

LIMITS = RequestLimits(max_samples_per_request=300)
# Not the defaults: a worker that priced plans with CostModel() would answer different bytes.
COST_MODEL = CostModel(seconds_per_token=3e-6, seconds_per_pass=5e-3, cp_seconds_per_micro_batch=2e-2)


def small_requests() -> list[PlanRequest]:
    requests = [
        PlanRequest.of(tuple(sample_lengths(name, 64, seed=seed)), 4, 2, 8192)
        for name in ("lognormal_32k", "megatron_dcp", "bimodal")
        for seed in range(2)
    ]
    requests.append(PlanRequest.of((100, 0, 7), 4, 2, 8192))  # refused: a sample of length 0
    requests.append(PlanRequest.of((40000,), 2, 1, 8192))  # refused: longer than DPxCP can hold
    return requests


def without_timing(result):
    return dataclasses.replace(result, scheduler_seconds=0.0, planning_seconds=0.0)


@pytest.fixture(scope="module")
def pools():
    inline = PlanningPool(1, 2, LIMITS, COST_MODEL, inline=InlineBound(max_samples=128, max_ranks=16))
    workers_only = PlanningPool(1, 2, LIMITS, COST_MODEL)
    yield inline, workers_only
    inline.shutdown()
    workers_only.shutdown()


def test_inline_and_worker_plans_are_the_same_bytes(pools):
    inline, workers_only = pools
    for request in small_requests():
        payload = request_to_proto(request).SerializeToString()
        planned_inline = inline.plan(payload, time.time() + 60, timeout=60)
        planned_by_worker = workers_only.plan(payload, time.time() + 60, timeout=60)
        assert without_timing(planned_inline) == without_timing(planned_by_worker), request
    # The inline pool never started its worker (ProcessPoolExecutor starts workers on first use).
    assert inline.tasks_run == 0 and workers_only.tasks_run == len(small_requests())
    # And the worker priced and validated with the settings its initializer was given.
    request = small_requests()[0]
    expected = plan_to_proto(plan_batch(request, LIMITS, COST_MODEL)).SerializeToString(deterministic=True)
    assert workers_only.plan(request_to_proto(request).SerializeToString(), time.time() + 60, 60).response == expected
    too_many = request_to_proto(PlanRequest.of(tuple([512] * 301), 4, 2, 8192)).SerializeToString()
    refused = workers_only.plan(too_many, time.time() + 60, timeout=60)
    assert refused.code == "INVALID_ARGUMENT" and "limit of 300" in refused.message


def test_each_plan_gets_its_timings_where_it_ran(pools):
    """Inline and on a worker: the planning core's time within the whole time this process spent on
    the request; auto on the workers: its candidates' summed worker time, for both."""
    inline, workers_only = pools
    payload = request_to_proto(small_requests()[0]).SerializeToString()
    for planned in (inline.plan(payload, time.time() + 60, timeout=60), workers_only.plan(payload, time.time() + 60, timeout=60)):
        assert planned.code is ErrorCode.OK
        assert 0 < planned.scheduler_seconds <= planned.planning_seconds
    auto = request_to_proto(small_requests()[0])
    auto.scheduler = pb.SCHEDULER_AUTO
    planned = workers_only.plan(auto.SerializeToString(), time.time() + 60, timeout=60)
    assert planned.code is ErrorCode.OK and planned.auto_winner
    assert 0 < planned.scheduler_seconds == planned.planning_seconds


def test_a_worker_hashes_no_request_the_handler_has_hashed():
    payload = request_to_proto(small_requests()[0]).SerializeToString()
    planned = plan_request_bytes(payload, time.time() + 60, LIMITS, COST_MODEL, digest="from-the-handler")
    late = plan_request_bytes(payload, time.time() - 1, LIMITS, COST_MODEL, digest="from-the-handler")
    assert planned.code is ErrorCode.OK and late.code is ErrorCode.DEADLINE_EXCEEDED
    assert planned.about.request_digest == late.about.request_digest == "from-the-handler"
    assert plan_request_bytes(payload, time.time() + 60, LIMITS, COST_MODEL).about.request_digest == request_digest(payload)


def test_requests_past_the_inline_bound_go_to_a_worker(pools):
    inline, _ = pools
    bound = inline.inline
    many_samples = PlanRequest.of(tuple(sample_lengths("lognormal_32k", 129, seed=1)), 8, 1, 8192)
    many_ranks = PlanRequest.of(tuple(sample_lengths("lognormal_32k", 64, seed=1)), 16, 2, 8192)
    small = small_requests()[0]
    assert bound.admits(small.num_samples, small.dp_cp_size)
    assert not bound.admits(many_samples.num_samples, many_samples.dp_cp_size)
    assert not bound.admits(many_ranks.num_samples, many_ranks.dp_cp_size)
    assert not InlineBound(0, 16).admits(small.num_samples, small.dp_cp_size)
    result = inline.plan(request_to_proto(many_samples).SerializeToString(), time.time() + 60, timeout=60)
    assert result.code is ErrorCode.OK
    assert inline.tasks_run == 1  # it went to the worker


def test_a_request_that_is_not_one_is_refused_in_the_handler_without_a_worker(pools):
    for pool in pools:
        before = pool.tasks_run
        result = pool.plan(b"\xff\xff not a message", time.time() + 60, timeout=60)
        assert result.code is ErrorCode.INVALID_ARGUMENT and "not a valid PlanRequest" in result.message
        assert result.about.request_digest and pool.tasks_run == before and pool.in_flight == 0


# A server whose only slot an inline request can hold for about a second: one worker, no queue,
# and an inline bound wide enough for 2048 samples on 128 ranks.
SLOW_INLINE = pb.PlanRequest(
    sequence_lengths=sample_lengths("long_tail_16k", 2048, seed=6),
    layout=pb.ParallelLayout(data_parallel_size=128, context_parallel_size=1),
    max_seqlen_per_dp_cp_rank=8192,
    scheduler=pb.SCHEDULER_HYBRID_CP,
)
SMALL = request_to_proto(small_requests()[0])


@pytest.fixture(scope="module")
def server() -> PlannerProcess:
    # SLOW_INLINE must hold the handler thread for about a second: Megatron-Core's own code (the
    # exact path plans it in milliseconds).
    process = start_planner(
        "--max-queued-requests", "0", "--inline-max-samples", "4096", "--inline-max-ranks", "128",
        "--scheduler-implementation", "upstream", workers=1,
    )
    yield process
    process.stop(signal.SIGTERM)


def metrics(server: PlannerProcess) -> dict[tuple[str, tuple], float]:
    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def total(values: dict, name: str, **labels) -> float:
    return sum(v for (n, sample_labels), v in values.items() if n == name and set(labels.items()) <= set(sample_labels))


def test_an_inline_request_holds_a_slot_of_the_overload_bound(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        stub.Plan(SMALL, timeout=60)  # warm the channel
        before = metrics(server)
        slow: dict[str, object] = {}

        def plan_slow() -> None:
            slow["response"] = stub.Plan(SLOW_INLINE, timeout=120)

        thread = threading.Thread(target=plan_slow)
        thread.start()
        # Wait until the server counts the slow request in flight (it plans for about a second).
        in_flight_seen = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and thread.is_alive() and in_flight_seen < 1:
            in_flight_seen = total(metrics(server), "batch_planner_in_flight_requests")
        assert in_flight_seen == 1, "the inline request never showed in batch_planner_in_flight_requests"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Plan(SMALL, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bound is 1" in refused.value.details()
        thread.join(120)
        assert len(slow["response"].micro_batches) > 0
        # The slot is free again once the inline plan is answered.
        assert len(stub.Plan(SMALL, timeout=60).micro_batches) > 0
    after = metrics(server)

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("batch_planner_overload_rejections_total") == 1
    assert delta("batch_planner_requests_total", code="OK") == 2
    assert delta("batch_planner_requests_total", code="RESOURCE_EXHAUSTED") == 1
    assert delta("batch_planner_planned_tokens_total") == sum(SLOW_INLINE.sequence_lengths) + sum(SMALL.sequence_lengths)
    assert total(after, "batch_planner_in_flight_requests") == 0
