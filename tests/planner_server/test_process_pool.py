"""planner_server/process_pool.py: a task's states, cancellation of queued and running tasks, and
re-runs of a task whose worker died on its own. The workers run plain functions of this module."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from planner_server.process_pool import ATTEMPTS, DIED, FORKSERVER, ProcessPool, TaskCancelled, TaskState, WorkersLost
from tests.support.reliability_support import forkserver_pid, wait_until

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
    wait_until(lambda: pool.live == 1, WAIT_S, "the replacement worker running")
    assert pool.submit(square, 4).result(WAIT_S) == 16


def die_once(path: str) -> int:
    """Dies the first time (leaving `path` behind), answers the second."""
    if not os.path.exists(path):
        open(path, "w").close()
        die()
    return 7


def test_a_task_whose_worker_dies_runs_again_on_a_live_worker(tmp_path):
    restarts: list[str] = []
    processes = ProcessPool(2, on_restart=restarts.append)
    try:
        processes.warm_up(WAIT_S)
        task = processes.submit(die_once, str(tmp_path / "died"))
        assert task.result(WAIT_S) == 7 and task.attempts == 2
        wait_until(lambda: restarts.count(DIED) == 1, WAIT_S, "the dead worker replaced")
    finally:
        processes.shutdown()


def test_a_task_whose_workers_keep_dying_fails_with_workers_lost():
    restarts: list[str] = []
    processes = ProcessPool(ATTEMPTS, on_restart=restarts.append)  # a live worker for every attempt
    try:
        processes.warm_up(WAIT_S)
        task = processes.submit(die)
        with pytest.raises(WorkersLost, match=f"died under this request {ATTEMPTS} times"):
            task.result(WAIT_S)
        assert task.attempts == ATTEMPTS
        wait_until(lambda: restarts.count(DIED) == ATTEMPTS, WAIT_S, "each dead worker replaced")
        wait_until(lambda: processes.live == ATTEMPTS, WAIT_S, "the replacements running")
        assert processes.submit(square, 5).result(WAIT_S) == 25
    finally:
        processes.shutdown()


def test_no_task_waits_while_no_worker_runs(pool):
    """The last worker died under a task: it fails at once (UNAVAILABLE: the client tries another
    replica) rather than wait for the replacement; then the pool serves again."""
    task = pool.submit(die)
    with pytest.raises(WorkersLost, match="no planning worker is running"):
        task.result(WAIT_S)
    assert task.attempts == 1
    wait_until(lambda: pool.live == 1, WAIT_S, "the replacement worker running")
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


def test_workers_outlive_their_forkserver_and_one_new_forkserver_starts():
    restarts: list[str] = []
    processes = ProcessPool(2, on_restart=restarts.append)
    try:
        processes.warm_up(WAIT_S)
        workers = sorted(processes.pids())
        os.kill(forkserver_pid(os.getpid()), signal.SIGKILL)
        # Each worker sees the forkserver gone at its next task, and plans it.
        tasks = [processes.submit(square, n) for n in range(8)]
        assert [t.result(WAIT_S) for t in tasks] == [n * n for n in range(8)]
        assert sorted(processes.pids()) == workers and DIED not in restarts
        wait_until(lambda: FORKSERVER in restarts, WAIT_S, "a new forkserver")
        # A worker that dies now is replaced from the new one.
        os.kill(workers[0], signal.SIGKILL)
        wait_until(lambda: processes.submit(square, 3).result(WAIT_S) == 9 and workers[0] not in processes.pids(),
                   WAIT_S, "the dead worker replaced")
        assert restarts.count(FORKSERVER) == 1
    finally:
        processes.shutdown()
