"""The client's retries are gRPC's own (the channel's retryPolicy, built from the client config and
batch_planner.errors.CLIENT_ACTION), inside the call's deadline, plus one more call when a call
stalls past hedge_after_seconds or fails; every Plan call carries the job name as metadata. A
scripted planner of the test's own counts the attempts the server sees. The channel waits for a
server slow to answer a new connection."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from trainer_client.service.config import PlannerClientConfig
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.service.rpc_client import PlannerRpcClient, PlanRejectedError, ServiceFailedError, hedge_delay

REQUEST = pb.PlanRequest(job="retry-test")


class ScriptedPlanner(planner_pb2_grpc.BatchPlannerServicer):
    """Answers attempt i with codes[i] (OK past the end); "hang" holds the attempt until the
    client gives up. Records every attempt's metadata."""

    def __init__(self, codes: list[str]):
        self.codes = codes
        self.attempts: list[dict[str, str]] = []
        self.gone = threading.Event()

    def Plan(self, request, context):  # noqa: N802 - gRPC's method name
        self.attempts.append(dict(context.invocation_metadata()))
        code = self.codes[len(self.attempts) - 1] if len(self.attempts) <= len(self.codes) else "OK"
        if code == "hang":
            context.add_callback(self.gone.set)
            assert self.gone.wait(30)
            return pb.PlanResponse()
        if code != "OK":
            context.abort(grpc.StatusCode[code], f"scripted {code}")
        return pb.PlanResponse()


@pytest.fixture
def scripted():
    servers = []

    def start(codes: list[str], **config) -> tuple[ScriptedPlanner, PlannerRpcClient]:
        planner = ScriptedPlanner(codes)
        server = grpc.server(futures.ThreadPoolExecutor(4))
        planner_pb2_grpc.add_BatchPlannerServicer_to_server(planner, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        values = dict(planner_endpoint=f"127.0.0.1:{port}", max_seqlen_per_dp_cp_rank=4096, job="retry-test")
        client = PlannerRpcClient(PlannerClientConfig(**{**values, **config}), TrainerMetrics(job="retry-test"))
        servers.append((server, client))
        return planner, client

    yield start
    for server, client in servers:
        client.close()
        server.stop(None)


def counter(client: PlannerRpcClient, name: str, **labels: str) -> float:
    value = client.metrics.registry.get_sample_value(f"batch_planner_client_{name}_total", {"training_job": "retry-test", **labels})
    return value or 0.0


def calls(client: PlannerRpcClient) -> float:
    return client.metrics.registry.get_sample_value(
        "batch_planner_client_rpc_latency_seconds_count", {"training_job": "retry-test"}
    )


def test_retryable_codes_are_retried_by_grpc_up_to_max_attempts(scripted):
    planner, client = scripted(["UNAVAILABLE", "RESOURCE_EXHAUSTED"], max_attempts=3, initial_backoff_seconds=0.01)
    assert pb.PlanResponse.FromString(client.plan_bytes(REQUEST)) == pb.PlanResponse()
    assert len(planner.attempts) == 3 and calls(client) == 1  # one call, three attempts
    assert [a.get("grpc-previous-rpc-attempts") for a in planner.attempts] == [None, "1", "2"]
    assert all(a[JOB_METADATA_KEY] == "retry-test" for a in planner.attempts)


def test_attempts_run_out_on_two_calls_then_the_service_failed(scripted):
    planner, client = scripted(["UNAVAILABLE"] * 5, max_attempts=2, initial_backoff_seconds=0.01)
    with pytest.raises(ServiceFailedError) as failure:
        client.plan_bytes(REQUEST)
    # gRPC's two attempts, then a second call (to the next replica) with its two: the whole service.
    assert failure.value.reason == "unavailable" and len(planner.attempts) == 4 and calls(client) == 1
    assert failure.value.whole_service
    assert counter(client, "failovers", reason="unavailable") == 1
    assert counter(client, "service_failures", scope="service") == 1


def test_a_failed_call_is_sent_again_within_the_deadline(scripted):
    planner, client = scripted(["UNAVAILABLE", "UNAVAILABLE"], max_attempts=2, initial_backoff_seconds=0.01)
    assert pb.PlanResponse.FromString(client.plan_bytes(REQUEST)) == pb.PlanResponse()
    assert len(planner.attempts) == 3 and counter(client, "failovers", reason="unavailable") == 1


def test_a_stalled_call_is_hedged_and_the_first_answer_wins(scripted):
    planner, client = scripted(["hang"], deadline_seconds=30.0, hedge_after_seconds=0.2)
    assert pb.PlanResponse.FromString(client.plan_bytes(REQUEST)) == pb.PlanResponse()
    assert len(planner.attempts) == 2 and counter(client, "failovers", reason="stalled") == 1
    assert planner.gone.wait(30)  # the stalled call was cancelled: the server stops its work


def test_one_call_that_runs_out_of_time_is_one_replicas_failure(scripted):
    """No time left for a second call, while a replica is connected: this step falls back, and no
    cooldown starts (plan_source)."""
    planner, client = scripted(["hang"], deadline_seconds=0.5, hedge_after_seconds=0)
    with pytest.raises(ServiceFailedError) as failure:
        client.plan_bytes(REQUEST)
    assert failure.value.reason == "deadline_exceeded" and not failure.value.whole_service
    assert counter(client, "service_failures", scope="replica") == 1


@pytest.mark.parametrize("code, error", [("INTERNAL", ServiceFailedError), ("INVALID_ARGUMENT", PlanRejectedError)])
def test_fallback_and_reject_codes_are_not_retried(scripted, code, error):
    planner, client = scripted([code], max_attempts=4)
    with pytest.raises(error):
        client.plan_bytes(REQUEST)
    assert len(planner.attempts) == 1


def test_the_deadline_bounds_the_call_with_its_retries(scripted):
    planner, client = scripted(["hang"], max_attempts=3, deadline_seconds=0.5)
    with pytest.raises(ServiceFailedError) as failure:
        client.plan_bytes(REQUEST)
    assert failure.value.reason == "deadline_exceeded"
    assert planner.gone.wait(30) and len(planner.attempts) == 1  # no attempt after the deadline


def test_a_request_without_a_job_sends_no_job_metadata(scripted):
    planner, client = scripted([])
    client.plan_bytes(pb.PlanRequest())
    assert JOB_METADATA_KEY not in planner.attempts[0]


def test_a_call_counts_as_stalled_past_the_floor_and_twice_the_slowest_recent_call():
    assert hedge_delay(1.0, []) == 1.0
    assert hedge_delay(1.0, [0.01, 0.3]) == 1.0
    assert hedge_delay(1.0, [0.2, 3.0, 0.5]) == 6.0  # plans of seconds are not planned twice
    assert hedge_delay(0.0, [0.2]) is None  # hedging off


def test_answered_calls_set_the_hedge_delay(scripted):
    planner, client = scripted([], hedge_after_seconds=0.2)
    client.plan_bytes(REQUEST)
    assert len(client.recent_latencies) == 1 and client.recent_latencies[0] > 0


def test_one_replicas_failure_plans_this_step_in_process_and_starts_no_cooldown(scripted):
    from batch_planner.request import PlanRequest
    from trainer_client.service.plan_source import FALLBACK, PlanSource

    planner, client = scripted(["hang"], deadline_seconds=0.5, hedge_after_seconds=0)
    source = PlanSource(client.config, client.metrics)
    try:
        sourced = source.plan(PlanRequest.of((300, 200, 100, 50), 2, 1, 4096, job="retry-test"))
        assert sourced.source == FALLBACK
        assert source._outage_reason is None  # the next step asks the service again
        assert counter(client, "fallbacks", reason="deadline_exceeded") == 1
    finally:
        source.close()


class _AnsweredCall:
    """A gRPC call future that has already ended when it is made (the order a loaded machine can
    give: the second call's answer arrives before the first call's failure is handled)."""

    def __init__(self, code: grpc.StatusCode | None):
        self.code = code

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, callback) -> None:
        callback(self)

    def exception(self):
        return None if self.code is None else _Failed(self.code)

    def result(self) -> bytes:
        return pb.PlanResponse().SerializeToString()


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"scripted {self._code.name}"


