"""Skips a test that needs a scheduler the installed Megatron-Core lacks, printing why; under
`./dev test` on the default (dev) build, where every scheduler must be there, fails it instead."""

from __future__ import annotations

import os

import pytest

from batch_planner.request import SchedulerKind
from batch_planner.schedulers import discover_schedulers


def require_scheduler(kind: SchedulerKind) -> None:
    availability = discover_schedulers()[kind]
    if availability.available:
        return
    if os.environ.get("PLANNER_REQUIRE_ALL_SCHEDULERS") == "1":
        pytest.fail(f"{availability.reason}; ./dev test installs a Megatron-Core with every scheduler")
    pytest.skip(availability.reason)


def best_local_scheduler() -> SchedulerKind:
    """The scheduler a trainer-side test plans with: dynamic CP (the client's default) where this
    process's Megatron-Core has it, else hybrid CP (the release leg), so that in-process fallback
    can plan too."""
    if discover_schedulers()[SchedulerKind.DYNAMIC_CP].available:
        return SchedulerKind.DYNAMIC_CP
    return SchedulerKind.HYBRID_CP
