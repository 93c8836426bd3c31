"""Planning several steps ahead: up to `plan_ahead_depth` plans in flight at once, bounded memory,
stale steps dropped, and the lead (plan arrival to its step) measured and exported. Unit tests
gate a stand-in planning function on events; the last test uses a real planner server."""

from __future__ import annotations

import threading

import pytest

from batch_planner.distributions import sample_lengths
from batch_planner.request import PlanRequest
from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchPlannerClient, PlannerClientConfig
from trainer_client.service.ahead import PlanAhead
from trainer_client.service.config import MAX_PLAN_AHEAD_DEPTH, ConfigError
from trainer_client.service.plan_source import SERVICE, SourcedPlan

WAIT_S = 30.0  # the longest any event below may take; never reached when the code is right


class GatedPlanner:
    """A planning function that blocks each call until its request's gate opens."""

    def __init__(self):
        self.started: list[PlanRequest] = []
        self.gates: dict[int, threading.Event] = {}
        self._cond = threading.Condition()

    def gate(self, request: PlanRequest) -> threading.Event:
        return self.gates.setdefault(request.sequence_lengths[0], threading.Event())

    def __call__(self, request: PlanRequest) -> SourcedPlan:
        with self._cond:
            self.started.append(request)
            self._cond.notify_all()
        assert self.gate(request).wait(WAIT_S)
        return SourcedPlan(plan=request, source=SERVICE)  # type: ignore[arg-type]  # stands in for a Plan

    def wait_started(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.started) >= count, WAIT_S)


def arrived(ahead: PlanAhead, step: int, timeout: float) -> bool:
    """Waits up to `timeout` for `step`'s prefetched plan; True once it has arrived."""
    pending = ahead._pending.get(step)
    if pending is None:
        return False
    try:
        pending.future.exception(timeout=timeout)
    except TimeoutError:
        return False
    return True


def in_flight(ahead: PlanAhead) -> int:
    return sum(1 for p in list(ahead._pending.values()) if not p.future.done())


def request(step: int) -> PlanRequest:
    return PlanRequest.of((1000 + step, 512), 2, 1, 4096)


def test_depth_plans_are_in_flight_at_once_and_memory_is_bounded():
    planner = GatedPlanner()
    ahead = PlanAhead(planner, depth=3)
    try:
        assert all(ahead.prefetch(step, request(step)) for step in (1, 2, 3, 4))
        assert planner.wait_started(3)  # three at once, the fourth queued behind them
        assert in_flight(ahead) == 4
        assert not ahead.prefetch(5, request(5))  # beyond depth + 1 plans held: refused
        assert ahead.prefetch(0, request(0))  # a nearer step displaces the farthest (4)
        assert ahead.pending_request(4) is None and ahead.pending_request(0) is not None
    finally:
        for step in range(6):
            planner.gate(request(step)).set()
        ahead.close()


def test_a_step_drops_older_prefetches_and_reports_its_lead():
    planner = GatedPlanner()
    ahead = PlanAhead(planner, depth=2)
    try:
        for step in (1, 2, 3):
            ahead.prefetch(step, request(step))
            planner.gate(request(step)).set()
        assert arrived(ahead, 3, WAIT_S) and arrived(ahead, 1, WAIT_S)
        fetched = ahead.get(3, request(3))
        assert fetched.sourced.plan == request(3) and not fetched.waited and fetched.lead_seconds > 0
        assert ahead.pending_request(1) is None and ahead.pending_request(2) is None  # passed: dropped
        planner.gate(request(7)).set()
        late = ahead.get(7, request(7))  # never prefetched: planned now, the step waited
        assert late.waited and late.lead_seconds == 0.0
    finally:
        ahead.close()


def test_plan_ahead_depth_is_a_bounded_setting():
    base = dict(max_seqlen_per_dp_cp_rank=8192)
    assert PlannerClientConfig(**base).plan_ahead_depth == 1
    assert PlannerClientConfig.from_dict({**base, "plan_ahead_depth": 4}).plan_ahead_depth == 4
    for bad in (0, MAX_PLAN_AHEAD_DEPTH + 1):
        with pytest.raises(ConfigError, match="plan_ahead_depth"):
            PlannerClientConfig(**base, plan_ahead_depth=bad)


def test_client_exports_the_lead_and_counts_late_steps(planner):
    config = PlannerClientConfig(planner_endpoint=planner.address, tls=False, max_seqlen_per_dp_cp_rank=8192,
                                 job="test", plan_ahead_depth=3, scheduler=best_local_scheduler())
    client = BatchPlannerClient(config, dp_cp_size=8, rank=0)
    batches = [sample_lengths("long_tail_16k", 64, seed=s) for s in range(5)]

    def value(name: str) -> float:
        return client.metrics.registry.get_sample_value(name, {"training_job": "test"}) or 0.0

    try:
        for step in (1, 2, 3):
            client.prefetch(step, batches[step])
        assert all(arrived(client.ahead, step, WAIT_S) for step in (1, 2, 3))
        for step in (1, 2, 3):
            client.plan_step(step, batches[step])
        client.plan_step(4, batches[4])  # not planned ahead: late
    finally:
        client.close()
    assert value("batch_planner_client_plan_ahead_depth") == 3
    assert value("batch_planner_client_plan_lead_seconds_count") == 4
    assert value("batch_planner_client_plan_lead_seconds_sum") > 0
    assert value("batch_planner_client_late_plans_total") == 1
    # The late step's lead is 0: it lands in the first bucket, with nothing else.
    zero = client.metrics.registry.get_sample_value("batch_planner_client_plan_lead_seconds_bucket", {"training_job": "test", "le": "0.0"})
    assert zero == 1


def test_plan_step_reuses_the_prefetched_request_for_the_same_lengths():
    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=8192, job="test", plan_ahead_depth=2,
                                 scheduler=best_local_scheduler())
    client = BatchPlannerClient(config, dp_cp_size=8, rank=0)  # no endpoint: planned in-process
    lengths = tuple(sample_lengths("long_tail_16k", 64, seed=1))
    try:
        client.prefetch(1, lengths)
        prefetched = client.ahead.pending_request(1)
        assert client._request_for_step(1, lengths) is prefetched  # the same tuple: no comparison
        assert client._request_for_step(1, list(lengths)) is prefetched  # equal lengths: compared
        assert client._request_for_step(1, lengths[::-1]) is not prefetched  # another batch
        assert client.plan_step(1, lengths).plan_id
    finally:
        client.close()
