"""The planning pool: admission (planner_server/admission.py) in front of the worker processes
(planner_server/process_pool.py), and inline planning for small requests.

- A request reserves slots (one per task it will run) before any work starts; each comes back
  when its task has really stopped (a result, a queued task dropped, its worker killed), so the
  bound and `in_flight` count what runs. `Work.cancel()` (the caller went away, or its deadline
  passed) stops them all: Megatron-Core's schedulers cannot be interrupted, so killing the worker
  is the only way to stop paying for a plan nobody waits for.
- Inline: a request within `InlineBound` is planned in the calling (gRPC handler) thread. The
  schedulers hold the GIL, so this is only for requests that plan in a few milliseconds, for which
  the hop to a worker costs about as much as the planning; it cannot be cancelled, which is why it
  is bounded, and it is never given work that can loop: validation refuses every layout where
  upstream's code can (batch_planner/domain.py). A drain that still finds one running ends the
  process rather than wait for the thread (planner_server/server.py, `serve`).
"""

from __future__ import annotations

import threading
import time

from batch_planner.auto import best_cost
from batch_planner.cost import CostModel
from batch_planner.validation import RequestLimits
from planner_server import planning_worker
from planner_server.admission import Admission, InlineBound, JobShareExceeded, PoolOverloaded
from planner_server.planning_worker import WorkerResult, assemble_auto, plan_part_in_worker, plan_request_bytes, worker_initializer
from planner_server.process_pool import ProcessPool, Task, TaskCancelled, WorkersLost

__all__ = ["InlineBound", "JobShareExceeded", "PlanningPool", "PoolOverloaded", "TaskCancelled", "Work", "WorkersLost"]

_PRELOAD = ["planner_server.worker_preload"]
_NO_INLINE = InlineBound()


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
            task = self._pool._processes.submit(fn, *args, on_settled=self._task_settled)
            self._tasks.append(task)
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


class PlanningPool:
    def __init__(
        self,
        workers: int,
        max_queued: int,
        limits: RequestLimits,
        cost_model: CostModel,
        log_level: str = "INFO",
        on_restart=None,
        inline: InlineBound = _NO_INLINE,
        log_format: str = "text",
        max_job_share: float = 1.0,
        scheduler_implementation: str = "exact",
    ):
        self.workers = workers
        self.admission = Admission(workers + max_queued, max_job_share)
        self.limits = limits
        self.cost_model = cost_model
        self.inline = inline
        # Requests planning in a handler thread now: nothing can stop one, so a server that drains
        # with one still running ends its process rather than wait for it (server.serve).
        self.inline_running = 0
        self._inline_lock = threading.Lock()
        initargs = (log_level, limits, cost_model, log_format, scheduler_implementation)
        self._processes = ProcessPool(workers, worker_initializer, initargs, _PRELOAD, on_restart)

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
        return self._processes.busy

    @property
    def tasks_run(self) -> int:
        """Tasks that workers have answered (inline ones not included)."""
        return self._processes.tasks_run

    def pids(self) -> list[int]:
        return self._processes.pids()

    def warm_up(self, timeout: float = 600.0) -> None:
        """Waits until every worker has imported Megatron-Core and planned once; with inline
        planning on, this process too."""
        if self.inline.max_samples > 0:
            planning_worker.warm_up()
        self._processes.warm_up(timeout)

    def shutdown(self) -> None:
        """Drops queued tasks and kills the workers at once; for the end of a drain."""
        self._processes.shutdown()

    def admit(self, slots: int = 1, job: str = "") -> Work:
        """Reserves `slots` for one request of `job`; raises PoolOverloaded when the bound is
        reached, JobShareExceeded (a PoolOverloaded) when the job holds its share."""
        self.admission.reserve(slots, job)
        return Work(self, slots, job)

    def plan(self, request_bytes: bytes, deadline: float, timeout: float, on_abandon=None, job: str = "") -> WorkerResult:
        """Plans one request of `job` (the request metadata's job name; "" is the shared bucket)
        inline or on a worker. Raises PoolOverloaded when full, TimeoutError past `timeout`,
        WorkersLost when workers keep dying. `on_abandon(callback)` registers a callback to run
        when the caller goes away (grpc's context.add_callback)."""
        if self.inline.admits(request_bytes):
            self.admission.reserve(1, job)
            with self._inline_lock:
                self.inline_running += 1
            try:
                return self._plan_inline(request_bytes, deadline, timeout)
            finally:
                with self._inline_lock:
                    self.inline_running -= 1
                self.admission.release(1, job)
        end = time.monotonic() + timeout
        work = self.admit(1, job)
        try:
            if on_abandon is not None and on_abandon(work.cancel) is False:
                work.cancel()  # the RPC has already ended
            result, part = work.submit(plan_part_in_worker, request_bytes, deadline, 0).result(timeout)
        except TaskCancelled:
            raise TimeoutError from None  # the caller is gone; whatever we answer is unseen
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

    def _plan_inline(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        started = time.monotonic()
        result = plan_request_bytes(request_bytes, deadline, self.limits, self.cost_model)
        if time.monotonic() - started > timeout:
            raise TimeoutError  # the caller has given up: the same answer a slow worker gets
        return result
