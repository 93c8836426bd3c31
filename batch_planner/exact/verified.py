"""When the exact scheduler path runs instead of Megatron-Core's own code: the one home of that rule.

The exact path (batch_planner/exact) is a faster execution of upstream's algorithm, checked
byte for byte against upstream's own code by the differential tests. It is only as good as that
check, so it runs only where

- the setting asks for it (`SchedulerImplementation.COMPILED`, the default, or `EXACT`): the server's
  `--scheduler-implementation` (env `PLANNER_SCHEDULER_IMPLEMENTATION`, like every server flag)
  and the trainer client's `scheduler_implementation` set it for their process; the environment
  variable `BATCH_PLANNER_SCHEDULER_IMPLEMENTATION` is the default of a process that sets neither
  (a script or benchmark calling batch_planner directly); and
- the installed Megatron-Core's source of every upstream function the exact path reproduces hashes
  to a fingerprint in `VERIFIED` below: the builds the differential corpus ran against. Any other
  build (a newer dev commit, a patched release) runs upstream's code, and says so once in the log,
  in GetCapabilities and in the metric `batch_planner_scheduler_exact_path`.

Which execution of the exact path runs: `COMPILED` (the default) runs the schedulers that have a
compiled kernel (`COMPILED_SCHEDULERS`: batch_planner/exact/compiled_dynamic_cp.py) through it
where the compiler (batch_planner/exact/compiler.py) is importable, and the pure-Python exact path
otherwise; `EXACT` always the pure-Python exact path. Both are gated by the same fingerprints: the
differential corpus runs on each implementation.

When upstream's own code changes, run the differential tests against the new build
(tests/batch_planner/test_exact_differential.py), then add the fingerprint that `fingerprint()` prints here.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from batch_planner.request import SchedulerKind

ENVIRONMENT_VARIABLE = "BATCH_PLANNER_SCHEDULER_IMPLEMENTATION"


class SchedulerImplementation(str, Enum):
    """Which code plans where the exact path is verified: its compiled execution, its pure-Python
    one, or (always) Megatron-Core's own code."""

    COMPILED = "compiled"
    EXACT = "exact"
    UPSTREAM = "upstream"


DEFAULT_IMPLEMENTATION = SchedulerImplementation.COMPILED

# The schedulers whose exact path has a compiled kernel (the others run the pure-Python exact path
# under COMPILED).
COMPILED_SCHEDULERS = frozenset({SchedulerKind.DYNAMIC_CP})


# The upstream objects each exact scheduler reproduces: "module:qualified name". Their source (and
# the value of a constant) makes the fingerprint.
UPSTREAM_OBJECTS: dict[SchedulerKind, tuple[str, ...]] = {
    SchedulerKind.DYNAMIC_CP: (
        "megatron.core.datasets.data_schedule:BasePackingScheduler.__init__",
        "megatron.core.datasets.data_schedule:DpBalancedScheduler.__init__",
        "megatron.core.datasets.data_schedule:DefaultDynamicCPScheduler.__init__",
        "megatron.core.datasets.data_schedule:DefaultDynamicCPScheduler.get_groups_and_subsamples",
        "megatron.core.datasets.data_schedule_utils:next_hdp_group_packing_aware",
        "megatron.core.datasets.data_schedule_utils:align_sample_id_groups",
        "megatron.core.datasets.data_schedule_utils:dcp_gpus_needed",
        "megatron.core.datasets.data_schedule_utils:_DYNAMIC_CP_WORKLOAD_CAP_DELTA",
    ),
    SchedulerKind.HYBRID_CP: ("megatron.core.pipeline_parallel.hybrid_cp_schedule:BalancedCPScheduler",),
}

# Fingerprints of the upstream sources the differential corpus was run against, and the build.
VERIFIED: dict[SchedulerKind, dict[str, str]] = {
    SchedulerKind.DYNAMIC_CP: {
        "bd08514faa222a893819992c5a5cebc5bf83c80a6ede0e82efea87cd61dbf3f9": "0.19.0+dev.d48bd6b (Megatron-LM dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1)",
    },
    # The class's source is the same in both builds.
    SchedulerKind.HYBRID_CP: {
        "55d611b39fa953243548264ecb6953b7aa6197b8906d0c57345b8b9f10acd275": "0.19.2 and 0.19.0+dev.d48bd6b",
    },
}


@dataclass(frozen=True)
class ExactPathStatus:
    """Whether the exact path plans `scheduler` in this process, and why (or why not)."""

    scheduler: SchedulerKind
    active: bool
    reason: str
    compiled: bool = False  # active, through the compiled kernel

    @property
    def implementation(self) -> SchedulerImplementation:
        if not self.active:
            return SchedulerImplementation.UPSTREAM
        return SchedulerImplementation.COMPILED if self.compiled else SchedulerImplementation.EXACT


