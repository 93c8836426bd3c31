"""The planner's /metrics: valid Prometheus exposition, promtool-clean, and counters that move by
exactly what known requests should add. On the session's second planner (other_planner,
tests/conftest.py): the tests that share it make synchronous calls only, none in flight between
tests, so what a test counts between its before and after scrapes is its own requests'."""

from __future__ import annotations

import subprocess
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.convert import plan_from_proto, request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.request import PlanRequest
from tests.support.planner_process import start_planner
from tests.support.reliability_support import sample_value
from batch_planner.v1 import planner_pb2_grpc
from tests.support.deploy_tools import find_tool


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()




def test_counters_move_by_known_amounts(other_planner):
    before = scrape(other_planner.metrics_url)
    lengths = tuple(sample_lengths("long_tail_16k", 128, seed=9))
    request = PlanRequest.of(lengths, 8, 2, 4096, tensor_parallel_size=2, job="metrics-test")
    with grpc.insecure_channel(other_planner.address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        plans = [plan_from_proto(stub.Plan(request_to_proto(request), timeout=60)) for _ in range(3)]
        bad = request_to_proto(request)
        bad.sequence_lengths[0] = 0
        with pytest.raises(grpc.RpcError):
            stub.Plan(bad, timeout=30)
    after = scrape(other_planner.metrics_url)

    def delta(name, **labels):
        return sample_value(after, name, **labels) - sample_value(before, name, **labels)

    stats = plans[0].statistics
    assert delta("batch_planner_requests_total", scheduler="hybrid_cp", code="OK", training_job="metrics-test") == 3
    assert delta("batch_planner_requests_total", scheduler="hybrid_cp", code="INVALID_ARGUMENT", training_job="metrics-test") == 1
    assert delta("batch_planner_planned_tokens_total", training_job="metrics-test") == 3 * sum(lengths)
    assert delta("batch_planner_padding_tokens_total", training_job="metrics-test") == 3 * (stats.padded_tokens - stats.real_tokens)
    assert delta("batch_planner_plan_latency_seconds_count", scheduler="hybrid_cp") == 4
    assert delta("batch_planner_micro_batches_total") == 3 * stats.micro_batch_count
    for cp_size, samples, _ in stats.cp_size_mix:
        assert delta("batch_planner_planned_samples_total", cp_size=str(cp_size)) == 3 * samples
    assert delta("batch_planner_padding_ratio_count") == 3
    assert delta("batch_planner_balance_efficiency_ratio_count") == 3
    assert sample_value(after, "batch_planner_last_predicted_speedup_over_static_cp_ratio", training_job="metrics-test") == (
        pytest.approx(stats.predicted_speedup_over_static_cp)
    )
    assert sample_value(after, "batch_planner_in_flight_requests") == 0
    assert sample_value(after, "batch_planner_invariant_violations_total") == 0
    assert sample_value(after, "batch_planner_scheduler_available", scheduler="hybrid_cp") == 1
    info = [s for f in text_string_to_metric_families(after) for s in f.samples if s.name == "batch_planner_info"]
    assert info and "hybrid_cp" in info[0].labels["schedulers"] and info[0].labels["megatron_core_version"]


def test_the_alignment_padding_is_counted_by_precision(other_planner):
    """FP8's row alignment: of the padding counted, what the precision added (PlanStatistics'
    alignment_padding_tokens), labelled with the plan's precision; a bf16 plan adds no series."""
    from batch_planner.precision import Precision

    lengths = tuple(sample_lengths("long_tail_16k", 64, seed=3))
    fp8 = PlanRequest.of(lengths, 4, 2, 4096, tensor_parallel_size=2, precision=Precision.FP8_BLOCK, job="metrics-fp8")
    bf16 = PlanRequest.of(lengths, 4, 2, 4096, tensor_parallel_size=2, job="metrics-bf16")
    before = scrape(other_planner.metrics_url)
    with grpc.insecure_channel(other_planner.address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        plans = [plan_from_proto(stub.Plan(request_to_proto(fp8), timeout=60)) for _ in range(2)]
        plain = plan_from_proto(stub.Plan(request_to_proto(bf16), timeout=60))
    after = scrape(other_planner.metrics_url)
    name = "batch_planner_alignment_padding_tokens_total"
    aligned = plans[0].statistics.alignment_padding_tokens
    assert plans[0].precision is Precision.FP8_BLOCK and aligned > 0
    assert sample_value(after, name, precision="fp8_block", training_job="metrics-fp8") - sample_value(
        before, name, precision="fp8_block", training_job="metrics-fp8") == 2 * aligned
    padding = sample_value(after, "batch_planner_padding_tokens_total", training_job="metrics-fp8")
    assert padding >= 2 * aligned  # a part of the padding counted
    assert plain.statistics.alignment_padding_tokens == 0
    assert 'training_job="metrics-bf16"' not in "\n".join(line for line in after.splitlines() if line.startswith(name))


def test_exposition_passes_promtool(other_planner):
    promtool = find_tool("promtool")
    text = scrape(other_planner.metrics_url)
    assert "batch_planner_requests_total" in text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_job_label_is_bounded():
    from planner_server.metrics import OTHER_JOB, PlannerMetrics

    metrics = PlannerMetrics(max_job_labels=2)
    assert [metrics.job_label(j) for j in ("a", "b", "c", "a", "")] == ["a", "b", OTHER_JOB, "a", "unnamed"]


def test_a_series_looked_up_once_is_the_one_its_labels_name():
    from planner_server.metrics import PlannerMetrics

    metrics = PlannerMetrics()
    labels = ("dynamic_cp", "OK", "job")
    metrics.child(metrics.requests, *labels).inc()
    metrics.requests.labels(*labels).inc()
    metrics.child(metrics.requests, *labels).inc(2)
    assert metrics.child(metrics.requests, *labels) is metrics.requests.labels(*labels)
    assert metrics.child(metrics.requests, "dynamic_cp", "INTERNAL", "job") is not metrics.child(metrics.requests, *labels)
    assert metrics.registry.get_sample_value(
        "batch_planner_requests_total", {"scheduler": "dynamic_cp", "code": "OK", "training_job": "job"}) == 4


def test_metrics_follow_prometheus_conventions(other_planner):
    """no `job` label of our own, the process collector, no _created series."""
    text = scrape(other_planner.metrics_url)
    families = list(text_string_to_metric_families(text))
    names = {s.name for f in families for s in f.samples}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names
    assert not [n for n in names if n.endswith("_created")]
    assert all("job" not in s.labels for f in families for s in f.samples)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


def test_metrics_port_binds_the_grpc_host_only(other_planner):
    """with --host 127.0.0.1 /metrics listens on loopback, not on every interface."""
    assert _listening_addresses(other_planner.metrics_port) == {"0100007F"}  # 127.0.0.1


def test_calls_grpc_refuses_past_its_concurrency_limit_are_counted():
    """gRPC's own "Concurrent RPC limit exceeded!" refusals show in a metric."""
    from batch_planner.v1 import planner_pb2 as pb
    from tests.support.reliability_support import wait_until

    # One worker, no queue, no extra calls: gRPC accepts one call at a time. The slow call must hold
    # the worker for seconds: Megatron-Core's own code (the exact path plans it in milliseconds).
    server = start_planner(
        "--max-queued-requests", "0", "--extra-concurrent-rpcs", "0", "--scheduler-implementation", "upstream", workers=1
    )
    slow = pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", 16384, seed=1),
        layout=pb.ParallelLayout(data_parallel_size=1024, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192, scheduler=pb.SCHEDULER_HYBRID_CP,
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            running = stub.Plan.future(slow, timeout=120)
            wait_until(lambda: sample_value(scrape(server.metrics_url), "batch_planner_busy_workers") == 1,
                       30, "the one call gRPC allows being planned")
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Concurrent RPC limit" in refused.value.details()
            running.cancel()
        wait_until(lambda: sample_value(scrape(server.metrics_url), "batch_planner_rpc_limit_rejections_total") == 1,
                   30, "the refusal counted")
    finally:
        server.stop()


def test_the_rpc_limit_counts_what_it_refuses_and_frees_calls_whose_behaviour_never_runs():
    """planner_server/rpc_limit.py on its own: a call past the limit is refused and counted; a call
    gRPC ends without running our behaviour (a message that does not deserialize) gives its count
    back, so no caller can leak the limit away."""
    import threading
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from planner_server.rpc_limit import RpcLimit
    from tests.support.reliability_support import wait_until

    refused, entered, leave = [], threading.Event(), threading.Event()
    limit = RpcLimit(1, lambda: refused.append(1))

    def hold(request, context):
        entered.set()
        leave.wait(30)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limit.limit + 16), interceptors=(limit,))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Hold": grpc.unary_unary_rpc_method_handler(hold)}),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            held = channel.unary_unary("/t.T/Hold").future(b"x", timeout=30)
            assert entered.wait(30)
            with pytest.raises(grpc.RpcError) as past:
                check(health_pb2.HealthCheckRequest(), timeout=10)
            assert past.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in past.value.details()
            assert refused == [1]
            leave.set()
            assert held.result(timeout=30) == b"x"
            wait_until(lambda: limit.active == 0, 10, "the held call's count given back")
            with pytest.raises(grpc.RpcError):
                channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff", timeout=10)  # does not deserialize
            wait_until(lambda: limit.active == 0, 10, "the count of a call whose behaviour never ran given back")
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            assert refused == [1]
    finally:
        server.stop(0)
