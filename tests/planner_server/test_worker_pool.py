"""The planning pool on its own (planner_server/worker_pool.py): several cancellable tasks for one
request side by side, slots that come back when work stops, and workers replaced after a cancel.
Real worker processes, real Megatron-Core."""

from __future__ import annotations

import threading
import time

import pytest

from batch_planner.cost_spec import CostModel
from batch_planner.distributions import sample_lengths
from batch_planner.errors import ErrorCode
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import RequestLimits
from planner_server.planning_worker import plan_in_worker
from planner_server.worker_pool import PlanningPool, PoolOverloaded, TaskCancelled
from tests.support.reliability_support import wait_until


def payload(samples: int, ranks: int, seed: int = 0) -> bytes:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=seed),
        layout=pb.ParallelLayout(data_parallel_size=ranks, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    ).SerializeToString()


HUGE = payload(16384, 1024)  # tens of seconds of scheduling: only ever cancelled here


@pytest.fixture(scope="module")
def pool():
    restarts = []
    pool = PlanningPool(2, 2, RequestLimits(), CostModel(), on_restart=restarts.append)
    pool.restarts = restarts
    pool.warm_up()
    yield pool
    pool.shutdown()


def test_one_request_runs_several_tasks_side_by_side_and_one_cancel_stops_them_all(pool):
    work = pool.admit(slots=3)
    try:
        tasks = [work.submit(plan_in_worker, HUGE, time.time() + 600) for _ in range(3)]
        wait_until(lambda: pool.busy == 2, 60, "two of the request's tasks planning at once")
        assert pool.in_flight == 3
        with pytest.raises(PoolOverloaded):
            pool.admit(slots=2)  # 3 + 2 > the bound of 4
        before = len(pool.restarts)
        work.cancel()
        for task in tasks:
            with pytest.raises(TaskCancelled):
                task.result(timeout=30)
    finally:
        work.close()
    wait_until(lambda: pool.in_flight == 0, 30, "every slot back")
    # The two running were killed and replaced; the queued one never ran.
    wait_until(lambda: len(pool.restarts) - before == 2, 30, "both workers replaced")
    assert pool.restarts[before:] == ["abandoned", "abandoned"]
    wait_until(lambda: pool.live == 2, 60, "both replacements running")  # until then, no worker: UNAVAILABLE
    small = pool.admit(1)
    try:
        result = small.submit(plan_in_worker, payload(256, 16), time.time() + 60).result(timeout=60)
    finally:
        small.close()
    assert result.code is ErrorCode.OK


def test_a_cancelled_queued_task_gives_its_slot_back_at_once(pool):
    busy = pool.admit(slots=2)
    try:
        for _ in range(2):
            busy.submit(plan_in_worker, HUGE, time.time() + 600)
        wait_until(lambda: pool.busy == 2, 60, "both workers planning")
        queued = pool.admit(1)
        task = queued.submit(plan_in_worker, payload(256, 16), time.time() + 60)
        assert pool.in_flight == 3
        queued.cancel()  # its caller went away
        assert task.state.value == "settled"
        assert pool.in_flight == 2  # not when a worker is next free
        queued.close()
    finally:
        busy.close()
    wait_until(lambda: pool.in_flight == 0 and pool.busy == 0 and pool.live == pool.workers, 60, "the pool idle again, every worker running")


def test_a_request_runs_more_tasks_than_it_has_slots_one_per_slot_at_a_time(pool):
    work = pool.admit(slots=1)
    outcome: list = []
    calls = [(HUGE, time.time() + 600), (payload(256, 16), time.time() + 600)]
    runner = threading.Thread(target=lambda: outcome.append(_results_or_error(work, calls)))
    runner.start()
    try:
        wait_until(lambda: pool.busy == 1, 60, "the request's first task planning")
        # The other worker is free: the request's second task waits for its one slot.
        other = pool.admit(1)
        try:
            assert other.submit(plan_in_worker, payload(256, 16, seed=1), time.time() + 60).result(timeout=60).code is ErrorCode.OK
        finally:
            other.close()
        assert pool.in_flight == 1
    finally:
        work.close()
        runner.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)  # cancelled: the caller is gone
    wait_until(lambda: pool.in_flight == 0 and pool.busy == 0 and pool.live == pool.workers, 60, "the pool idle again, every worker running")
    small = pool.admit(slots=2)
    try:
        results = small.map(plan_in_worker, [(payload(256, 16, seed=s), time.time() + 60) for s in range(5)], time.monotonic() + 120)
        assert pool.in_flight == 2
    finally:
        small.close()
    assert [r.code for r in results] == [ErrorCode.OK] * 5
    assert pool.in_flight == 0


def _results_or_error(work, calls):
    try:
        return work.map(plan_in_worker, calls, time.monotonic() + 600)
    except TimeoutError as exc:
        return exc


def test_an_auto_request_holds_at_most_one_slot_per_worker_and_fits_a_small_job_share():
    # 2 workers + 2 queued, a job may hold 2: auto's many candidates ran on 2 slots, not one each.
    pool = PlanningPool(2, 2, RequestLimits(), CostModel(), max_job_share=0.5)
    try:
        pool.warm_up()
        request = pb.PlanRequest.FromString(payload(256, 16))
        request.scheduler = pb.SCHEDULER_AUTO
        result = pool.plan(request.SerializeToString(), time.time() + 120, 120, job="small-share")
        assert result.code is ErrorCode.OK, result
        candidates = pb.PlanResponse.FromString(result.response).candidates
        assert len(candidates) > 2 and result.auto_winner  # more candidates than the job's 2 slots
        assert pool.in_flight == 0
    finally:
        pool.shutdown()
