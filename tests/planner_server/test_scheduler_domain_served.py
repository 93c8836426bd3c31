"""The scheduler domain through a real server and the trainer client (tests/batch_planner/
test_scheduler_domain.py holds the reproducers, the substitutes and the in-process half):

- The substitutes through the server: named, counted, logged, with the in-process plan id; the
  trainer client gets the same, with and without a service.
- The reproducers through the server and the trainer client: the in-process answer, never INTERNAL,
  a refusal not planned in process again.
- A server on upstream's own code (`--scheduler-implementation upstream`) cuts loops off within the
  deadline, inline and on a worker.
- SIGTERM while upstream code loops in a worker and in a handler thread (a server whose domain
  check is switched off, tests/planner_server/unbounded_domain): the process ends within --drain-seconds + 5 s.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from batch_planner.convert import request_to_proto
from batch_planner.planner import plan_batch
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.batch_planner.test_scheduler_domain import (
    DYNAMIC, IDS, LOOPS_INLINE, LOOPS_ON_A_WORKER, REPRODUCERS, SUBSTITUTED, SUBSTITUTED_IDS, _answer, _available, _client,
)
from tests.support.megatron_builds import require_scheduler
from tests.support.planner_process import ROOT, start_planner
from tests.support.reliability_support import metric, wait_for_metric, wait_until


@pytest.mark.parametrize("name, request_, reason", SUBSTITUTED, ids=SUBSTITUTED_IDS)
def test_substitutes_through_the_server_are_named_counted_logged_and_get_the_in_process_id(planner, stub, name, request_, reason):
    _available(request_)
    expected = plan_batch(request_)
    labels = {"scheduler": "dynamic_cp", "reason": reason.value}
    before = metric(planner, "batch_planner_substituted_total", **labels)
    response = stub.Plan(request_to_proto(request_), timeout=30)
    assert response.plan_id == expected.plan_id
    # Counted under its reason, and logged with the request's plan id and what it stands in for.
    wait_for_metric(planner, "batch_planner_substituted_total", lambda v: v == before + 1, "the substitute counted", **labels)
    wait_until(lambda: f"plan_id={expected.plan_id}" in planner.log and f"substitute_reason={reason.value}" in planner.log or None,
               30, "the substitute logged")
    assert response.scheduler == pb.SCHEDULER_STATIC_PACKING and response.HasField("substitution")
    assert response.substitution.requested == pb.SCHEDULER_DYNAMIC_CP
    assert pb.SubstituteReason.Name(response.substitution.reason) == f"SUBSTITUTE_REASON_{reason.name}"
    assert response.substitution.detail == expected.substitution.detail


@pytest.mark.parametrize("with_service", [False, True], ids=["in-process-fallback", "service"])
def test_the_trainer_client_gets_the_substitute_with_the_same_id(planner, with_service):
    name, request_, reason = SUBSTITUTED[0]
    _available(request_)
    expected = plan_batch(request_)
    client = _client(request_, planner.address if with_service else "")
    try:
        plan = client.plan_step(0, list(request_.sequence_lengths))
    finally:
        client.close()
    plan = getattr(plan, "plan", plan)
    assert plan.plan_id == expected.plan_id and plan.substitution == expected.substitution


@pytest.mark.parametrize("name, request_, code, field", REPRODUCERS, ids=IDS)
def test_reproducers_through_the_server_get_the_in_process_answer(stub, name, request_, code, field):
    _available(request_)
    expected = _answer(request_)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Plan(request_to_proto(request_), timeout=30)
    assert caught.value.code().name == code
    assert caught.value.details() == str(expected)


@pytest.mark.parametrize("with_service", [False, True], ids=["in-process-fallback", "service"])
@pytest.mark.parametrize("name, request_, code, field", REPRODUCERS, ids=IDS)
def test_the_trainer_client_raises_the_same_clear_error_at_once(planner, name, request_, code, field, with_service):
    """Without a service the client plans in process: validation refuses before any scheduler
    runs; with one, the refusal is not retried and not planned in process again (REJECT)."""
    from trainer_client.service.rpc_client import PlanRejectedError

    _available(request_)
    expected = _answer(request_)
    client = _client(request_, planner.address if with_service else "")
    try:
        with pytest.raises(PlanRejectedError) as caught:
            client.plan_step(0, list(request_.sequence_lengths))
        fallbacks = sum(s.value for m in client.metrics.registry.collect() if m.name == "batch_planner_client_fallbacks"
                        for s in m.samples if s.name.endswith("_total"))
    finally:
        client.close()
    assert caught.value.code == code and caught.value.server_message == str(expected)
    assert fallbacks == 0, "a refusal was planned in process again"


# --- upstream's own code on the server: a loop cut off within the deadline -----------------------


def test_a_server_on_upstreams_own_code_cuts_loops_off_within_the_deadline_inline_and_on_a_worker():
    """`--scheduler-implementation upstream`: the two looping reproducers, one planned inline in a
    handler thread and one on a worker, each with a 4 s deadline. Each is cut off before its
    deadline and answered with the substitute (not DEADLINE_EXCEEDED, not INTERNAL), with the exact
    path's plan id; the worker and the handler are free again: the next requests are planned."""
    require_scheduler(DYNAMIC)
    server = start_planner("--inline-max-ranks", "16", "--inline-max-samples", "128", "--scheduler-implementation", "upstream",
                           workers=1)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            for request_ in (LOOPS_INLINE, LOOPS_ON_A_WORKER):
                response = stub.Plan(request_to_proto(request_), timeout=4.0)
                assert response.plan_id == plan_batch(request_).plan_id
                assert response.substitution.reason == pb.SUBSTITUTE_REASON_UPSTREAM_LOOP
                assert "cut off" in response.substitution.detail, response.substitution.detail
            for request_ in (LOOPS_INLINE.replace(micro_batch_group_size=None), LOOPS_ON_A_WORKER.replace(micro_batch_group_size=None)):
                stub.Plan(request_to_proto(request_), timeout=30)
    finally:
        server.stop()


# --- shutdown while upstream code loops ----------------------------------------------------------


def test_sigterm_ends_the_server_within_drain_seconds_while_upstream_loops_inline_and_on_a_worker(monkeypatch):
    """The domain check switched off (tests/planner_server/unbounded_domain) and Megatron-Core's own code
    (scheduler_implementation=upstream): the two looping reproducers really loop, one in a gRPC
    handler thread (12 ranks, 6 samples: inline) and one on a worker (48 ranks)."""
    require_scheduler(DYNAMIC)
    drain = 2.0
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'planner_server' / 'unbounded_domain'}")
    server = start_planner(
        "--drain-seconds", str(drain), "--inline-max-ranks", "16", "--inline-max-samples", "128",
        "--scheduler-implementation", "upstream", workers=1,
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            calls = [stub.Plan.future(request_to_proto(r), timeout=120) for r in (LOOPS_INLINE, LOOPS_ON_A_WORKER)]
            wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v >= 2, "both plans running")
            wait_for_metric(server, "batch_planner_busy_workers", lambda v: v >= 1, "the worker planning")
            assert not any(call.done() for call in calls), "a looping plan returned"
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(drain + 30)
            took = time.monotonic() - started
        assert took < drain + 5, f"the server took {took:.1f} s to exit after SIGTERM, --drain-seconds is {drain}"
        assert "still planning inline" in server.log or "did not finish" in server.log, server.log[-2000:]
    finally:
        server.stop(signal.SIGKILL)
