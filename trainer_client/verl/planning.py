"""Plans for verl's mini-batches: one rank of the DPxCP group asks, all ranks agree, and each distinct
mini-batch is planned once (docs/verl.md, "What changes"), through the client's cached plan call
(`BatchPlannerClient.plan(lengths, cache=True)`). Every such call is the same collectives on every
rank, hit or miss, so ranks can never disagree on whether a collective runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

from trainer_client.service.client import BatchPlannerClient
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin.registry import Registry

# One client per DPxCP group and config: verl builds a new DynamicCPScheduler for every
# forward/backward call, so the client and its plan cache must outlive it. They close at
# close_planners(), the end of a closing_planners() block, disable(), or the interpreter's exit.
_planners: Registry[BatchPlannerClient] = Registry(by_identity=False)


def planner_for(config: PlannerClientConfig, group: Any) -> BatchPlannerClient:
    return _planners.get((_group_key(group), repr(config)), lambda: BatchPlannerClient(config, group=group, cp_groups=None))


def _group_key(group: Any) -> tuple:
    if dist.is_available() and dist.is_initialized() and group is not None:
        try:
            return tuple(dist.get_process_group_ranks(group))
        except (ValueError, RuntimeError):
            pass
    return (id(group),)


def planners() -> list[BatchPlannerClient]:
    """Every planner client this process made (metrics, tests)."""
    return _planners.values()


def close_planners() -> None:
    """Stops every planner client this process made (their threads and caches)."""
    _planners.close()


@contextmanager
def closing_planners() -> Iterator[None]:
    """A block at whose end every planner client this process made stops (those left open stop at
    the interpreter's exit anyway)."""
    with _planners:
        yield
