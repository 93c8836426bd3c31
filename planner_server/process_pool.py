"""A pool of worker processes that run picklable functions; it knows nothing of planning but the
status of its one error: WorkersLost is a PlanningError (UNAVAILABLE), so that
batch_planner.errors.status_of answers it as it answers every other refusal.

- `Task.cancel()` drops a queued task, or kills the worker running it (the only way to stop code
  that cannot be interrupted, such as Megatron-Core's schedulers). A task settles (`on_settled`)
  only once its work has really stopped, so slots counted on it come back when nothing runs.
- Each worker has its own pipe, so one that dies (OOM, kill -9, cancellation) affects no other; its
  slot thread starts a replacement at once and says why (`on_restart(DIED | ABANDONED)`). A task
  lost with a worker that died on its own runs again (functions run here must be deterministic),
  up to `ATTEMPTS` times, then fails with WorkersLost.
- Workers fork from a forkserver that imported the `preload` modules once; one that died is started
  again on the next start, retried with backoff. Why not pebble: docs/design.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from enum import Enum
from multiprocessing.connection import wait as wait_for

from batch_planner.errors import ErrorCode, PlanningError

log = logging.getLogger(__name__)

ATTEMPTS = 3  # runs of one task on workers that die under it before it is given up
_START_BACKOFF = (0.05, 2.0)  # first and longest wait between failed worker starts, seconds

# Why a worker was replaced: batch_planner_worker_restarts_total{reason}.
DIED = "died"
ABANDONED = "abandoned"


class TaskCancelled(Exception):
    """The task was cancelled before it produced a result."""


class WorkersLost(PlanningError):
    """Workers died under this task `ATTEMPTS` times (or the pool shut down): transient, ours."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, detail: str):
        super().__init__(f"planning workers unavailable: {detail}; retry")


class TaskState(Enum):
    """Where a task is: QUEUED -> RUNNING -> SETTLED, or CANCELLING (cancel() was called, the task
    has not stopped yet) -> SETTLED. A task lost with a worker that died on its own goes from
    RUNNING back to QUEUED."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SETTLED = "settled"


class Task:
    """One function call on a worker, in one `TaskState`. `on_settled` runs once, when the task
    costs nothing any more."""

    def __init__(self, pool: ProcessPool, fn, args: tuple, on_settled=None):
        self.fn, self.args = fn, args
        self._pool = pool
        self.attempts = 0
        self._lock = threading.Lock()
        self.state = TaskState.QUEUED
        self._settled = threading.Event()
        self._on_settled = on_settled
        self._worker: _Worker | None = None
        self._value = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None):
        """The function's return value; raises TimeoutError, TaskCancelled or WorkersLost."""
        if not self._settled.wait(timeout):
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> None:
        """Queued: it never runs. Running: its worker is killed (and replaced by the pool)."""
        with self._lock:
            if self.state in (TaskState.SETTLED, TaskState.CANCELLING):
                return
            self.state = TaskState.CANCELLING
            worker = self._worker
        if worker is not None:
            worker.kill()  # its slot thread sees the death and settles the task
        else:
            self._pool._drop(self)  # settled now, not when a worker is next free

    # --- used by the pool ---

    def _start(self, worker: _Worker) -> bool:
        with self._lock:
            if self.state is not TaskState.QUEUED:
                return False
            self.state = TaskState.RUNNING
            self._worker = worker
            self.attempts += 1
            return True

    def _requeue(self) -> bool:
        """RUNNING -> QUEUED, to run again after its worker died; False if it was cancelled meanwhile."""
        with self._lock:
            if self.state is not TaskState.RUNNING:
                return False
            self.state, self._worker = TaskState.QUEUED, None
            return True

    def _settle(self, value=None, error: BaseException | None = None) -> None:
        with self._lock:
            if self.state is TaskState.SETTLED:
                return
            self.state = TaskState.SETTLED
            self._worker = None
            self._value, self._error = value, error
            self._settled.set()
        if self._on_settled is not None:
            self._on_settled()


class _Worker:
    """One worker process with its own pipe."""

    def __init__(self, context, initializer, initargs: tuple):
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, initializer, initargs), daemon=True, name="planning-worker")
        self.conn = parent
        self.busy = False
        try:
            self.process.start()
        finally:
            child.close()
        self.pid = self.process.pid
        if self._wait() is None:
            self.close()
            raise OSError("the worker died while starting")

    def run(self, fn, args: tuple):
        """('ok', value) or ('error', exception), or None when the worker died."""
        try:
            self.conn.send((fn, args))
        except (OSError, EOFError):
            return None
        return self._wait()

    def _wait(self):
        ready = wait_for([self.conn, self.process.sentinel])
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (OSError, EOFError):
                return None
        return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        # The sentinel also fires when the forkserver dies while the worker lives on: make sure
        # no orphan keeps working.
        self.kill()
        self.conn.close()
        self.process.join(5)
        try:
            self.process.close()
        except ValueError:
            pass


def _worker_main(conn, initializer, initargs: tuple) -> None:
    # The server owns shutdown: a terminal's Ctrl-C reaches the whole process group, and a worker
    # would otherwise die with a KeyboardInterrupt traceback while the server drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)
    conn.send(("ok", None))
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the worker lives on
            reply = ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
        conn.send(reply)