def _resolve(reference: str) -> object:
    module_name, _, qualified = reference.partition(":")
    value: object = importlib.import_module(module_name)
    for part in qualified.split("."):
        value = getattr(value, part)
    return value


def _source_of(value: object) -> str:
    wrapped = getattr(value, "__wrapped__", value)  # dcp_gpus_needed is wrapped in lru_cache
    if inspect.isroutine(wrapped) or inspect.isclass(wrapped):
        return inspect.getsource(wrapped)
    return repr(value)


@lru_cache(maxsize=None)
def fingerprint(scheduler: SchedulerKind) -> str:
    """sha256 of the installed upstream objects `scheduler`'s exact path reproduces; raises when
    one of them is missing."""
    digest = hashlib.sha256()
    for reference in UPSTREAM_OBJECTS[scheduler]:
        digest.update(reference.encode())
        digest.update(b"\0")
        digest.update(_source_of(_resolve(reference)).encode())
        digest.update(b"\0")
    return digest.hexdigest()


_selected: SchedulerImplementation | None = None


def select_implementation(value: SchedulerImplementation | str | None) -> None:
    """Sets this process's choice (None: back to the environment variable's, else EXACT): for a
    process that plans with one setting, the server (`--scheduler-implementation`), a script or a
    test. A caller with a setting of its own passes it to `plan_batch(implementation=...)` instead."""
    global _selected
    _selected = None if value is None else parse_implementation(value, "scheduler_implementation")
    exact_path_status.cache_clear()


def parse_implementation(value: SchedulerImplementation | str, field: str) -> SchedulerImplementation:
    try:
        return SchedulerImplementation(value)
    except ValueError:
        allowed = ", ".join(repr(v.value) for v in SchedulerImplementation)
        raise ValueError(f"{field}: got {value!r}; allowed: {allowed}") from None


def selected_implementation() -> SchedulerImplementation:
    if _selected is not None:
        return _selected
    from_environment = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if not from_environment:
        return DEFAULT_IMPLEMENTATION
    return parse_implementation(from_environment, ENVIRONMENT_VARIABLE)


@lru_cache(maxsize=None)
def exact_path_status(scheduler: SchedulerKind, implementation: SchedulerImplementation | None = None) -> ExactPathStatus:
    """Whether `scheduler` runs on the exact path (the server logs it at start-up): under
    `implementation`, a caller's own setting (a trainer client's `scheduler_implementation`), or
    when None this process's (`selected_implementation`)."""
    if scheduler not in UPSTREAM_OBJECTS:
        return ExactPathStatus(scheduler, False, "no exact path: Megatron-Core's own code plans it")
    if (implementation or selected_implementation()) is SchedulerImplementation.UPSTREAM:
        return ExactPathStatus(scheduler, False, "Megatron-Core's own code, as the scheduler_implementation setting asks")
    try:
        found = fingerprint(scheduler)
    except Exception as exc:  # noqa: BLE001 - a build without the scheduler, or a changed layout
        return ExactPathStatus(scheduler, False, f"upstream code not found ({type(exc).__name__}: {exc})")
    verified = VERIFIED.get(scheduler, {})
    if found in verified:
        return _active(scheduler, f"verified against Megatron-Core {verified[found]}", implementation or selected_implementation())
    return ExactPathStatus(
        scheduler,
        False,
        f"Megatron-Core's own code: the installed build's {scheduler.value} source (fingerprint {found[:16]}) "
        "is not one the exact path was verified against",
    )


def _active(scheduler: SchedulerKind, verified: str, implementation: SchedulerImplementation) -> ExactPathStatus:
    """The exact path's status where it is verified: compiled where the setting, a kernel and the
    compiler allow, else the pure-Python exact path, saying why."""
    from batch_planner.exact import compiler

    if implementation is SchedulerImplementation.EXACT:
        return ExactPathStatus(scheduler, True, f"exact path (pure Python, as the scheduler_implementation setting asks), {verified}")
    if scheduler not in COMPILED_SCHEDULERS:
        return ExactPathStatus(scheduler, True, f"exact path (pure Python: {scheduler.value} has no compiled kernel), {verified}")
    if not compiler.available():
        return ExactPathStatus(scheduler, True, f"exact path (pure Python: {compiler.unavailable_reason()}), {verified}")
    return ExactPathStatus(scheduler, True, f"exact path, compiled ({compiler.version()}), {verified}", compiled=True)