def test_an_answer_that_arrives_before_the_first_failure_is_handled_wins(scripted):
    """The first call fails with a RETRY code; the second call, sent then, has answered by the time
    the failure's handling asks whether every call ended: that answer is the plan, not a failure of
    the whole service (which would plan in-process and throw away a served plan)."""
    _, client = scripted([], max_attempts=2)
    answers = iter([_AnsweredCall(grpc.StatusCode.UNAVAILABLE), _AnsweredCall(None)])
    client._plan = type("Calls", (), {"future": lambda self, *args, **kwargs: next(answers)})()
    assert pb.PlanResponse.FromString(client.plan_bytes(REQUEST)) == pb.PlanResponse()
    assert counter(client, "failovers", reason="unavailable") == 1


class SlowToAnswer:
    """A TCP relay to 127.0.0.1:`port` that holds the server's first bytes on each connection (its
    HTTP/2 SETTINGS frame, which ends gRPC's connection attempt) for `hold` seconds, as a server on a
    busy machine is slow to answer a new connection. Counts the connections."""

    def __init__(self, port: int, hold: float):
        self.port, self.hold = port, hold
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets = [self.listener]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            far = socket.create_connection(("127.0.0.1", self.port))
            self.sockets += [near, far]
            threading.Thread(target=self._relay, args=(near, far, 0.0), daemon=True).start()
            threading.Thread(target=self._relay, args=(far, near, self.hold), daemon=True).start()

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket, hold: float) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(hold)  # the slowness itself, on the first bytes only
                hold = 0.0
                sink.sendall(data)
        except OSError:  # the other side closed
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def test_a_planner_slow_to_answer_a_new_connection_is_reached(scripted):
    """gRPC gives a connection attempt at least grpc.min_reconnect_backoff_ms, and the attempt ends
    only with the server's first frame. The client leaves that at gRPC's 20 s: a server whose first
    frame comes 2 s after the connection, later than the reconnect backoff ever grows
    (max_reconnect_backoff_seconds = 1, plus jitter), is reached on the first connection, within the
    plan's deadline, with no call sent again."""
    planner, direct = scripted([])
    relay = SlowToAnswer(int(direct.config.planner_endpoint.rsplit(":", 1)[1]), hold=2.0)
    config = PlannerClientConfig(planner_endpoint=relay.address, max_seqlen_per_dp_cp_rank=4096, job="retry-test",
                                 deadline_seconds=10.0, hedge_after_seconds=0, max_reconnect_backoff_seconds=1.0)
    client = PlannerRpcClient(config, TrainerMetrics(job="retry-test"))
    try:
        assert pb.PlanResponse.FromString(client.plan_bytes(REQUEST)) == pb.PlanResponse()
        assert len(planner.attempts) == 1 and counter(client, "failovers", reason="unavailable") == 0
        assert relay.connections == 1
    finally:
        client.close()
        relay.close()
