"""Discovery of, and a thin adapter over, Megatron-Core's schedulers.

The algorithm is Megatron-Core's: this module imports its classes and runs them, either through
upstream's own code or (the default, `exact/verified.py` decides where) through the exact
re-execution in batch_planner/exact (compiled, or pure Python), byte-identical to upstream's by the
differential corpus. It
turns their output `sample_id_groups[micro_batch][dp_cp_rank] -> [sample ids]` into CP groups.
Everything a scheduler cannot take is rejected earlier, in validation.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import logging
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from batch_planner import bounded
from batch_planner.cp_groups import is_power_of_two, megatron_cp_group_sizes
from batch_planner.domain import batch_limit, per_batch
from batch_planner.errors import (
    BatchNotPlannableError,
    SchedulerFailedError,
    SchedulerUnavailableError,
    SchedulerWouldNotTerminate,
)
from batch_planner.exact import dynamic_cp as exact_dynamic_cp
from batch_planner.exact import hybrid_cp as exact_hybrid_cp
from batch_planner.exact.verified import SchedulerImplementation, exact_path_status
from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
from batch_planner.substitute import SubstituteReason, UpstreamPlanInvalid

log = logging.getLogger(__name__)

RankAssignment = list[list[list[int]]]  # [micro_batch][dp_cp_rank] -> sample ids


@dataclass(frozen=True)
class SchedulerSpec:
    kind: SchedulerKind
    module: str
    class_name: str
    capacity_bound: CapacityBound
    needs: str  # which Megatron-Core provides it, for the FAILED_PRECONDITION message

    @property
    def qualified_name(self) -> str:
        return f"{self.module}.{self.class_name}"


SCHEDULER_SPECS: dict[SchedulerKind, SchedulerSpec] = {
    SchedulerKind.HYBRID_CP: SchedulerSpec(
        SchedulerKind.HYBRID_CP,
        "megatron.core.pipeline_parallel.hybrid_cp_schedule",
        "BalancedCPScheduler",
        CapacityBound.PER_SAMPLE,
        "megatron-core >= 0.15 (PyPI releases, e.g. 0.19.2)",
    ),
    SchedulerKind.DYNAMIC_CP: SchedulerSpec(
        SchedulerKind.DYNAMIC_CP,
        "megatron.core.datasets.data_schedule",
        "DefaultDynamicCPScheduler",
        CapacityBound.PER_RANK_SUM,
        "a Megatron-Core built from the Megatron-LM dev branch (PR #5154); no PyPI release has it yet",
    ),
    SchedulerKind.STATIC_PACKING: SchedulerSpec(
        SchedulerKind.STATIC_PACKING,
        "megatron.core.datasets.data_schedule",
        "DpBalancedScheduler",
        CapacityBound.PER_RANK_SUM,
        "a Megatron-Core built from the Megatron-LM dev branch; 0.19.x releases lack it",
    ),
}


@dataclass(frozen=True)
class SchedulerAvailability:
    spec: SchedulerSpec
    available: bool
    reason: str  # empty when available


def _quiet_import(module: str):
    # Without this, megatron.core.package_info runs `git rev-parse` in its own folder at import.
    os.environ.setdefault("NO_VCS_VERSION", "1")
    # Megatron-Core warns at import about optional accelerators (Transformer Engine, Apex) that a
    # CPU planner never uses; keep the planner's log for things an operator must act on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


@lru_cache(maxsize=1)
def megatron_core_version() -> str:
    """The installed distribution's version. Not package_info.__version__: that one appends the
    short hash of whatever git repository the process runs in, which would change plan ids."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        os.environ.setdefault("NO_VCS_VERSION", "1")
        return _quiet_import("megatron.core.package_info").__version__
    except Exception as exc:  # noqa: BLE001 - report, never crash, when Megatron-Core is broken
        return f"unavailable ({type(exc).__name__}: {exc})"


@lru_cache(maxsize=None)
def _load_class(kind: SchedulerKind):
    spec = SCHEDULER_SPECS[kind]
    module = _quiet_import(spec.module)
    return getattr(module, spec.class_name)


@lru_cache(maxsize=1)
def discover_schedulers() -> dict[SchedulerKind, SchedulerAvailability]:
    """Which of Megatron-Core's schedulers the installed release provides."""
    found: dict[SchedulerKind, SchedulerAvailability] = {}
    version = megatron_core_version()
    for kind, spec in SCHEDULER_SPECS.items():
        try:
            _load_class(kind)
            found[kind] = SchedulerAvailability(spec, True, "")
        except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError or a broken install
            reason = (
                f"{spec.qualified_name} is not in the installed Megatron-Core {version} "
                f"({type(exc).__name__}); it needs {spec.needs}"
            )
            found[kind] = SchedulerAvailability(spec, False, reason)
    return found


