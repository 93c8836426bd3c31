"""Plans for verl's mini-batches: one rank of the DPxCP group asks, all ranks agree, and each
distinct mini-batch is planned once.

verl schedules the same data several times per rollout batch: the old log-probs, the reference
log-probs, then `ppo_epochs` updates over the same mini-batches. Plan ids are deterministic, so
plans are cached by the request's digest (`trainer_client.broadcast.canonical_digest`, over
`batch_planner.identity.canonical_request`): a mini-batch seen again reuses its plan and asks the
service nothing. The cache is bounded (least recently used out). `prefetch` starts planning
several mini-batches at once in background threads, so their planning overlaps the log-prob
passes; `plan` then waits only for what has not arrived.

The cache lives on the asking rank (rank 0 of the group); every `plan` call is the same two
collectives on every rank, hit or miss (`agree_on_plan`: the plan's broadcast, then the check that
every rank holds the same plan for the same batch), so ranks can never disagree on whether a
collective runs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch.distributed as dist

from batch_planner.plan import Plan
from batch_planner.request import PlanRequest
from trainer_client.broadcast import RankError, agree_on_plan, canonical_digest
from trainer_client.client import BatchPlannerClient
from trainer_client.config import PlannerClientConfig, WhoAsks
from trainer_client.plan_source import PlannerUnavailableError, SourcedPlan
from trainer_client.rpc_client import PlanRejectedError

# Distinct mini-batches whose plans one group keeps: a rollout batch's mini-batches, with room.
DEFAULT_CACHE_SIZE = 64


class CachedPlanner:
    """Plans one DPxCP group's batches with a `BatchPlannerClient` (service, fallback, metrics)."""

    def __init__(self, config: PlannerClientConfig, group: Any, cache_size: int = DEFAULT_CACHE_SIZE):
        if cache_size < 1:
            raise ValueError(f"cache_size: {cache_size!r} is not allowed; expected an integer >= 1")
        self.client = BatchPlannerClient(config, group=group, cp_groups=None)
        self.group = group
        self.cache_size = cache_size
        self._plans: OrderedDict[str, Future[SourcedPlan]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=config.plan_ahead_depth, thread_name_prefix="verl-plan")
        self.hits = 0
        self.misses = 0

    @property
    def metrics(self):
        return self.client.metrics

    def request(self, lengths: Sequence[int]) -> PlanRequest:
        return self.client.request_for(lengths)

    def prefetch(self, batches_lengths: Sequence[Sequence[int]]) -> None:
        """Start planning each batch not planned yet (asking rank only; no collective)."""
        if not self.client.asks:
            return
        for lengths in batches_lengths:
            self._future(self.request(lengths))

    def plan(self, lengths: Sequence[int]) -> Plan:
        """The group's plan for a batch: a collective, every rank of the group calls it."""
        started = time.perf_counter()
        request = self.request(lengths)
        own: Plan | RankError | None = None
        response = b""  # the serialized PlanResponse, when the service sent `own`
        if self.client.asks:
            future = self._future(request, count=True)
            try:
                sourced = future.result()
                own, self.client.last_source, response = sourced.plan, sourced.source, sourced.response
            except (PlanRejectedError, PlannerUnavailableError) as error:
                own = error
            if not isinstance(own, Plan):
                self._forget(request)  # a failure is not cached: the next call asks again
        plan = agree_on_plan(own, request, self.group, WhoAsks.LEADER, response)
        self.client.planned_batches.record(plan, request.sequence_lengths)
        m = self.metrics
        m.plan_wait.labels(m.job).observe(time.perf_counter() - started)
        m.micro_batches.labels(m.job).set(len(plan.micro_batches))
        return plan

    def _future(self, request: PlanRequest, count: bool = False) -> Future[SourcedPlan]:
        digest = canonical_digest(request)
        with self._lock:
            found = self._plans.get(digest)
            if found is not None:
                self._plans.move_to_end(digest)
                if count:
                    self.hits += 1
                return found
            if count:
                self.misses += 1
            future = self._plans[digest] = self._executor.submit(self.client.source.plan, request)
            while len(self._plans) > self.cache_size:
                _, oldest = self._plans.popitem(last=False)
                oldest.cancel()
            return future

    def _forget(self, request: PlanRequest) -> None:
        with self._lock:
            self._plans.pop(canonical_digest(request), None)

    def cached(self) -> int:
        with self._lock:
            return len(self._plans)

    def close(self) -> None:
        with self._lock:
            for future in self._plans.values():
                future.cancel()
            self._plans.clear()
        self._executor.shutdown(wait=True)
        self.client.close()


# One planner per DPxCP group and config: verl builds a new DynamicCPScheduler for every
# forward/backward call, so the cache must outlive it.
_planners: dict[tuple, CachedPlanner] = {}
_planners_lock = threading.Lock()


def planner_for(config: PlannerClientConfig, group: Any) -> CachedPlanner:
    key = (_group_key(group), repr(config))
    with _planners_lock:
        found = _planners.get(key)
        if found is None:
            found = _planners[key] = CachedPlanner(config, group)
        return found


def _group_key(group: Any) -> tuple:
    if dist.is_available() and dist.is_initialized() and group is not None:
        try:
            return tuple(dist.get_process_group_ranks(group))
        except (ValueError, RuntimeError):
            pass
    return (id(group),)


def planners() -> list[CachedPlanner]:
    """Every planner this process made (metrics, tests)."""
    with _planners_lock:
        return list(_planners.values())


def close_planners() -> None:
    """Stops every planner this process made (their clients, threads and caches)."""
    with _planners_lock:
        held = list(_planners.values())
        _planners.clear()
    for planner in held:
        planner.close()
