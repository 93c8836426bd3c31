"""Planning worker processes: a bounded admission, cancellable tasks, and workers that are replaced
when they die or when the task they run is abandoned.

- Admission: a request reserves slots (one per task it will run) before any work starts; past
  `workers + max_queued` slots it is refused at once (the caller answers RESOURCE_EXHAUSTED). A
  slot is given back when its work has really stopped - a finished task, a queued task dropped, or
  the worker running an abandoned task killed - so the bound and `in_flight` count what runs.
  Per job (the request's job name, read from the wire bytes before any parsing), at most
  `max_job_share` of the bound: a job past its share is refused while other jobs are admitted.
- Cancellation: `Work.cancel()` (the RPC's caller went away, or its deadline passed) drops its
  queued tasks and kills the workers running the others. Megatron-Core's schedulers cannot be
  interrupted, so killing the worker is the only way to stop paying for a plan nobody waits for.
- Self-healing: each worker has its own pipe, so a worker that dies (OOM, kill -9, cancellation)
  affects no other. Its slot's thread starts a replacement at once; a task lost with a worker that
  died on its own is run again (planning is deterministic), up to `_ATTEMPTS` times. Workers start
  from a forkserver that has Megatron-Core imported; a forkserver that died is started again by
  multiprocessing on the next start, which this pool retries with backoff.
- Inline: a request within `InlineBound` is planned in the calling (gRPC handler) thread. The
  schedulers hold the GIL, so this is only for requests that plan in a few milliseconds, for which
  the hop to a worker costs about as much as the planning; it cannot be cancelled, which is why it
  is bounded, and it is never given work that can loop: validation refuses every layout where
  upstream's code can (batch_planner/domain.py). A drain that still finds one running ends the
  process rather than wait for the thread (planner_server/server.py, `serve`).

Several tasks of one request (the candidates of a policy that compares schedulers) run side by side:
`work = pool.admit(slots=n)`, then `work.submit(...)` n times, and one `work.cancel()` stops all.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for

from google.protobuf.message import DecodeError

from batch_planner.auto import best_cost
from batch_planner.cost_spec import CostModel
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import RequestLimits
from planner_server import planning_worker
from planner_server.wire import read_job
from planner_server.planning_worker import (
    WorkerResult,
    assemble_auto,
    plan_part_in_worker,
    plan_request_bytes,
    worker_initializer,
)

log = logging.getLogger(__name__)

_PRELOAD = ["planner_server.worker_preload"]
# Bytes a PlanRequest holds besides its sample lengths: layout, limits, enums and a job name of at
# most 63 characters. Longer messages are not parsed in the handler thread to find their size.
_REQUEST_FIXED_BYTES = 256
_MAX_VARINT_BYTES = 10
_ATTEMPTS = 3  # runs of one task on workers that die under it before it is given up
_START_BACKOFF = (0.05, 2.0)  # first and longest wait between failed worker starts, seconds

# Why a worker was replaced: batch_planner_worker_restarts_total{reason}.
DIED = "died"
ABANDONED = "abandoned"


class PoolOverloaded(Exception):
    """The admission bound is reached: refuse at once rather than queue."""


class JobShareExceeded(PoolOverloaded):
    """This job holds its share of the in-flight bound: its request is refused, other jobs' are not."""

    def __init__(self, message: str, job: str):
        super().__init__(message)
        self.job = job


class TaskCancelled(Exception):
    """The task was cancelled before it produced a result."""


class WorkersLost(Exception):
    """Workers died under this task `_ATTEMPTS` times (or the pool shut down): transient, ours."""