def require_scheduler(kind: SchedulerKind) -> SchedulerSpec:
    availability = discover_schedulers()[kind]
    if not availability.available:
        raise SchedulerUnavailableError(f"scheduler {kind.value!r} is unavailable: {availability.reason}", field="scheduler")
    return availability.spec


def valid_cp_sizes(kind: SchedulerKind, dp_cp_size: int, context_parallel_size: int, min_cp_size: int | None) -> frozenset[int]:
    """CP group sizes a plan of `kind` may use: those Megatron-Core's parallel_state builds
    (batch_planner/cp_groups.py); static packing keeps every sample on the job's CP size."""
    if kind is SchedulerKind.STATIC_PACKING:
        return frozenset({context_parallel_size})
    return megatron_cp_group_sizes(dp_cp_size, min_cp_size if kind is SchedulerKind.DYNAMIC_CP else None)


class _DpCpGroupSize:
    """What BalancedCPScheduler reads from its `dp_cp_group` argument: only `.size()`.

    The planner plans for a job whose ranks live elsewhere, so no process group of that size
    exists here; the scheduler's constructor only asks the group for its size.
    """

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _run_hybrid_cp(cls, request: PlanRequest, seqlens: list[tuple[int, int]], implementation: SchedulerImplementation | None) -> RankAssignment:
    if exact_path_status(SchedulerKind.HYBRID_CP, implementation).active:
        sample_id_groups = exact_hybrid_cp.get_groups_and_subsamples(
            seqlens, max_seq_len_per_rank=request.max_seqlen_per_dp_cp_rank, total_ranks=request.dp_cp_size
        )
    else:
        scheduler = cls(request.max_seqlen_per_dp_cp_rank, _DpCpGroupSize(request.dp_cp_size))
        _, sample_id_groups = scheduler.get_groups_and_subsamples(seqlens, None)
    return [align_cp_groups(rank_ids) for rank_ids in sample_id_groups]


def align_cp_groups(rank_ids: list[list[int]]) -> list[list[int]]:
    """Moves the CP groups of one micro-batch so that each starts at a multiple of its size.

    BalancedCPScheduler (0.19.2) sometimes places a group at an unaligned rank, e.g. a CP2 group on
    ranks 0-1 followed by a CP4 group on ranks 2-5 (tests/planner_server/test_reliability_properties.py has the
    exact batch). Megatron-Core's hybrid CP process groups are aligned rank ranges, so such a plan
    cannot run. Within one micro-batch the ranks are interchangeable (the scheduler balances each
    micro-batch on its own), so placing the same groups largest first - power-of-two sizes that
    sum to a power of two - aligns every group without changing which samples run together or the
    micro-batch's balance. Aligned output is returned unchanged. Groups are runs of ranks with an
    identical sample-id list (docs/design.md, Output of the schedulers).
    """
    runs: list[list[list[int]]] = []
    for ids in rank_ids:
        if runs and list(runs[-1][0]) == list(ids):
            runs[-1].append(ids)
        else:
            runs.append([ids])
    sizes = [len(run) for run in runs]
    if not all(is_power_of_two(size) for size in sizes) or not is_power_of_two(len(rank_ids)):
        return rank_ids  # not ours to fix; the invariant check names what is wrong
    start, aligned = 0, True
    for size in sizes:
        aligned &= start % size == 0
        start += size
    if aligned:
        return rank_ids
    ordered = sorted(runs, key=len, reverse=True)  # stable: equal sizes keep the scheduler's order
    return [ids for run in ordered for ids in run]


def _run_dynamic_cp(cls, request: PlanRequest, seqlens: list[tuple[int, int]], implementation: SchedulerImplementation | None) -> RankAssignment:
    status = exact_path_status(SchedulerKind.DYNAMIC_CP, implementation)
    if status.active:
        utils = _quiet_import("megatron.core.datasets.data_schedule_utils")
        return _dynamic_cp_execution(status.compiled)(
            seqlens,
            max_seq_len_per_rank=request.max_seqlen_per_dp_cp_rank,
            total_ranks=request.dp_cp_size,
            min_cp_size=request.min_cp_size or 1,
            microbatch_group_size_per_vp_stage=request.micro_batch_group_size,
            cp_min=utils.dcp_gpus_needed,
            cap_delta=utils._DYNAMIC_CP_WORKLOAD_CAP_DELTA,
        )
    scheduler = cls(
        request.max_seqlen_per_dp_cp_rank,
        request.context_parallel_size,
        request.data_parallel_size,
        request.micro_batch_group_size,
        min_cp_size=request.min_cp_size or 1,
    )
    return scheduler.get_groups_and_subsamples(seqlens)


def _dynamic_cp_execution(compiled: bool) -> Callable[..., RankAssignment]:
    """The exact dynamic-CP path's entry point: compiled (imported on first use: it imports the
    compiler) or pure Python."""
    if compiled:
        from batch_planner.exact import compiled_dynamic_cp

        return compiled_dynamic_cp.get_groups_and_subsamples
    return exact_dynamic_cp.get_groups_and_subsamples


