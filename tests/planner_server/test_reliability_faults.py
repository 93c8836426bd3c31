"""Overload and faults, against one real planner with 2 workers and a queue
bound of 2 (so at most 4 requests in flight):

- past the bound the server answers RESOURCE_EXHAUSTED at once instead of queueing;
- a plan whose caller is gone (deadline passed, call cancelled) stops costing a worker: the worker
  is killed and replaced, its slot given back, and the next caller is served as if nothing happened;
- a planning worker killed with SIGKILL, even mid-request, is replaced and every request still
  gets its plan; batch_planner_worker_restarts_total counts each process replaced; while no
  worker runs, a request is answered UNAVAILABLE at once, never held until one is back;
- the forkserver killed under load: its workers plan on, every request gets its plan, and a new
  forkserver is started beside them; a storm of worker kills: answers are plans or UNAVAILABLE
  (retryable), never INTERNAL, and the pool recovers;
- the gRPC port opens only once the workers are warm (a connection made earlier is refused, so a
  replica restarted on its address gets no call it cannot plan); SIGTERM during the warm-up exits 0
  without a traceback;
- SIGTERM drains: in-flight requests complete OK, new ones are refused, health goes NOT_SERVING,
  and the process exits 0, within --drain-seconds even with abandoned plans about; a terminal's
  Ctrl-C followed by SIGTERM drains once, with no traceback. The tests that stop a server run last
  in this file.

Every wait is on something the server shows (a metric, a process, an answer), never a guessed
duration.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from planner_server import __version__
from tests.support.launch import free_port
from tests.support.planner_process import PlannerProcess, start_planner
from tests.support.reliability_support import (
    assert_plan_well_formed,
    forkserver_pid,
    health_status,
    metric,
    planning_worker_pids,
    sample_value,
    wait_for_metric,
    wait_until,
)

WORKERS = 2
# These tests need plans that keep a worker busy for seconds: Megatron-Core's own code, which the
# exact path (batch_planner/exact) would plan in milliseconds.
SLOW_CODE = ("--scheduler-implementation", "upstream")
MAX_QUEUED = 2
CAPACITY = WORKERS + MAX_QUEUED
SLOW_LENGTHS = sample_lengths("long_tail_16k", 2048, seed=6)
SLOW_DP_CP = 128


def slow_request(seed: int = 0) -> pb.PlanRequest:
    """About a second of Megatron-Core's own scheduling on one core (2048 samples on 128 ranks)."""
    lengths = SLOW_LENGTHS[seed:] + SLOW_LENGTHS[:seed]  # distinct requests, same cost
    return pb.PlanRequest(
        sequence_lengths=lengths,
        layout=pb.ParallelLayout(data_parallel_size=SLOW_DP_CP, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )


@pytest.fixture(scope="module")
def server() -> PlannerProcess:
    # One job sends every request here, and the tests are about the total bound: no per-job share
    # (tests/planner_server/test_admission.py checks the share).
    process = start_planner(
        "--max-queued-requests", str(MAX_QUEUED), "--drain-seconds", "30", "--max-job-share", "1.0", *SLOW_CODE,
        workers=WORKERS,
    )
    yield process
    process.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return planner_pb2_grpc.BatchPlannerStub(channel)


def huge_request(seed: int = 0) -> pb.PlanRequest:
    """The default limits' largest request: 16,384 samples on 1,024 ranks, tens of seconds of
    Megatron-Core's own scheduling on one core."""
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", 16384, seed=seed),
        layout=pb.ParallelLayout(data_parallel_size=1024, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )


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


def test_plans_whose_deadline_passed_stop_costing_workers(server, stub):
    """two abandoned 16,384-sample plans must not hold the workers a later caller needs."""
    _, alone, _ = timed_plan(stub, slow_request(30))
    abandoned_before = metric(server, "batch_planner_worker_restarts_total", reason="abandoned")
    with ThreadPoolExecutor(WORKERS) as pool:
        codes = list(pool.map(lambda seed: timed_plan(stub, huge_request(seed), timeout=1.0)[0], range(WORKERS)))
    assert codes == ["DEADLINE_EXCEEDED"] * WORKERS, codes
    # While both workers are replaced, a call is answered UNAVAILABLE at once (the client tries
    # another replica), never held; once they run, the later caller pays no abandoned plan's time.
    wait_for_metric(server, "batch_planner_worker_restarts_total", lambda v: v == abandoned_before + WORKERS,
                    "both abandoned workers killed", reason="abandoned")
    wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacements running")
    code, after, _ = timed_plan(stub, slow_request(31))
    assert code == "OK"
    assert after < alone + 2.0, f"{after:.2f} s after abandoned plans, {alone:.2f} s alone"
    assert metric(server, "batch_planner_worker_restarts_total", reason="abandoned") == abandoned_before + WORKERS
    wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v == 0, "no slot held")