class ProcessPool:
    """`workers` processes, each served by a slot thread here that starts it, feeds it tasks from
    one queue and replaces it when it dies."""

    def __init__(self, workers: int, initializer=None, initargs: tuple = (), preload: list[str] | None = None, on_restart=None):
        self.workers = workers
        self._initializer, self._initargs = initializer, initargs
        self._on_restart = on_restart or (lambda reason: None)
        self._context = multiprocessing.get_context("forkserver")
        if preload:
            self._context.set_forkserver_preload(preload)
        self._queue: deque[Task] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.tasks_run = 0  # tasks that workers have answered
        self._live: dict[int, _Worker] = {}  # slot -> its current worker
        self._ready = threading.Semaphore(0)
        self._threads = [
            threading.Thread(target=self._serve_slot, args=(slot,), name=f"worker-slot-{slot}", daemon=True)
            for slot in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def busy(self) -> int:
        """Workers running a task now."""
        return sum(1 for w in list(self._live.values()) if w.busy)

    def pids(self) -> list[int]:
        return [w.pid for w in list(self._live.values())]

    def warm_up(self, timeout: float = 600.0) -> None:
        """Waits until every worker has started and run the initializer."""
        end = time.monotonic() + timeout
        started = 0
        while started < self.workers and not self._stopping:
            if self._ready.acquire(timeout=0.1):
                started += 1
            elif time.monotonic() > end:
                raise RuntimeError(f"the workers did not start within {timeout:.0f} s")

    def submit(self, fn, *args, on_settled=None) -> Task:
        task = Task(self, fn, args, on_settled)
        self._enqueue(task)
        return task

    def shutdown(self) -> None:
        """Drops queued tasks and kills the workers at once."""
        with self._wakeup:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._wakeup.notify_all()
        for task in dropped:
            task._settle(error=WorkersLost("the planner is shutting down"))
        for worker in list(self._live.values()):
            worker.kill()
        end = time.monotonic() + 5.0
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    # --- inside the pool ---

    def _enqueue(self, task: Task, front: bool = False) -> None:
        with self._wakeup:
            if self._stopping:
                task._settle(error=WorkersLost("the planner is shutting down"))
                return
            (self._queue.appendleft if front else self._queue.append)(task)
            self._wakeup.notify()

    def _drop(self, task: Task) -> None:
        """A queued task was cancelled: out of the queue and settled (if a slot thread has just
        taken it, that thread settles it instead)."""
        with self._wakeup:
            try:
                self._queue.remove(task)
            except ValueError:
                return
        task._settle(error=TaskCancelled())

    def _next_task(self) -> Task | None:
        with self._wakeup:
            while True:
                while not self._queue and not self._stopping:
                    self._wakeup.wait()
                if self._stopping:
                    return None
                task = self._queue.popleft()
                if task.state is TaskState.CANCELLING:
                    task._settle(error=TaskCancelled())
                    continue
                return task

    def _serve_slot(self, slot: int) -> None:
        """One worker's life, and its replacements': start it, feed it tasks, replace it."""
        first = True
        while not self._stopping:
            worker = self._start_worker()
            if worker is None:
                return
            self._live[slot] = worker
            if first:
                self._ready.release()
                first = False
            reason = self._feed(worker)
            del self._live[slot]
            worker.close()
            if reason is None:
                return
            if not self._stopping:
                self._on_restart(reason)

    def _start_worker(self) -> _Worker | None:
        backoff = _START_BACKOFF[0]
        while not self._stopping:
            try:
                return _Worker(self._context, self._initializer, self._initargs)
            except Exception as exc:  # noqa: BLE001 - e.g. the forkserver was killed: it is restarted
                log.warning("could not start a worker (%s: %s); retrying in %.2f s", type(exc).__name__, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, _START_BACKOFF[1])
        return None

    def _feed(self, worker: _Worker) -> str | None:
        """Runs tasks on `worker` until it dies; returns why (DIED or ABANDONED), None on shutdown."""
        while True:
            task = self._next_task()
            if task is None:
                return None
            if not task._start(worker):
                task._settle(error=TaskCancelled())
                continue
            worker.busy = True
            try:
                reply = worker.run(task.fn, task.args)
            finally:
                worker.busy = False
            if reply is None:
                return self._lost(task)
            with self._wakeup:
                self.tasks_run += 1
            kind, value = reply
            task._settle(value=value) if kind == "ok" else task._settle(error=value)

    def _lost(self, task: Task) -> str:
        """The worker died under `task`: settle or re-run the task; say why the worker died."""
        if task.state is TaskState.CANCELLING:
            task._settle(error=TaskCancelled())
            return ABANDONED
        if self._stopping:
            task._settle(error=WorkersLost("the planner is shutting down"))
        elif task.attempts >= ATTEMPTS:
            task._settle(error=WorkersLost(f"planning workers died under this request {task.attempts} times"))
        elif task._requeue():
            log.warning("a worker died under a task; running it again (attempt %d)", task.attempts + 1)
            self._enqueue(task, front=True)
        else:
            task._settle(error=TaskCancelled())  # cancelled as its worker died
            return ABANDONED
        return DIED
