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
- Workers fork from a forkserver that imported the `preload` modules once. The forkserver is only
  needed to start a worker: one that dies leaves its workers planning (a worker's death is read
  from its own pipe, not from the forkserver's status pipe), and a watcher thread starts a new one
  at once, so that the next replacement does not wait seconds for Megatron-Core's import; a
  worker start that still fails is retried with backoff.
- No request waits for a worker that is being replaced: once the pool is warm, a task submitted
  while no worker is running, and the queue and the task of a last worker that died, fail at once
  with WorkersLost (UNAVAILABLE: the client tries another replica). Why not pebble: docs/design.md.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
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

# Why a process was replaced: batch_planner_worker_restarts_total{reason}.
DIED = "died"
ABANDONED = "abandoned"
FORKSERVER = "forkserver"  # the forkserver died (its workers live on) and a new one was started

# What a request gets while no worker runs: it is not held until one is back.
_NO_WORKER = "no planning worker is running (they are being replaced); retry on another replica"


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
    """One worker process with its own pipe. Its death is read from the pipe (end of file: the
    worker's end closes when it dies). The process's sentinel, the forkserver's status pipe, also
    ends when the forkserver dies while the worker lives on: then the worker keeps planning."""

    def __init__(self, context, initializer, initargs: tuple):
        self._sentinel: int | None = None
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, initializer, initargs), daemon=True, name="planning-worker")
        self.conn = parent
        self.busy = False
        try:
            self.process.start()
        finally:
            child.close()
        self.pid = self.process.pid
        self._sentinel = self.process.sentinel
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
        while True:
            ready = wait_for([self.conn] if self._sentinel is None else [self.conn, self._sentinel])
            if self.conn in ready:
                try:
                    return self.conn.recv()
                except (OSError, EOFError):
                    return None
            # The forkserver wrote the worker's exit status (the pipe's end of file is on its way),
            # or the forkserver is gone (ProcessPool's watcher starts another): either way, from
            # now on the worker's pipe alone says whether it lives.
            self._sentinel = None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        # Killed even when it exited (pids are not reused before the forkserver, or init, reaps
        # it): a worker whose forkserver died must never keep working as an orphan.
        self.kill()
        self.conn.close()
        try:
            # A worker whose forkserver died is re-parented; where this process is PID 1 (the
            # image's entry point), to this process, which must reap it. Otherwise not our child.
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
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


def _forkserver_pid() -> int | None:
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def _exited(pid: int) -> bool:
    """Waits until child `pid` exits, without reaping it (multiprocessing reaps its forkserver
    when it starts the next one); False when it is not a child of this process (reaped already)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


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
        self._live: dict[int, _Worker] = {}  # slot -> its current worker (changed under _wakeup)
        self._warm = False  # every worker has started once: from now on no task waits for one
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

    @property
    def live(self) -> int:
        """Workers started and not known dead."""
        return len(self._live)

    def warm_up(self, timeout: float = 600.0) -> None:
        """Waits until every worker has started and run the initializer."""
        end = time.monotonic() + timeout
        started = 0
        while started < self.workers and not self._stopping:
            if self._ready.acquire(timeout=0.1):
                started += 1
            elif time.monotonic() > end:
                raise RuntimeError(f"the workers did not start within {timeout:.0f} s")
        if not self._warm:
            threading.Thread(target=self._watch_forkserver, name="forkserver-watch", daemon=True).start()
        self._warm = True

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
            if self._warm and not self._live:
                task._settle(error=WorkersLost(_NO_WORKER))
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
            with self._wakeup:
                self._live[slot] = worker
            if first:
                self._ready.release()
                first = False
            reason = self._feed(worker, slot)
            worker.close()
            if reason is None:
                return
            if not self._stopping:
                self._on_restart(reason)

    def _gone(self, slot: int) -> None:
        """The slot's worker died: out of the live set; when it was the last one, the queued tasks
        fail now rather than wait for a replacement."""
        with self._wakeup:
            self._live.pop(slot, None)
            if self._live or not self._warm or self._stopping:
                return
            stranded = list(self._queue)
            self._queue.clear()
        for task in stranded:
            task._settle(error=WorkersLost(_NO_WORKER))

    def _watch_forkserver(self) -> None:
        """Starts a new forkserver as soon as the running one dies, beside the workers it forked
        (they plan on), so that a worker's replacement never waits seconds for Megatron-Core's
        import. multiprocessing keeps one forkserver per process and names no public way to watch
        it: its pid is read from the module's own record of it."""
        while not self._stopping:
            pid = _forkserver_pid()
            if pid is None:
                return  # no forkserver: a pool without workers
            if _exited(pid):
                if self._stopping:
                    return
                log.warning("the forkserver died; its workers keep planning; starting a new one")
                try:
                    multiprocessing.forkserver.ensure_running()
                except Exception as exc:  # noqa: BLE001 - the next worker start tries again, with backoff
                    log.warning("could not start a new forkserver (%s: %s)", type(exc).__name__, exc)
                    return
            if _forkserver_pid() == pid:
                return  # not a child of ours to watch (another pool's start reaped it, or a bug)
            if not self._stopping:
                self._on_restart(FORKSERVER)  # started here, or by a worker start that found it dead

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

    def _feed(self, worker: _Worker, slot: int) -> str | None:
        """Runs tasks on `worker` until it dies; returns why (DIED or ABANDONED), None on shutdown."""
        while True:
            task = self._next_task()
            if task is None:
                self._gone(slot)
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
                self._gone(slot)
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