def test_cancelled_calls_give_back_their_slots_and_workers(server, stub):
    """a cancelled call keeps neither its slot in the bound nor its worker."""
    calls = [stub.Plan.future(huge_request(seed), timeout=120) for seed in range(CAPACITY)]
    wait_for_metric(server, "batch_planner_busy_workers", lambda v: v == WORKERS, "both workers planning")
    for call in calls:
        call.cancel()
    wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v == 0, "the cancelled calls' slots back")
    wait_for_metric(server, "batch_planner_busy_workers", lambda v: v == 0, "the cancelled plans stopped")
    wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacements running")
    with ThreadPoolExecutor(CAPACITY) as pool:
        codes = [code for code, _, _ in pool.map(lambda seed: timed_plan(stub, slow_request(seed)), range(CAPACITY))]
    assert codes == ["OK"] * CAPACITY, codes


def test_a_killed_worker_is_replaced_and_the_request_it_held_is_planned(server, channel, stub):
    workers = wait_until(lambda: len(planning_worker_pids(server.proc.pid)) == WORKERS
                         and planning_worker_pids(server.proc.pid), 30, f"{WORKERS} workers")
    died_before = metric(server, "batch_planner_worker_restarts_total", reason="died")
    with ThreadPoolExecutor(WORKERS) as pool:
        in_flight = [pool.submit(timed_plan, stub, slow_request(seed)) for seed in range(10, 10 + WORKERS)]
        wait_for_metric(server, "batch_planner_busy_workers", lambda v: v == WORKERS, "both workers planning")
        os.kill(workers[0], signal.SIGKILL)
        results = [future.result() for future in in_flight]
    for (code, _, response), seed in zip(results, range(10, 10 + WORKERS)):
        assert code == "OK", code
        assert_plan_well_formed(response, list(slow_request(seed).sequence_lengths), SLOW_DP_CP)
    # One process died, one was replaced: the counter counts processes.
    assert metric(server, "batch_planner_worker_restarts_total", reason="died") == died_before + 1
    replaced = planning_worker_pids(server.proc.pid)
    assert workers[0] not in replaced and len(replaced) == WORKERS
    # Kill every worker while idle, then ask again at once: no request waits for the replacements
    # (UNAVAILABLE at once, which clients retry on another replica); once they run, plans again.
    wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacement running")
    for pid in replaced:
        os.kill(pid, signal.SIGKILL)
    code, seconds, _ = timed_plan(stub, slow_request(0))
    assert code in ("OK", "UNAVAILABLE") and (code == "OK" or seconds < 1.0), (code, seconds)
    wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacements running")
    for seed in range(3):
        assert timed_plan(stub, slow_request(seed))[0] == "OK"
    wait_for_metric(server, "batch_planner_worker_restarts_total", lambda v: v == died_before + 1 + WORKERS,
                    "each killed worker replaced", reason="died")
    assert health_status(channel) == "SERVING"


