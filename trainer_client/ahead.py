"""Plan ahead: fetch step N+1's plan in a background thread while step N trains.

The data loader already knows the next batch's lengths, so the plan can be ready before the
trainer asks. `get` waits only for what is not ready yet; that wait is the
`batch_planner_client_plan_wait_seconds` metric.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from batch_planner.request import PlanRequest
from trainer_client.plan_source import SourcedPlan

log = logging.getLogger(__name__)


class PlanAhead:
    """Keeps at most a few steps' plans in flight, keyed by step number."""

    def __init__(self, plan_fn: Callable[[PlanRequest], SourcedPlan], max_pending: int = 2):
        self._plan_fn = plan_fn
        # One thread: plans arrive in step order and the planner sees one request per trainer.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-ahead")
        self._pending: dict[int, tuple[PlanRequest, Future[SourcedPlan]]] = {}
        self._max_pending = max_pending
        self._lock = threading.Lock()

    def prefetch(self, step: int, request: PlanRequest) -> None:
        with self._lock:
            if step in self._pending:
                return
            # Steps the trainer skipped are dropped rather than kept forever.
            while len(self._pending) >= self._max_pending:
                oldest = min(self._pending)
                self._pending.pop(oldest)[1].cancel()
            self._pending[step] = (request, self._executor.submit(self._plan_fn, request))

    def pending_request(self, step: int) -> PlanRequest | None:
        """The request prefetched for `step`, if any (so the caller need not build it again)."""
        with self._lock:
            pending = self._pending.get(step)
        return pending[0] if pending is not None else None

    def get(self, step: int, request: PlanRequest) -> tuple[SourcedPlan, float]:
        """The plan for `step` and the seconds this call waited for it."""
        started = time.perf_counter()
        with self._lock:
            pending = self._pending.pop(step, None)
        if pending is not None and pending[0] is not request and pending[0] != request:
            log.warning("step %d: the batch differs from the one prefetched; planning it again", step)
            pending[1].cancel()
            pending = None
        sourced = pending[1].result() if pending is not None else self._plan_fn(request)
        return sourced, time.perf_counter() - started

    def close(self) -> None:
        with self._lock:
            for _, future in self._pending.values():
                future.cancel()
            self._pending.clear()
        self._executor.shutdown(wait=True)