class Admission:
    """The in-flight bound: slots reserved before work starts, given back when it has stopped.

    Fair per job: one job (the request's job name; "" for requests without a valid one, one shared
    bucket) may hold at most `job_share` of the capacity, at least one slot. Past it, that job's
    request is refused (JobShareExceeded) while other jobs are still admitted up to the total
    bound. job_share 1.0 turns the per-job bound off."""

    def __init__(self, capacity: int, job_share: float = 1.0):
        self.capacity = capacity
        self.job_share = job_share
        self.job_bound = capacity if job_share >= 1.0 else max(1, int(capacity * job_share))
        self._lock = threading.Lock()
        self._used = 0
        self._by_job: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return self._used

    def held_by(self, job: str) -> int:
        return self._by_job.get(job, 0)

    def reserve(self, slots: int = 1, job: str = "") -> None:
        with self._lock:
            need = f"; this request needs {slots} (one per auto candidate)" if slots > 1 else ""
            held = self._by_job.get(job, 0)
            if self.job_bound < self.capacity and held + slots > self.job_bound:
                raise JobShareExceeded(
                    f"job {job or '(none)'!r} holds {held} slots in flight{need}, its share is "
                    f"{self.job_bound} ({self.job_share:g} of the server's bound of {self.capacity})", job)
            if self._used + slots > self.capacity:
                raise PoolOverloaded(f"{self._used} slots in flight{need}, the server's bound is {self.capacity}")
            self._used += slots
            self._by_job[job] = held + slots

    def release(self, slots: int = 1, job: str = "") -> None:
        with self._lock:
            self._used -= slots
            left = self._by_job.get(job, 0) - slots
            if left > 0:
                self._by_job[job] = left
            else:
                self._by_job.pop(job, None)  # bounded by what is in flight, not by jobs ever seen


@dataclass(frozen=True)
class InlineBound:
    """Which requests are planned in the handler thread: at most `max_samples` samples on at most
    `max_ranks` DPxCP ranks (the scheduler's time grows with both). max_samples 0: none."""

    max_samples: int = 0
    max_ranks: int = 0

    def admits(self, request_bytes: bytes) -> bool:
        if self.max_samples <= 0:
            return False
        if len(request_bytes) > _REQUEST_FIXED_BYTES + _MAX_VARINT_BYTES * self.max_samples:
            return False  # too many samples to be small; not worth parsing here
        try:
            message = pb.PlanRequest.FromString(request_bytes)
        except (DecodeError, ValueError, RuntimeError):
            return True  # small and malformed: plan_request_bytes answers INVALID_ARGUMENT at once
        ranks = message.layout.data_parallel_size * max(1, message.layout.context_parallel_size)
        return len(message.sequence_lengths) <= self.max_samples and ranks <= self.max_ranks


class Task:
    """One function call on a worker. States: queued -> running -> settled (result, error or
    cancelled). `settled` fires once the task costs nothing any more."""

    def __init__(self, fn, args: tuple, on_settled, drop_queued):
        self.fn, self.args = fn, args
        self._drop_queued = drop_queued
        self.attempts = 0
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._on_settled = on_settled
        self._worker: _Worker | None = None
        self._cancelled = False
        self._value = None
        self._error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

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
            if self._settled.is_set() or self._cancelled:
                return
            self._cancelled = True
            worker = self._worker
        if worker is not None:
            worker.kill()  # its slot thread sees the death and settles the task
        else:
            self._drop_queued(self)  # its slot comes back now, not when a worker is next free

    # --- used by the pool ---

    def _start(self, worker: _Worker) -> bool:
        with self._lock:
            if self._cancelled:
                return False
            self._worker = worker
            self.attempts += 1
            return True

    def _settle(self, value=None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._settled.is_set():
                return
            self._worker = None
            self._value, self._error = value, error
            self._settled.set()
        self._on_settled()


class Work:
    """What one request runs on the pool: the slots it reserved and the tasks it submitted."""

    def __init__(self, pool: PlanningPool, slots: int, job: str = ""):
        self._pool = pool
        self._slots = slots
        self._job = job
        self._tasks: list[Task] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Task:
        with self._lock:
            if len(self._tasks) >= self._slots:
                raise RuntimeError(f"this request reserved {self._slots} slot(s) and used them all")
            task = Task(fn, args, self._task_settled, self._pool._drop)
            self._tasks.append(task)
        self._pool._enqueue(task)
        return task

    def cancel(self) -> None:
        """Stops every task of the request; safe to call from any thread, any number of times."""
        for task in list(self._tasks):
            task.cancel()

    def close(self) -> None:
        """The request is answered: abandoned tasks are cancelled, unused slots given back now and
        the others as soon as their tasks have stopped."""
        self.cancel()
        with self._lock:
            unused = self._slots - len(self._tasks)
            self._slots -= unused
        if unused:
            self._pool.admission.release(unused, self._job)

    def _task_settled(self) -> None:
        self._pool.admission.release(1, self._job)


class _Worker:
    """One planning process with its own pipe."""

    def __init__(self, context, initargs: tuple):
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, initargs), daemon=True, name="planning-worker")
        self.conn = parent
        self.busy = False
        try:
            self.process.start()
        finally:
            child.close()
        self.pid = self.process.pid
        if self._wait() is None:
            self.close()
            raise OSError("the planning worker died while starting")

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
        # no orphan keeps planning.
        self.kill()
        self.conn.close()
        self.process.join(5)
        try:
            self.process.close()
        except ValueError:
            pass