def test_a_killed_forkserver_leaves_its_workers_planning_and_a_new_one_starts(server, channel, stub):
    """the forkserver is needed only to start workers: no request waits for a new one."""
    workers = planning_worker_pids(server.proc.pid)
    restarts = metric(server, "batch_planner_worker_restarts_total", reason="forkserver")
    died = metric(server, "batch_planner_worker_restarts_total", reason="died")
    with ThreadPoolExecutor(CAPACITY) as pool:
        in_flight = [pool.submit(timed_plan, stub, slow_request(seed)) for seed in range(40, 40 + CAPACITY)]
        wait_for_metric(server, "batch_planner_busy_workers", lambda v: v == WORKERS, "both workers planning")
        os.kill(forkserver_pid(server.proc.pid), signal.SIGKILL)
        results = [future.result() for future in in_flight]
    # The workers outlive their forkserver: the plans they hold, and the queued ones, are planned.
    assert [code for code, _, _ in results] == ["OK"] * CAPACITY, results
    wait_for_metric(server, "batch_planner_worker_restarts_total", lambda v: v > restarts, "a new forkserver", reason="forkserver")
    for seed in range(3):
        assert timed_plan(stub, slow_request(seed))[0] == "OK"
    assert metric(server, "batch_planner_worker_restarts_total", reason="died") == died  # no worker lost
    # Once the old workers die (seen at their next task), their replacements fork from the new
    # forkserver; meanwhile every request is answered, a plan or UNAVAILABLE.
    for pid in workers:
        os.kill(pid, signal.SIGKILL)

    def replaced() -> bool:
        code = timed_plan(stub, slow_request(1))[0]
        assert code in ("OK", "UNAVAILABLE"), code
        return code == "OK" and len(planning_worker_pids(server.proc.pid)) == WORKERS

    wait_until(replaced, 120, "replacements under the new forkserver planning")
    assert health_status(channel) == "SERVING"


def test_a_storm_of_worker_kills_answers_unrelated_requests_with_plans_or_unavailable(server, channel, stub):
    """workers dying again and again are our transient failure: UNAVAILABLE, never INTERNAL."""
    stop = threading.Event()
    killed: set[int] = set()

    def storm():
        while not stop.is_set() and len(killed) < 8:
            for pid in set(planning_worker_pids(server.proc.pid)) - killed:
                killed.add(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)  # a poll of the process table, not a guess

    killer = threading.Thread(target=storm)
    killer.start()
    with ThreadPoolExecutor(CAPACITY) as pool:
        codes = [code for code, _, _ in pool.map(lambda seed: timed_plan(stub, slow_request(seed)), range(50, 58))]
    stop.set()
    killer.join()
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacements running")
    assert timed_plan(stub, slow_request(1))[0] == "OK"
    assert health_status(channel) == "SERVING"


