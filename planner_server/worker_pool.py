"""A bounded pool of planning processes that replaces workers that die, and plans small requests
inline.

- Bounded: at most `workers + max_queued` requests in flight, inline ones included; past that
  `plan` refuses at once (the caller answers RESOURCE_EXHAUSTED) instead of letting latency grow
  without bound.
- Self-healing: a worker killed (OOM, kill -9) breaks a ProcessPoolExecutor; the pool is rebuilt
  and the requests that were in it are planned again (planning is deterministic, so a retry is
  safe).
- Workers start from a forkserver that has Megatron-Core imported, so a replacement is cheap and no
  worker is forked from the gRPC process's threads. The server's limits and cost model reach each
  worker once, through its initializer.
- Inline: a request within `InlineBound` is planned in the calling (gRPC handler) thread, with the
  same `plan_request_bytes` a worker runs. Megatron-Core's schedulers hold the GIL, so this is only
  for requests that plan in a few milliseconds; for them the hop to a worker process costs about as
  much as the planning.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from batch_planner.cost import CostModel
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.validation import RequestLimits
from planner_server import planning_worker
from planner_server.planning_worker import WorkerResult, plan_in_worker, plan_request_bytes, worker_initializer

log = logging.getLogger(__name__)

_PRELOAD = ["planner_server.worker_preload"]
# Bytes a PlanRequest holds besides its sample lengths: layout, limits, enums and a job name of at
# most 63 characters. Longer messages are not parsed in the handler thread to find their size.
_REQUEST_FIXED_BYTES = 256
_MAX_VARINT_BYTES = 10


class PoolOverloaded(Exception):
    pass


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
    ):
        self.workers = workers
        self.capacity = workers + max_queued
        self.limits = limits
        self.cost_model = cost_model
        self.inline = inline
        self._log_level = log_level
        self._on_restart = on_restart or (lambda: None)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(_PRELOAD)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._generation = 0
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=self._context,
            initializer=worker_initializer,
            initargs=(self._log_level, self.limits, self.cost_model),
        )

    def warm_up(self, timeout: float = 600.0) -> None:
        """Starts every worker and waits until each has imported Megatron-Core and planned once;
        with inline planning on, this process too."""
        futures = [self._executor.submit(_noop) for _ in range(self.workers * 2)]
        if self.inline.max_samples > 0:
            planning_worker.warm_up()
        for future in futures:
            future.result(timeout=timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def pids(self) -> list[int]:
        return [p.pid for p in list(getattr(self._executor, "_processes", {}).values())]

    def plan(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        """Plans inline or in a worker; raises PoolOverloaded when full, TimeoutError past `timeout`."""
        with self._admitted():
            if self.inline.admits(request_bytes):
                return self._plan_inline(request_bytes, deadline, timeout)
            return self._plan_in_worker(request_bytes, deadline, timeout)

    @contextmanager
    def _admitted(self):
        with self._lock:
            if self._in_flight >= self.capacity:
                raise PoolOverloaded(
                    f"{self._in_flight} requests in flight, the server's bound is {self.capacity}"
                )
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _plan_inline(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        started = time.monotonic()
        result = plan_request_bytes(request_bytes, deadline, self.limits, self.cost_model)
        if time.monotonic() - started > timeout:
            raise TimeoutError  # the caller has given up: the same answer a slow worker gets
        return result

    def _plan_in_worker(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        for attempt in range(3):
            executor, generation = self._executor, self._generation
            try:
                future = executor.submit(plan_in_worker, request_bytes, deadline)
                try:
                    return future.result(timeout=timeout)
                except TimeoutError:
                    future.cancel()  # still queued: never start it; running: it finishes unseen
                    raise
            except BrokenProcessPool:
                log.warning("a planning worker died; replacing the pool (attempt %d)", attempt + 1)
                self._replace(generation)
        raise RuntimeError("planning workers keep dying on this request")

    def _replace(self, broken_generation: int) -> None:
        with self._lock:
            if self._generation != broken_generation:
                return  # another thread already replaced it
            old = self._executor
            self._executor = self._new_executor()
            self._generation += 1
        self._on_restart()
        old.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _noop() -> None:
    return None