def _worker_main(conn, initargs: tuple) -> None:
    # The server owns shutdown: a terminal's Ctrl-C reaches the whole process group, and a worker
    # would otherwise die with a KeyboardInterrupt traceback while the server drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_initializer(*initargs)
    conn.send(("ok", None))
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the worker lives on
            reply = ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
        conn.send(reply)


class PlanningPool:
    def __init__(
        self,
        workers: int,
        max_queued: int,
        limits: RequestLimits,
        cost_model: CostModel,
        log_level: str = "INFO",
        on_restart=None,
        inline: InlineBound = InlineBound(),
        log_format: str = "text",
        max_job_share: float = 1.0,
        scheduler_implementation: str = "exact",
    ):
        self.workers = workers
        self.admission = Admission(workers + max_queued, max_job_share)
        self.limits = limits
        self.cost_model = cost_model
        self.inline = inline
        self._initargs = (log_level, limits, cost_model, log_format, scheduler_implementation)
        self._on_restart = on_restart or (lambda reason: None)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(_PRELOAD)
        self._queue: deque[Task] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.tasks_run = 0  # tasks that workers have answered (inline ones not included)
        # Requests planning in a handler thread now: nothing can stop one, so a server that drains
        # with one still running ends its process rather than wait for it (server.serve).
        self.inline_running = 0
        self._live: dict[int, _Worker] = {}  # slot -> its current worker
        self._ready = threading.Semaphore(0)
        self._threads = [
            threading.Thread(target=self._serve_slot, args=(slot,), name=f"planning-slot-{slot}", daemon=True)
            for slot in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def capacity(self) -> int:
        return self.admission.capacity

    @property
    def in_flight(self) -> int:
        """Slots held by requests whose work has not stopped yet."""
        return self.admission.in_flight

    @property
    def busy(self) -> int:
        """Workers running a task now."""
        return sum(1 for w in list(self._live.values()) if w.busy)

    def pids(self) -> list[int]:
        return [w.pid for w in list(self._live.values())]

    def warm_up(self, timeout: float = 600.0) -> None:
        """Waits until every worker has imported Megatron-Core and planned once; with inline
        planning on, this process too."""
        if self.inline.max_samples > 0:
            planning_worker.warm_up()
        end = time.monotonic() + timeout
        started = 0
        while started < self.workers and not self._stopping:
            if self._ready.acquire(timeout=0.1):
                started += 1
            elif time.monotonic() > end:
                raise RuntimeError(f"planning workers did not start within {timeout:.0f} s")

    def admit(self, slots: int = 1, job: str = "") -> Work:
        """Reserves `slots` for one request of `job`; raises PoolOverloaded when the bound is
        reached, JobShareExceeded (a PoolOverloaded) when the job holds its share."""
        self.admission.reserve(slots, job)
        return Work(self, slots, job)

    def plan(self, request_bytes: bytes, deadline: float, timeout: float, on_abandon=None) -> WorkerResult:
        """Plans one request inline or on a worker. Raises PoolOverloaded when full, TimeoutError
        past `timeout`, WorkersLost when workers keep dying. `on_abandon(callback)` registers a
        callback to run when the caller goes away (grpc's context.add_callback). The job name is
        read from the wire bytes (planner_server.wire) for the per-job share."""
        job = read_job(request_bytes)
        if self.inline.admits(request_bytes):
            self.admission.reserve(1, job)
            with self._wakeup:
                self.inline_running += 1
            try:
                return self._plan_inline(request_bytes, deadline, timeout)
            finally:
                with self._wakeup:
                    self.inline_running -= 1
                self.admission.release(1, job)
        end = time.monotonic() + timeout
        work = self.admit(1, job)
        try:
            result, part = self._run(work, plan_part_in_worker, request_bytes, deadline, 0, timeout=timeout, on_abandon=on_abandon)
        finally:
            work.close()
        if part is None:
            return result  # not auto, or refused as a whole
        return self._plan_auto_rest(request_bytes, deadline, end, on_abandon, (result, part), job)

    def _plan_auto_rest(self, request_bytes: bytes, deadline: float, end: float, on_abandon, first, job: str = "") -> WorkerResult:
        """auto's other candidates, side by side on the workers, in two rounds: every one but the
        deferred, then the deferred with the best cost so far, which may skip them
        (batch_planner.planner.plan_candidates does the same in one process). The request holds a
        slot for each candidate (the work it really causes), all stopped together when its caller
        goes away."""
        count, later = first[1].count, first[1].deferred
        work = self.admit(count - 1, job)
        try:
            if on_abandon is not None and on_abandon(work.cancel) is False:
                work.cancel()  # the RPC has already ended
            parts = {0: first}

            def run_round(indices, best=None) -> None:
                tasks = [(k, work.submit(plan_part_in_worker, request_bytes, deadline, k, best)) for k in indices]
                for k, task in tasks:
                    try:
                        parts[k] = task.result(max(0.0, end - time.monotonic()))
                    except TaskCancelled:
                        raise TimeoutError from None

            run_round([k for k in range(1, count) if k not in later])
            run_round([k for k in later if k != 0], best_cost(part.summary.predicted_step_cost for _, part in parts.values()))
        finally:
            work.close()
        return assemble_auto([parts[k] for k in range(count)], job_cp=first[1].job_cp)

    def _run(self, work: Work, fn, *args, timeout: float, on_abandon):
        if on_abandon is not None and on_abandon(work.cancel) is False:
            work.cancel()  # the RPC has already ended
        task = work.submit(fn, *args)
        try:
            return task.result(timeout)
        except TaskCancelled:
            raise TimeoutError from None  # the caller is gone; whatever we answer is unseen

    def _plan_inline(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        started = time.monotonic()
        result = plan_request_bytes(request_bytes, deadline, self.limits, self.cost_model)
        if time.monotonic() - started > timeout:
            raise TimeoutError  # the caller has given up: the same answer a slow worker gets
        return result

    def shutdown(self) -> None:
        """Drops queued tasks and kills the workers at once; for the end of a drain."""
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
                if task.cancelled:
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
                return _Worker(self._context, self._initargs)
            except Exception as exc:  # noqa: BLE001 - e.g. the forkserver was killed: it is restarted
                log.warning("could not start a planning worker (%s: %s); retrying in %.2f s",
                            type(exc).__name__, exc, backoff)
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
            if reply is not None:
                with self._wakeup:
                    self.tasks_run += 1
                kind, value = reply
                task._settle(value=value) if kind == "ok" else task._settle(error=value)
                continue
            return self._lost(task)

    def _lost(self, task: Task) -> str:
        """The worker died under `task`: settle or re-run the task; say why the worker died."""
        if task.cancelled:
            task._settle(error=TaskCancelled())
            return ABANDONED
        if self._stopping:
            task._settle(error=WorkersLost("the planner is shutting down"))
        elif task.attempts >= _ATTEMPTS:
            task._settle(error=WorkersLost(f"planning workers died under this request {task.attempts} times"))
        else:
            log.warning("a planning worker died under a request; planning it again (attempt %d)", task.attempts + 1)
            self._enqueue(task, front=True)
        return DIED
