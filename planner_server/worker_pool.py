"""The planning pool: admission (planner_server/admission.py) in front of the worker processes
(planner_server/process_pool.py), inline planning of small requests, and auto's candidates on the
workers. A request reserves its slots before any work starts (one; auto: one per candidate, at
most one per worker, its candidates running one per slot at a time); each comes back once its
task has really stopped, and `Work.cancel()` (the caller went away, or its deadline passed) kills
the workers running them: Megatron-Core's schedulers cannot be interrupted. An inline request runs in
the handler thread and cannot be stopped, so it is bounded (`InlineBound`); the one upstream code
that can loop (dynamic CP on a DPxCP that is not a power of two, batch_planner/domain.py) is
detected by the exact path, or cut off before the deadline (batch_planner/bounded.py); a drain
that finds one running ends the process.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import replace

from batch_planner import bounded
from batch_planner.auto import Candidate, Outcome, PlanOne
from batch_planner.cost_spec import CostModel
from batch_planner.errors import PlanningError
from batch_planner.exact.verified import DEFAULT_IMPLEMENTATION
from batch_planner.plan import Plan
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import RequestLimits
from planner_server import planning_worker
from planner_server.admission import Admission, InlineBound, JobShareExceeded, PoolOverloaded, request_bytes_bound
from planner_server.planning_worker import (
    Parsed, WorkerResult, parse, plan_candidate_in_worker, plan_in_worker, plan_parsed, refusal, worker_initializer,
)
from planner_server.process_pool import ProcessPool, Task, TaskCancelled, WorkersLost

__all__ = ["InlineBound", "JobShareExceeded", "PlanningPool", "PoolOverloaded", "TaskCancelled", "Work", "WorkersLost"]

_PRELOAD = ["planner_server.worker_preload"]
_NO_INLINE = InlineBound()


class Work:
    """What one request runs on the pool: the slots it reserved and the tasks it submitted.

    A slot runs one task at a time. A task that settles frees its slot for the request's next task
    (`map`); once the request is cancelled or closed, each slot is given back as soon as nothing
    runs on it.
    """

    def __init__(self, processes: ProcessPool, admission: Admission, slots: int, job: str = ""):
        self._processes, self._admission = processes, admission
        self._slots = slots  # reserved and not given back yet
        self._running = 0  # submitted tasks not settled yet
        self._job = job
        self._tasks: list[Task] = []
        self._closed = self._cancelled = False
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)

    def submit(self, fn, *args) -> Task:
        # The pool is called outside this request's lock: its threads settle tasks (and so call
        # `_task_settled`, which takes that lock) while holding the pool's own.
        with self._lock:
            if self._closed or self._running >= self._slots:
                raise RuntimeError(f"this request holds {self._slots} slot(s), each running a task")
            self._running += 1
        task = self._processes.submit(fn, *args, on_settled=self._task_settled)
        with self._lock:
            self._tasks.append(task)
            cancelled = self._cancelled
        if cancelled:
            task.cancel()  # cancel() ran while it was being submitted
        return task

    def map(self, fn, calls: list[tuple], end: float) -> list:
        """`fn(*args)` for each of `calls` on the workers, at most one per slot at a time, the
        results in order; TimeoutError past `end` or when the caller is gone."""
        tasks = []
        for args in calls:
            with self._slot_freed:
                freed = self._slot_freed.wait_for(lambda: self._running < self._slots or self._cancelled, max(0.0, end - time.monotonic()))
                if not freed or self._cancelled:
                    raise TimeoutError  # past `end`, or the caller is gone: whatever we answer is unseen
            tasks.append(self.submit(fn, *args))
        return self.results(tasks, end)

    def cancel(self) -> None:
        """Stops every task of the request; safe to call from any thread, any number of times."""
        with self._lock:
            self._cancelled = True
            self._slot_freed.notify_all()
            tasks = list(self._tasks)
        for task in tasks:
            task.cancel()

    def results(self, tasks: list[Task], end: float) -> list:
        """The tasks' results, in order; TimeoutError past `end` or when the caller is gone."""
        try:
            return [task.result(max(0.0, end - time.monotonic())) for task in tasks]
        except TaskCancelled:
            raise TimeoutError from None  # the caller is gone; whatever we answer is unseen

    def cancel_on(self, on_abandon) -> None:
        """Cancels this work when the caller goes away (`on_abandon`: grpc's context.add_callback)."""
        if on_abandon is not None and on_abandon(self.cancel) is False:
            self.cancel()  # the RPC has already ended

    def close(self) -> None:
        """The request is answered: abandoned tasks are cancelled, idle slots given back now and
        the others as soon as their tasks have stopped."""
        self.cancel()
        with self._lock:
            self._closed = True
            idle = self._slots - self._running
            self._slots -= idle
        if idle:
            self._admission.release(idle, self._job)

    def _task_settled(self) -> None:
        with self._lock:
            self._running -= 1
            give_back = self._closed or self._cancelled  # no task of the request will run on it
            if give_back:
                self._slots -= 1
            self._slot_freed.notify_all()
        if give_back:
            self._admission.release(1, self._job)


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
        scheduler_implementation: str = DEFAULT_IMPLEMENTATION.value,
    ):
        self.workers = workers
        self.admission = Admission(workers + max_queued, max_job_share)
        self.limits = limits
        self.cost_model = cost_model
        self.inline = inline
        # The handler parses a request (to run auto's candidates on the workers) only up to the size
        # of the largest valid one: parsing a hostile 64 MiB message in every handler thread would
        # leave that much resident in each thread's malloc arena.
        self._parse_bound = request_bytes_bound(limits.max_samples_per_request)
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

    @property
    def live(self) -> int:
        """Workers running (started, not known dead): with none, a request for a worker fails at once."""
        return self._processes.live

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
        return Work(self._processes, self.admission, slots, job)

    def plan(self, request_bytes: bytes, deadline: float, timeout: float, on_abandon=None, job: str = "") -> WorkerResult:
        """Plans one request of `job` (the request metadata's job name; "" is the shared bucket)
        inline or on a worker. Raises PoolOverloaded when full, TimeoutError past `timeout`,
        WorkersLost when workers keep dying. `on_abandon(callback)` registers a callback to run
        when the caller goes away (grpc's context.add_callback). The request is parsed and hashed
        here once, if it is no larger than a valid one can be; a worker parses the bytes it is sent
        and hashes only those not parsed here."""
        end = time.monotonic() + timeout
        if len(request_bytes) > self._parse_bound:  # cannot be valid: its worker says why
            return self._plan_on_worker(request_bytes, deadline, end, on_abandon, job, digest="")
        try:
            parsed = parse(request_bytes, deadline)
        except PlanningError as exc:
            return refusal(exc, request_bytes)  # not a PlanRequest, or its deadline has passed: no worker needed
        job = job or parsed.about.job  # a client that sends no metadata: the message's job
        if self.inline.admits(parsed.about.samples, parsed.about.ranks):
            return self._plan_inline(parsed, end, job)
        if parsed.message.scheduler == pb.SCHEDULER_AUTO:
            return self._plan_auto(parsed, end, on_abandon, job)
        return self._plan_on_worker(request_bytes, deadline, end, on_abandon, job, parsed.about.request_digest)

    def _plan_on_worker(self, request_bytes: bytes, deadline: float, end: float, on_abandon, job: str, digest: str) -> WorkerResult:
        work = self.admit(1, job)
        try:
            task = work.submit(plan_in_worker, request_bytes, deadline, job, digest)
            work.cancel_on(on_abandon)
            return work.results([task], end)[0]
        finally:
            work.close()

    def _plan_auto(self, parsed: Parsed, end: float, on_abandon, job: str) -> WorkerResult:
        """auto, assembled by the core (batch_planner/auto.py) in this thread, its candidates
        planned side by side on the workers (`_WorkerCandidates`)."""
        run = _WorkerCandidates(self, end, on_abandon, job)
        try:
            passes = (PoolOverloaded, TimeoutError, WorkersLost)
            return plan_parsed(
                parsed, self.limits, self.cost_model, run, admitted_job=job, passes=passes, finish=run.finish,
                worker_seconds=lambda: run.seconds,
            )
        finally:
            run.close()

    def _plan_inline(self, parsed: Parsed, end: float, job: str) -> WorkerResult:
        self.admission.reserve(1, job)
        with self._inline_lock:
            self.inline_running += 1
        try:
            with bounded.request_deadline(time.time() + (end - time.monotonic())):
                result = plan_parsed(parsed, self.limits, self.cost_model, admitted_job=job)
        finally:
            with self._inline_lock:
                self.inline_running -= 1
            self.admission.release(1, job)
        if time.monotonic() > end:
            raise TimeoutError  # the caller has given up: the same answer a slow worker gets
        return result