def _run_static_packing(cls, request: PlanRequest, seqlens: list[tuple[int, int]], _: SchedulerImplementation | None) -> RankAssignment:
    scheduler = cls(
        request.max_seqlen_per_dp_cp_rank,
        request.context_parallel_size,
        request.data_parallel_size,
        request.micro_batch_group_size,
        max_num_seqs=request.max_seqs_per_micro_batch,
    )
    groups = scheduler.get_groups_and_subsamples(seqlens)
    # DpBalancedScheduler returns positions in the list it was given, not the ids in it. The ranks
    # of one CP group share one list object: each is converted once (the result shares it too),
    # not once per rank - a static CP of 1,024 would otherwise copy every sample 1,024 times.
    converted: dict[int, list[int]] = {}  # id() of upstream's list, alive in `groups` meanwhile

    def ids_of(positions: list[int]) -> list[int]:
        ids = converted.get(id(positions))
        if ids is None:
            ids = converted[id(positions)] = [seqlens[pos][0] for pos in positions]
        return ids

    return [[ids_of(rank_ids) for rank_ids in mb] for mb in groups]


_RUNNERS: dict[SchedulerKind, Callable[..., RankAssignment]] = {
    SchedulerKind.HYBRID_CP: _run_hybrid_cp,
    SchedulerKind.DYNAMIC_CP: _run_dynamic_cp,
    SchedulerKind.STATIC_PACKING: _run_static_packing,
}


def run_scheduler(request: PlanRequest, implementation: SchedulerImplementation | None = None) -> RankAssignment:
    """Calls Megatron-Core's scheduler on a validated request, through the exact path where
    `implementation` (None: this process's setting, batch_planner/exact/verified.py) allows it.

    One of upstream's own refusals of the batch (batch_planner/domain.py, BATCH_LIMITS) becomes a
    BatchNotPlannableError (OUT_OF_RANGE) naming upstream's reason. On a layout planned batch by
    batch (domain.per_batch) any other failure, a loop included, is an UpstreamPlanInvalid (the
    planner serves the substitute), and Megatron-Core's own code runs bounded
    (batch_planner/bounded.py): cut off where it would hang. Elsewhere any other upstream exception
    is a SchedulerFailedError (INTERNAL: the domain let through a layout it should not), naming the
    scheduler and the error, never a stack trace to the caller (the server logs the trace).
    """
    spec = require_scheduler(request.scheduler)
    cls = _load_class(request.scheduler)
    seqlens = [(sample_id, int(length)) for sample_id, length in enumerate(request.sequence_lengths)]
    batch_by_batch = per_batch(request.scheduler, request.dp_cp_size)
    run = _RUNNERS[request.scheduler]
    try:
        if batch_by_batch and not exact_path_status(request.scheduler, implementation).active:
            return bounded.call_within(lambda: run(cls, request, seqlens, implementation), bounded.limit_seconds())
        return run(cls, request, seqlens, implementation)
    except bounded.CutOff as cut:
        raise UpstreamPlanInvalid(
            SubstituteReason.UPSTREAM_LOOP,
            f"Megatron-Core {spec.class_name} ({megatron_core_version()}, its own code) was cut off on this batch: {cut}",
        ) from None
    except Exception as exc:  # noqa: BLE001 - translate every upstream failure
        limit = batch_limit(request.scheduler, exc)
        if limit is not None:
            raise BatchNotPlannableError(
                f"sequence_lengths: Megatron-Core {spec.class_name} ({megatron_core_version()}) cannot plan "
                f"these {len(seqlens)} samples on DPxCP {request.dp_cp_size} with micro_batch_group_size "
                f"{request.micro_batch_group_size}: {limit.meaning} (upstream: \"{limit.upstream_message}\"); "
                f"{limit.instead}",
                field="sequence_lengths",
            ) from exc
        failure = f"{type(exc).__name__}: {exc or '(no message)'}"
        if batch_by_batch:
            loop = isinstance(exc, SchedulerWouldNotTerminate)
            reason = SubstituteReason.UPSTREAM_LOOP if loop else SubstituteReason.UPSTREAM_ERROR
            raise UpstreamPlanInvalid(
                reason, f"Megatron-Core {spec.class_name} ({megatron_core_version()}) failed on this batch of DPxCP {request.dp_cp_size}: {failure}"
            ) from exc
        if isinstance(exc, SchedulerWouldNotTerminate):
            log.error("validation let through a request Megatron-Core's %s would loop on: %s", spec.class_name, exc)
        log.exception("Megatron-Core %s failed on a validated request", spec.class_name)
        raise SchedulerFailedError(
            f"Megatron-Core {spec.class_name} ({megatron_core_version()}) failed on this batch: {failure}",
            field="scheduler",
        ) from exc
