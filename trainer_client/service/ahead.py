"""Plan ahead: fetch the plans of the next `depth` steps in background threads while a step trains,
at most `depth + 1` held (docs/trainer-client.md, "Planning far enough ahead"). `get` waits only for
what is not ready yet and reports each step's lead. Batches without a step are kept by their
request's digest instead (`prefetch_cached`, `get_cached`), least recently used out; a failure is not kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from batch_planner.request import PlanRequest
from trainer_client.errors import InvalidArgumentError
from trainer_client.service.plan_source import SourcedPlan

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: PlanRequest
    future: Future[SourcedPlan]
    arrived: list[float] = field(default_factory=list)  # perf_counter() when the plan arrived
    source: object = None  # what the caller built the request from (its lengths), if it said


@dataclass(frozen=True)
class Fetched:
    """A step's plan as `get` hands it over."""

    sourced: SourcedPlan
    lead_seconds: float  # how long the plan had been ready before `get` asked; 0 when it waited

    @property
    def waited(self) -> bool:
        return self.lead_seconds <= 0.0


# Distinct batches whose plans a client keeps by key (`BatchPlannerClient.plan(lengths, cache=True)`):
# a verl rollout batch's mini-batches, with room. The one default of the client, PlanAhead and verl.
PLAN_CACHE_SIZE = 64


class PlanAhead:
    """Keeps the plans of at most `depth + 1` steps, at most `depth` of them in flight, by step;
    and those of at most `cache_size` batches by key."""

    def __init__(self, plan_fn: Callable[[PlanRequest], SourcedPlan], depth: int = 1, cache_size: int = PLAN_CACHE_SIZE):
        if depth < 1:
            raise InvalidArgumentError(f"plan-ahead depth must be >= 1, got {depth}")
        if type(cache_size) is not int or cache_size < 1:
            raise InvalidArgumentError(f"cache_size: {cache_size!r} is not allowed; expected an integer >= 1")
        self._plan_fn = plan_fn
        self._executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="plan-ahead")
        self._pending: dict[int, _Pending] = {}
        self._max_pending = depth + 1
        self._cached: OrderedDict[str, _Pending] = OrderedDict()
        self.cache_size = cache_size
        self.hits = 0  # get_cached calls that found the batch planned or in flight
        self.misses = 0  # ... that had to plan it
        self._lock = threading.Lock()

    def prefetch(self, step: int, request: PlanRequest, source: object = None) -> bool:
        """Starts planning `step`; False when it is already pending or beyond the bound. `source`:
        the object the request was built from, so that `pending_source` can recognise it."""
        with self._lock:
            if step in self._pending:
                return False
            if len(self._pending) >= self._max_pending:
                farthest = max(self._pending)
                if step > farthest:
                    log.debug("step %d: %d plans already held; not planning it ahead", step, len(self._pending))
                    return False
                self._pending.pop(farthest).future.cancel()  # the nearer step is needed first
            self._pending[step] = self._submit(request)
            self._pending[step].source = source
            return True

    def _submit(self, request: PlanRequest) -> _Pending:
        arrived: list[float] = []

        def plan() -> SourcedPlan:
            sourced = self._plan_fn(request)
            arrived.append(time.perf_counter())  # before the future completes: `get` sees it
            return sourced

        return _Pending(request, self._executor.submit(plan), arrived)

    def pending_request(self, step: int) -> PlanRequest | None:
        """The request prefetched for `step`, if any (so the caller need not build it again)."""
        with self._lock:
            pending = self._pending.get(step)
        return pending.request if pending is not None else None

    def pending_source(self, step: int) -> object:
        """The `source` given with `step`'s prefetch (None if none)."""
        with self._lock:
            pending = self._pending.get(step)
        return pending.source if pending is not None else None

    def get(self, step: int, request: PlanRequest) -> Fetched:
        """The plan for `step` and its lead."""
        asked = time.perf_counter()
        pending = self._take(step)
        if pending is not None and pending.request is not request and pending.request != request:
            log.warning("step %d: the batch differs from the one prefetched; planning it again", step)
            pending.future.cancel()
            pending = None
        if pending is None:
            return Fetched(self._plan_fn(request), 0.0)
        return _fetched(pending, asked)

    def prefetch_cached(self, key: str, request: PlanRequest) -> None:
        """Starts planning the batch of `key` (its request's digest) unless it is kept already."""
        self._entry(key, request)

    def get_cached(self, key: str, request: PlanRequest) -> Fetched:
        """The plan of the batch of `key`: kept, in flight, or planned now (and kept)."""
        asked = time.perf_counter()
        pending = self._entry(key, request, count=True)
        try:
            return _fetched(pending, asked)
        except BaseException:
            with self._lock:
                if self._cached.get(key) is pending:
                    del self._cached[key]  # a failure is not kept: the next call asks again
            raise

    def cached(self) -> int:
        """How many batches' plans are kept or in flight."""
        with self._lock:
            return len(self._cached)

    def _entry(self, key: str, request: PlanRequest, count: bool = False) -> _Pending:
        with self._lock:
            found = self._cached.get(key)
            if count:
                self.hits += found is not None
                self.misses += found is None
            if found is not None:
                self._cached.move_to_end(key)
                return found
            found = self._cached[key] = self._submit(request)
            while len(self._cached) > self.cache_size:
                _, oldest = self._cached.popitem(last=False)
                oldest.future.cancel()
            return found

    def _take(self, step: int) -> _Pending | None:
        """Pops `step` and drops every older step (the trainer has passed them)."""
        with self._lock:
            for stale in [s for s in self._pending if s < step]:
                self._pending.pop(stale).future.cancel()
            return self._pending.pop(step, None)

    def close(self) -> None:
        with self._lock:
            for pending in (*self._pending.values(), *self._cached.values()):
                pending.future.cancel()
            self._pending.clear()
            self._cached.clear()
        self._executor.shutdown(wait=True)


def _fetched(pending: _Pending, asked: float) -> Fetched:
    """`pending`'s plan once it has arrived, with its lead: how long before `asked` it arrived (0
    when it arrived after: the caller waited for it)."""
    ready = pending.future.done()
    lead = max(asked - pending.arrived[0], 0.0) if ready and pending.arrived else 0.0
    return Fetched(pending.future.result(), lead)
