"""The substitute plan: what is served when Megatron-Core's plan of a batch is not valid.

On a layout where upstream's dynamic-CP plan is valid batch by batch rather than for every batch
(batch_planner/domain.py, `SchedulerDomain.per_batch`), the planner runs upstream's algorithm,
bounded, checks the plan's invariants, and serves it when it passes. When upstream raises, loops,
or places a CP group `parallel_state` does not build, it serves Megatron-Core's static-packing plan
of the same batch instead (DpBalancedScheduler, on the job's own DP and CP sizes), names it in the
response (`Substitution`), counts it and logs it. This module holds the vocabulary; the decision is
batch_planner/planner.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from batch_planner.errors import ErrorCode, PlanningError
from batch_planner.request import SchedulerKind

# What serves a batch whose scheduler's plan is not valid: Megatron-Core's static packing.
SUBSTITUTE_SCHEDULER = SchedulerKind.STATIC_PACKING


class SubstituteReason(str, Enum):
    """Why upstream's plan was not served: the metric label `reason` (bounded: these values only)."""

    UPSTREAM_ERROR = "upstream_error"  # Megatron-Core's scheduler raised (IndexError, AssertionError ...)
    UPSTREAM_LOOP = "upstream_loop"  # it would loop for ever (exact path), or was cut off (its own code)
    UNBUILDABLE_CP_GROUP = "unbuildable_cp_group"  # a CP group parallel_state does not build (invariants 2-3)


@dataclass(frozen=True)
class Substitution:
    """Why the served plan is not the one the request's scheduler was asked for."""

    requested: SchedulerKind  # the scheduler whose plan was not valid for this batch
    reason: SubstituteReason
    detail: str  # upstream's failure, in words (its exception, the loop, or the invariant broken)

    def describe(self) -> str:
        return (
            f"served Megatron-Core's {SUBSTITUTE_SCHEDULER.value} plan of this batch instead of {self.requested.value}'s "
            f"({self.reason.value}: {self.detail})"
        )


class UpstreamPlanInvalid(PlanningError):
    """On a layout planned batch by batch (batch_planner/domain.py, `per_batch`), Megatron-Core's
    scheduler raised, looped or placed a CP group parallel_state does not build on this batch. The
    planner serves the substitute instead; auto lists the candidate as not planned. OUT_OF_RANGE
    where it is answered (an auto candidate): the same batch fails the same way everywhere."""

    code = ErrorCode.OUT_OF_RANGE

    def __init__(self, reason: SubstituteReason, detail: str):
        super().__init__(f"scheduler: {reason.value}: {detail}", field="scheduler")
        self.reason = reason
        self.detail = detail  # upstream's failure in words (Substitution.detail)
