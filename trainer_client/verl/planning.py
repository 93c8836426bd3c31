"""Plans for verl's mini-batches: one rank of the DPxCP group asks, all ranks agree, and each distinct
mini-batch is planned once (docs/verl.md, "What changes"). Every `plan` call is the same collectives on
every rank, hit or miss, so ranks can never disagree on whether a collective runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from batch_planner.plan import Plan
from trainer_client.ahead import PLAN_CACHE_SIZE
from trainer_client.client import BatchPlannerClient
from trainer_client.config import PlannerClientConfig
from trainer_client.dropin.registry import Registry


class CachedPlanner:
    """Plans one DPxCP group's batches with a `BatchPlannerClient` (service, fallback, metrics),
    through its cached plan call (`BatchPlannerClient.plan(lengths, cache=True)`)."""

    def __init__(self, config: PlannerClientConfig, group: Any, cache_size: int = PLAN_CACHE_SIZE):
        self.client = BatchPlannerClient(config, group=group, cp_groups=None, plan_cache_size=cache_size)
        self.metrics = self.client.metrics

    @property
    def hits(self) -> int:
        return self.client.ahead.hits

    @property
    def misses(self) -> int:
        return self.client.ahead.misses

    def prefetch(self, batches_lengths: Sequence[Sequence[int]]) -> None:
        """Start planning each batch not planned yet (asking rank only; no collective)."""
        self.client.prefetch_batches(batches_lengths)

    def plan(self, lengths: Sequence[int]) -> Plan:
        """The group's plan for a batch: a collective, every rank of the group calls it."""
        return self.client.plan(lengths, cache=True)

    def cached(self) -> int:
        return self.client.ahead.cached()

    def close(self) -> None:
        self.client.close()


# One planner per DPxCP group and config: verl builds a new DynamicCPScheduler for every
# forward/backward call, so the cache must outlive it.
_planners: Registry[CachedPlanner] = Registry(by_identity=False)


def planner_for(config: PlannerClientConfig, group: Any) -> CachedPlanner:
    return _planners.get((_group_key(group), repr(config)), lambda: CachedPlanner(config, group))


def _group_key(group: Any) -> tuple:
    if dist.is_available() and dist.is_initialized() and group is not None:
        try:
            return tuple(dist.get_process_group_ranks(group))
        except (ValueError, RuntimeError):
            pass
    return (id(group),)


def planners() -> list[CachedPlanner]:
    """Every planner this process made (metrics, tests)."""
    return _planners.values()


def close_planners() -> None:
    """Stops every planner this process made (their clients, threads and caches)."""
    _planners.close()
