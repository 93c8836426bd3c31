"""A bounded pool of planning processes that replaces workers that die.

- Bounded: at most `workers + max_queued` requests in flight; past that `submit` refuses at once
  (the caller answers RESOURCE_EXHAUSTED) instead of letting latency grow without bound.
- Self-healing: a worker killed (OOM, kill -9) breaks a ProcessPoolExecutor; the pool is rebuilt
  and the requests that were in it are planned again (planning is deterministic, so a retry is
  safe).
- Workers start from a forkserver that has Megatron-Core imported, so a replacement is cheap and no
  worker is forked from the gRPC process's threads.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from batch_planner.cost import CostModel
from batch_planner.validation import RequestLimits
from planner_server.planning_worker import WorkerResult, plan_request_bytes, worker_initializer

log = logging.getLogger(__name__)

_PRELOAD = ["planner_server.worker_preload"]


class PoolOverloaded(Exception):
    pass


class PlanningPool:
    def __init__(
        self,
        workers: int,
        max_queued: int,
        limits: RequestLimits,
        cost_model: CostModel,
        log_level: str = "INFO",
        on_restart=None,
    ):
        self.workers = workers
        self.capacity = workers + max_queued
        self.limits = limits
        self.cost_model = cost_model
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
            initargs=(self._log_level,),
        )

    def warm_up(self, timeout: float = 600.0) -> None:
        """Starts every worker and waits until each has imported Megatron-Core and planned once."""
        futures = [self._executor.submit(_noop) for _ in range(self.workers * 2)]
        for future in futures:
            future.result(timeout=timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def pids(self) -> list[int]:
        return [p.pid for p in list(getattr(self._executor, "_processes", {}).values())]

    def plan(self, request_bytes: bytes, deadline: float, timeout: float) -> WorkerResult:
        """Plans in a worker; raises PoolOverloaded when full, TimeoutError past `timeout`."""
        with self._lock:
            if self._in_flight >= self.capacity:
                raise PoolOverloaded(
                    f"{self._in_flight} requests in flight, the server's bound is {self.capacity}"
                )
            self._in_flight += 1
        try:
            for attempt in range(3):
                executor, generation = self._executor, self._generation
                try:
                    future = executor.submit(plan_request_bytes, request_bytes, deadline, self.limits, self.cost_model)
                    try:
                        return future.result(timeout=timeout)
                    except TimeoutError:
                        future.cancel()  # still queued: never start it; running: it finishes unseen
                        raise
                except BrokenProcessPool:
                    log.warning("a planning worker died; replacing the pool (attempt %d)", attempt + 1)
                    self._replace(generation)
            raise RuntimeError("planning workers keep dying on this request")
        finally:
            with self._lock:
                self._in_flight -= 1

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
