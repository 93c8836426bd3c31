"""Overload and faults, against one real planner with 2 workers and a queue
bound of 2 (so at most 4 requests in flight):

- past the bound the server answers RESOURCE_EXHAUSTED at once instead of queueing;
- a planning worker killed with SIGKILL, even mid-request, is replaced and every request still
  gets its plan; batch_planner_worker_restarts_total moves;
- SIGTERM drains: in-flight requests complete OK, new ones are refused, health goes NOT_SERVING,
  and the process exits 0. This test stops the server, so it runs last in this file.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.planner_process import PlannerProcess, start_planner
from tests.reliability_support import assert_plan_well_formed, health_status, planning_worker_pids

WORKERS = 2
MAX_QUEUED = 2
CAPACITY = WORKERS + MAX_QUEUED
SLOW_LENGTHS = sample_lengths("long_tail_16k", 2048, seed=6)
SLOW_DP_CP = 128


def slow_request(seed: int = 0) -> pb.PlanRequest:
    """About a second of Megatron-Core scheduling on one core (2048 samples on 128 ranks)."""
    lengths = SLOW_LENGTHS[seed:] + SLOW_LENGTHS[:seed]  # distinct requests, same cost
    return pb.PlanRequest(
        sequence_lengths=lengths,
        layout=pb.ParallelLayout(data_parallel_size=SLOW_DP_CP, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )


@pytest.fixture(scope="module")
def server() -> PlannerProcess:
    process = start_planner("--max-queued-requests", str(MAX_QUEUED), "--drain-seconds", "30", workers=WORKERS)
    yield process
    process.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return planner_pb2_grpc.BatchPlannerStub(channel)


def metric(server: PlannerProcess, name: str) -> float:
    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def timed_plan(stub, request: pb.PlanRequest, timeout: float = 120.0) -> tuple[str, float, pb.PlanResponse | None]:
    started = time.perf_counter()
    try:
        response = stub.Plan(request, timeout=timeout)
        return "OK", time.perf_counter() - started, response
    except grpc.RpcError as error:
        return error.code().name, time.perf_counter() - started, None


def test_past_the_queue_bound_requests_are_refused_at_once(server, stub):
    rejections_before = metric(server, "batch_planner_overload_rejections_total")
    burst = 4 * CAPACITY
    barrier = threading.Barrier(burst)

    def one(seed: int):
        barrier.wait()
        return timed_plan(stub, slow_request(seed))

    with ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, range(burst)))
    ok = [seconds for code, seconds, _ in results if code == "OK"]
    refused = [seconds for code, seconds, _ in results if code == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == burst, [code for code, _, _ in results]
    assert len(ok) >= CAPACITY and len(refused) >= burst - 2 * CAPACITY, (len(ok), len(refused))
    # "At once": a refusal costs no planning time, far less than the plans that were admitted.
    assert max(refused) < 1.0, f"slowest refusal took {max(refused):.2f} s"
    assert sorted(refused)[len(refused) // 2] < min(ok) / 2, (sorted(refused), sorted(ok))
    assert metric(server, "batch_planner_overload_rejections_total") - rejections_before == len(refused)
    # The bound is on requests in flight, not a ban: once the burst is over, a request is planned.
    assert timed_plan(stub, slow_request(1))[0] == "OK"


def test_a_killed_worker_is_replaced_and_the_request_it_held_is_planned(server, channel, stub):
    workers = planning_worker_pids(server.proc.pid)
    assert len(workers) == WORKERS, f"expected {WORKERS} workers under the forkserver, found {workers}"
    restarts_before = metric(server, "batch_planner_worker_restarts_total")
    with ThreadPoolExecutor(WORKERS) as pool:
        in_flight = [pool.submit(timed_plan, stub, slow_request(seed)) for seed in range(10, 10 + WORKERS)]
        time.sleep(0.5)  # both workers are now inside Megatron-Core's scheduler
        os.kill(workers[0], signal.SIGKILL)
        results = [future.result() for future in in_flight]
    for (code, _, response), seed in zip(results, range(10, 10 + WORKERS)):
        assert code == "OK", code
        assert_plan_well_formed(response, list(slow_request(seed).sequence_lengths), SLOW_DP_CP)
    assert metric(server, "batch_planner_worker_restarts_total") >= restarts_before + 1
    replaced = planning_worker_pids(server.proc.pid)
    assert workers[0] not in replaced
    # Kill every worker while idle, then ask again: the next request rebuilds the pool.
    for pid in replaced:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    for seed in range(3):
        assert timed_plan(stub, slow_request(seed))[0] == "OK"
    assert metric(server, "batch_planner_worker_restarts_total") >= restarts_before + 2
    assert health_status(channel) == "SERVING"


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(server):
    channel = grpc.insecure_channel(server.address)
    stub = planner_pb2_grpc.BatchPlannerStub(channel)
    health_updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    first = next(health_updates)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    admitted = WORKERS + 1  # below the bound, so a late request is refused for the drain, not the bound
    with ThreadPoolExecutor(admitted) as pool:
        in_flight = [pool.submit(timed_plan, stub, slow_request(seed)) for seed in range(20, 20 + admitted)]
        time.sleep(0.5)  # two planning, one queued
        server.proc.send_signal(signal.SIGTERM)
        # Health goes NOT_SERVING (seen on the watch opened before the signal) ...
        update = next(health_updates)
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        health_updates.cancel()  # an open watch would hold the drain until --drain-seconds
        # ... a new request is refused while the old ones still run ...
        late = grpc.insecure_channel(server.address)
        code, seconds, _ = timed_plan(planner_pb2_grpc.BatchPlannerStub(late), slow_request(99), timeout=10)
        assert code == "UNAVAILABLE", code
        assert health_status(late) == "NOT_SERVING"  # what a readiness probe sees during the drain
        late.close()
        # ... and every request admitted before the signal completes with its plan.
        results = [future.result() for future in in_flight]
    assert [code for code, _, _ in results] == ["OK"] * admitted
    assert server.proc.wait(60) == 0
    assert "draining" in server.log and "stopped" in server.log
    channel.close()