def test_the_port_opens_only_once_the_workers_are_warm():
    """Whenever a connection to the gRPC port succeeded, the warm-up had ended: the metrics page
    (served from before the warm-up) already showed the build info set after it."""
    port, metrics_port = free_port(), free_port()
    server = start_planner("--metrics-port", str(metrics_port), workers=1, port=port, wait_serving=False)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    refused = 0
    try:
        while True:
            assert server.proc.poll() is None, server.log
            try:
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
                break
            except ConnectionRefusedError:
                refused += 1
                time.sleep(0.01)
        with urllib.request.urlopen(url, timeout=10) as page:
            built = sample_value(page.read().decode(), "batch_planner_info", version=__version__)
        assert built == 1, f"the port accepted a connection before the warm-up ended ({refused} refused before)"
        with grpc.insecure_channel(server.address) as channel:  # and the first call is planned
            lengths = [4096, 100, 7]
            request = pb.PlanRequest(sequence_lengths=lengths, layout=pb.ParallelLayout(data_parallel_size=4, context_parallel_size=1),
                                     max_seqlen_per_dp_cp_rank=4096, scheduler=pb.SCHEDULER_HYBRID_CP)
            assert_plan_well_formed(planner_pb2_grpc.BatchPlannerStub(channel).Plan(request, timeout=60), lengths, 4)
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_during_the_warm_up_exits_0_without_a_traceback():
    port = free_port()
    server = start_planner(workers=1, port=port, wait_serving=False)
    try:
        wait_until(lambda: "warming up" in server.log, 120, "the server warming up")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log
        assert server.log.count("draining:") == 1 and "Traceback" not in server.log, server.log
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(server):
    channel = grpc.insecure_channel(server.address)
    stub = planner_pb2_grpc.BatchPlannerStub(channel)
    health_updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    first = next(health_updates)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    admitted = WORKERS + 1  # below the bound, so a late request is refused for the drain, not the bound
    with ThreadPoolExecutor(admitted) as pool:
        in_flight = [pool.submit(timed_plan, stub, slow_request(seed)) for seed in range(20, 20 + admitted)]
        wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v == admitted, "all three admitted")
        server.proc.send_signal(signal.SIGTERM)
        # Health goes NOT_SERVING (seen on the watch opened before the signal) ...
        update = next(health_updates)
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        health_updates.cancel()  # an open watch would hold the drain until --drain-seconds
        # ... a new request is refused while the old ones still run ...
        late = grpc.insecure_channel(server.address)
        code, seconds, _ = timed_plan(planner_pb2_grpc.BatchPlannerStub(late), slow_request(99), timeout=10)
        assert code == "UNAVAILABLE", code
        assert health_status(late) == "NOT_SERVING"
        late.close()
        # What the kubelet sees on the probe port: not ready, but alive.
        with grpc.insecure_channel(f"127.0.0.1:{server.probe_port}") as probes:
            assert health_status(probes) == "NOT_SERVING"
            assert health_status(probes, "liveness") == "SERVING"
        # ... and every request admitted before the signal completes with its plan.
        results = [future.result() for future in in_flight]
    assert [code for code, _, _ in results] == ["OK"] * admitted
    assert server.proc.wait(60) == 0
    assert "draining" in server.log and "stopped" in server.log
    channel.close()


def test_sigterm_drain_ends_within_drain_seconds_with_abandoned_plans_about():
    """abandoned plans do not hold the drain past --drain-seconds."""
    drain = 5.0
    server = start_planner("--drain-seconds", str(drain), "--max-job-share", "1.0", *SLOW_CODE, workers=WORKERS)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            with ThreadPoolExecutor(WORKERS) as pool:
                codes = list(pool.map(lambda seed: timed_plan(stub, huge_request(seed), timeout=1.0)[0], range(WORKERS)))
            assert codes == ["DEADLINE_EXCEEDED"] * WORKERS, codes
            # The drain waits on the slots in flight: the abandoned plans' come back once their
            # workers are killed, so only the honest call's is left for the drain to wait on.
            wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v == 0, "the abandoned plans' slots back")
            # (Until a replacement runs, a call would be answered UNAVAILABLE at once.)
            wait_for_metric(server, "batch_planner_live_workers", lambda v: v == WORKERS, "the replacements running")
            honest = stub.Plan.future(slow_request(0), timeout=60)
            wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v >= 1, "the honest call admitted")
            server.proc.send_signal(signal.SIGTERM)
            assert honest.result() is not None
            assert server.proc.wait(60) == 0
        assert "slots in flight; stopping their work" not in server.log, "abandoned plans held the drain to its end"
    finally:
        server.stop(signal.SIGKILL)


def test_ctrl_c_then_sigterm_drains_once_and_exits_0_without_a_traceback():
    """What `./dev run` gets on Ctrl-C: the terminal's SIGINT to the whole process group (server,
    forkserver, workers), then its trap's SIGTERM to the server."""
    server = start_planner(workers=WORKERS)
    try:
        assert len(planning_worker_pids(server.proc.pid)) == WORKERS
        os.killpg(server.proc.pid, signal.SIGINT)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert server.output_closed.wait(60), "a process of the server kept its output open"
        assert server.log.count("draining:") == 1, server.log
        assert server.log.count("stopped") == 1, server.log
        assert "Traceback" not in server.log, server.log
    finally:
        server.stop(signal.SIGKILL)
