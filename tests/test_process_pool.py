"""planner_server/process_pool.py: a task's states, cancellation of queued and running tasks, and
re-runs of a task whose worker died on its own. The workers run plain functions of this module."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from planner_server.process_pool import ATTEMPTS, DIED, ProcessPool, TaskCancelled, TaskState, WorkersLost
from tests.reliability_support import wait_until

WAIT_S = 60.0  # the longest any event below may take; never reached when the code is right


def square(x: int) -> int:
    return x * x


def block(path: str) -> int:
    """Writes its pid to `path`, then waits for ever (until its worker is killed)."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    threading.Event().wait()
    return 0


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fail() -> None:
    raise ValueError("bad input")


@pytest.fixture
def pool():
    restarts: list[str] = []
    processes = ProcessPool(1, on_restart=restarts.append)
    processes.warm_up(WAIT_S)
    processes.restarts = restarts  # type: ignore[attr-defined]
    yield processes
    processes.shutdown()


def test_a_task_runs_and_settles_with_its_value_or_its_error(pool):
    settled = threading.Event()
    task = pool.submit(square, 7, on_settled=settled.set)
    assert task.result(WAIT_S) == 49 and task.state is TaskState.SETTLED and settled.is_set()
    with pytest.raises(RuntimeError, match="ValueError: bad input"):
        pool.submit(fail).result(WAIT_S)
    assert pool.tasks_run == 2


def test_a_queued_task_cancelled_never_runs_and_settles_at_once(pool, tmp_path):
    running = pool.submit(block, str(tmp_path / "pid"))
    wait_until(lambda: running.state is TaskState.RUNNING and (tmp_path / "pid").exists(), WAIT_S, "the first task running")
    queued = pool.submit(square, 3)
    assert queued.state is TaskState.QUEUED
    queued.cancel()
    assert queued.state is TaskState.SETTLED
    with pytest.raises(TaskCancelled):
        queued.result(0)
    running.cancel()  # kills its worker; the pool starts another
    with pytest.raises(TaskCancelled):
        running.result(WAIT_S)
    assert pool.submit(square, 4).result(WAIT_S) == 16


def test_a_task_whose_worker_dies_runs_again_then_fails_with_workers_lost(pool):
    task = pool.submit(die)
    with pytest.raises(WorkersLost, match=f"died under this request {ATTEMPTS} times"):
        task.result(WAIT_S)
    assert task.attempts == ATTEMPTS
    wait_until(lambda: pool.restarts.count(DIED) == ATTEMPTS, WAIT_S, "each dead worker replaced")
    assert pool.submit(square, 5).result(WAIT_S) == 25


def test_shutdown_settles_queued_tasks_with_workers_lost(tmp_path):
    processes = ProcessPool(1)
    processes.warm_up(WAIT_S)
    running = processes.submit(block, str(tmp_path / "pid"))
    wait_until(lambda: (tmp_path / "pid").exists(), WAIT_S, "the task running")
    queued = processes.submit(square, 2)
    processes.shutdown()
    for task in (running, queued):
        with pytest.raises(WorkersLost):
            task.result(WAIT_S)