class _WorkerCandidates:
    """The core's run_candidates seam on the workers. Before the first round it reserves the
    request's slots (`expect`: no round is refused after another's work): one per candidate, at
    most one per worker (no more run at once) and at most the job's share, so one auto request
    always fits in an idle job's share. Each round's candidates run side by side, one per slot at a
    time, and all stop when the caller goes away or the deadline passes. The plans come back
    without their micro-batches, which stay pickled until `finish` gives the served plan its own."""

    def __init__(self, pool: PlanningPool, end: float, on_abandon, job: str):
        self._pool, self._end, self._on_abandon, self._job = pool, end, on_abandon, job
        self._work: Work | None = None
        self._micro_batches: dict[str, bytes] = {}  # by candidate name
        self.seconds = 0.0  # worker time of the candidates planned

    def expect(self, count: int) -> None:
        self._work = self._pool.admit(min(count, self._pool.workers, self._pool.admission.job_bound), self._job)
        self._work.cancel_on(self._on_abandon)

    def __call__(self, found: list[Candidate], plan_one: PlanOne) -> list[Outcome]:
        assert self._work is not None, "the core tells expect() the candidate count first"
        if time.monotonic() >= self._end:
            raise TimeoutError  # the deadline passed between rounds: start no worker on it
        deadline = time.time() + (self._end - time.monotonic())  # upstream's own code is cut off before it
        results = self._work.map(plan_candidate_in_worker, [(candidate, plan_one, deadline) for candidate in found], self._end)
        for outcome, micro_batches in results:
            self._micro_batches[outcome.candidate.name] = micro_batches
            self.seconds += outcome.seconds
        return [outcome for outcome, _ in results]

    def finish(self, plan: Plan) -> Plan:
        served = next(c.name for c in plan.candidates if c.served)
        return replace(plan, micro_batches=pickle.loads(self._micro_batches[served]))

    def close(self) -> None:
        if self._work is not None:
            self._work.close()
