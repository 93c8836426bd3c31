"""The exact path against Megatron-Core's own code: the same plans, byte for byte, and the same
exceptions, on a seeded corpus of 10,000 scheduler calls, on hypothesis' inputs and through the
whole planning pipeline; where upstream loops for ever, the exact path stops and says so. Every
implementation of the exact path runs each case: the pure-Python one and the compiled one
(batch_planner/exact/compiled_dynamic_cp.py; skipped, with the reason, where the compiler is not
importable), each against the same upstream outcome.

Runs on both legs: the dev build has dynamic CP; on a build without it (the 0.19.2 release) the
dynamic-CP tests are skipped with that reason printed, never faked.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_planner.exact import compiler
from batch_planner.exact import dynamic_cp as exact_dynamic_cp
from batch_planner.exact.verified import (
    SchedulerImplementation,
    exact_path_status,
    fingerprint,
    select_implementation,
)
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import _load_class, _quiet_import, discover_schedulers
from tests.support.exact_corpus import Case, corpus, non_power_of_two_corpus, outcome, served_bytes, tally
from tests.support.megatron_builds import require_scheduler

CORPUS_SIZE = 10_000
CORPUS_WORKERS = 2
# Where the exact path says upstream loops for ever, upstream's VPP refill step (`fill_empty`) is
# stopped after this many calls; the corpus's runs that end need at most 162.
LOOP_BUDGET = ("fill_empty", 1_000)

# Issue reproducers: upstream's VPP alignment loops for ever on these (dp, cp, max_seqlen, lengths,
# micro_batch_group_size).
LOOPING = (
    (4, 12, 7, (22, 46), 14),
    (8, 6, 4096, (100, 200, 300), 4),
)


@pytest.fixture(scope="module", autouse=True)
def dynamic_cp_build():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    status = exact_path_status(SchedulerKind.DYNAMIC_CP)
    if not status.active:
        pytest.fail(f"the exact dynamic-CP path is not active on this build: {status.reason}")


def _upstream(case: Case):
    cls = _load_class(SchedulerKind.DYNAMIC_CP)
    scheduler = cls(case.max_seqlen, case.cp, case.dp, case.micro_batch_group_size, min_cp_size=case.min_cp_size)
    return scheduler.get_groups_and_subsamples(list(enumerate(case.lengths)))


# The exact path's executions the corpus runs; the compiled one where the compiler is importable.
EXECUTIONS = ("exact", "compiled") if compiler.available() else ("exact",)


def _execution(name: str):
    if name == "compiled":
        from batch_planner.exact import compiled_dynamic_cp

        return compiled_dynamic_cp.get_groups_and_subsamples
    return exact_dynamic_cp.get_groups_and_subsamples


def test_the_compiled_execution_is_checked_here():
    """Says so (a skip with the reason) where the corpus cannot run the compiled execution."""
    if not compiler.available():
        pytest.skip(f"the compiled exact path is not checked: {compiler.unavailable_reason()}")
    assert "compiled" in EXECUTIONS


def _exact(case: Case, execution: str = "exact"):
    utils = _quiet_import("megatron.core.datasets.data_schedule_utils")
    return _execution(execution)(
        list(enumerate(case.lengths)),
        max_seq_len_per_rank=case.max_seqlen,
        total_ranks=case.dp_cp,
        min_cp_size=case.min_cp_size,
        microbatch_group_size_per_vp_stage=case.micro_batch_group_size,
        cp_min=utils.dcp_gpus_needed,
        cap_delta=utils._DYNAMIC_CP_WORKLOAD_CAP_DELTA,
    )


def _compare(case: Case) -> tuple[dict[str, tuple], tuple]:
    """Every execution's outcome on `case`, and upstream's (run once)."""
    ours = {
        name: outcome(lambda name=name: _exact(case, name), named=f"the exact path ({name}) on {case.describe()}")
        for name in EXECUTIONS
    }
    if ours["exact"][:2] == ("raised", "SchedulerWouldNotTerminate"):
        return ours, outcome(lambda: _upstream(case), budget=LOOP_BUDGET, named=f"upstream on {case.describe()}")
    return ours, outcome(lambda: _upstream(case), named=f"upstream on {case.describe()}")


def _agree(exact: tuple, upstream: tuple) -> bool:
    if exact[:2] == ("raised", "SchedulerWouldNotTerminate"):
        return upstream[0] == "no end"
    return exact == upstream


def _compare_all(cases: list[Case]) -> list[tuple[dict[str, tuple], tuple]]:
    return [_compare(case) for case in cases]


@pytest.mark.timeout(1200)  # about a minute on two idle cores; a loaded machine may take much longer
def test_corpus_of_ten_thousand_calls_gives_identical_plans_and_exceptions(capsys):
    cases = corpus(CORPUS_SIZE, seed=0)
    started = time.perf_counter()
    # Both cores: upstream's side is pure Python and the slow one. Forked workers inherit the
    # imported Megatron-Core.
    chunks = [cases[i::CORPUS_WORKERS] for i in range(CORPUS_WORKERS)]
    with multiprocessing.get_context("fork").Pool(CORPUS_WORKERS) as pool:
        results = pool.map(_compare_all, chunks)
    differences, outcomes = [], []
    for chunk, compared in zip(chunks, results):
        for case, (ours, upstream) in zip(chunk, compared):
            outcomes.append(upstream if ours["exact"][:2] != ("raised", "SchedulerWouldNotTerminate") else ("loops for ever",))
            differences += [(case, name, exact, upstream) for name, exact in ours.items() if not _agree(exact, upstream)]
    counts = tally(outcomes)
    with capsys.disabled():
        print(
            f"\nexact path ({', '.join(EXECUTIONS)}) vs upstream dynamic CP: {len(cases)} requests compared in "
            f"{time.perf_counter() - started:.0f} s, {len(differences)} differences; upstream outcomes: {dict(sorted(counts.items()))}"
        )
    assert not differences, "\n".join(
        f"{case.describe()}\n  {name}: {str(exact)[:300]}\n  upstream: {str(upstream)[:300]}" for case, name, exact, upstream in differences[:5]
    )
    # The corpus reaches every kind of outcome: plans, upstream's own exceptions, and loops.
    assert counts["ok"] > CORPUS_SIZE // 2
    assert counts["raised IndexError"] and counts["raised AssertionError"] and counts["loops for ever"]


@pytest.mark.parametrize("dp, cp, max_seqlen, lengths, group", LOOPING)
def test_where_upstream_loops_for_ever_the_exact_path_stops_and_says_so(dp, cp, max_seqlen, lengths, group):
    case = Case(lengths, dp, cp, max_seqlen, 1, group, "reproducer")
    for name in EXECUTIONS:
        exact = outcome(lambda name=name: _exact(case, name), named=f"the exact path ({name}) on {case.describe()}")
        assert exact[:2] == ("raised", "SchedulerWouldNotTerminate"), name
        assert "would loop for ever" in exact[2]
    upstream = outcome(lambda: _upstream(case), budget=LOOP_BUDGET, named=f"upstream on {case.describe()}")
    assert upstream[0] == "no end", f"upstream finished: {upstream}"


_LAYOUTS = st.sampled_from([(dp_cp, cp) for dp_cp in (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128) for cp in (1, 2, 4) if dp_cp % cp == 0])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=_LAYOUTS,
    lengths=st.lists(st.integers(min_value=1, max_value=70_000), min_size=1, max_size=120),
    max_seqlen=st.sampled_from((16, 1024, 4096, 8192)),
    min_cp=st.sampled_from((1, 2, 4)),
    group=st.sampled_from((None, 1, 2, 3, 5)),
)
def test_hypothesis_inputs_give_identical_plans_and_exceptions(layout, lengths, max_seqlen, min_cp, group):
    dp_cp, cp = layout
    case = Case(tuple(lengths), dp_cp // cp, cp, max_seqlen, min_cp, group, "hypothesis")
    ours, upstream = _compare(case)
    for name, exact in ours.items():
        assert _agree(exact, upstream), f"{case.describe()}\n  {name}: {exact}\n  upstream: {upstream}"


def test_the_whole_pipeline_serves_the_same_bytes_and_refusals(capsys):
    """Validation, the scheduler, invariants, statistics, plan id: the response bytes (or the
    refusal) are the same whichever code plans."""
    compared = plans = 0
    for case in corpus(600, seed=1):
        request = PlanRequest.of(
            case.lengths,
            case.dp,
            case.cp,
            case.max_seqlen,
            scheduler=SchedulerKind.DYNAMIC_CP,
            min_cp_size=case.min_cp_size if case.min_cp_size > 1 else None,
            micro_batch_group_size=case.micro_batch_group_size,
        )
        exact = served_bytes(request, SchedulerImplementation.EXACT)
        if "would loop for ever" in str(exact):
            continue  # upstream's own code never returns here; the loop tests cover it
        upstream = served_bytes(request, SchedulerImplementation.UPSTREAM)
        assert exact == upstream, case.describe()
        if "compiled" in EXECUTIONS:
            assert served_bytes(request, SchedulerImplementation.COMPILED) == upstream, f"compiled: {case.describe()}"
        compared += 1
        plans += exact[0] == "plan"
    with capsys.disabled():
        print(f"\nwhole pipeline, exact vs upstream: {compared} requests, {plans} plans, identical bytes and refusals")
    assert plans > 100


def _upstream_verdict(case: Case, request: PlanRequest) -> tuple:
    """What upstream's own code does with the batch, judged independently of the planner:
    ("valid", its assignment), ("batch limit",), or ("invalid", the substitute reason)."""
    from batch_planner.domain import batch_limit
    from batch_planner.errors import InvariantViolationError
    from batch_planner.padding import PlanPadding
    from batch_planner.plan import Plan, check_plan_invariants, micro_batches_from_assignment
    from batch_planner.request import CapacityBound
    from batch_planner.schedulers import valid_cp_sizes

    upstream = outcome(lambda: _upstream(case), budget=LOOP_BUDGET, named=f"upstream on {case.describe()}")
    if upstream[0] == "no end":
        return ("invalid", "upstream_loop")
    if upstream[0] == "raised":
        limit = batch_limit(SchedulerKind.DYNAMIC_CP, _raised(upstream))
        return ("batch limit",) if limit is not None else ("invalid", "upstream_error")
    micro_batches, columns = micro_batches_from_assignment(upstream[1], PlanPadding.for_request(request))
    plan = Plan("", SchedulerKind.DYNAMIC_CP, "", "", request.dp_cp_size, 1, request.cp_layout,
                CapacityBound.PER_RANK_SUM, micro_batches)
    try:
        check_plan_invariants(plan, request, valid_cp_sizes(SchedulerKind.DYNAMIC_CP, request.dp_cp_size, request.context_parallel_size,
                                                            request.min_cp_size), columns)
    except InvariantViolationError as broken:
        assert broken.invariant in ("2", "3"), f"upstream's plan loses or overfills samples: {broken}"
        return ("invalid", "unbuildable_cp_group")
    return ("valid", micro_batches)


def _raised(upstream: tuple) -> BaseException:
    return AssertionError(upstream[2]) if upstream[1] == "AssertionError" else RuntimeError(upstream[2])


def test_non_power_of_two_sizes_serve_upstreams_plan_where_valid_and_the_named_substitute_elsewhere(capsys):
    """Dynamic CP on 6, 10, 12, 20, 24, 40, 48 and 96 ranks, through the whole pipeline: where
    upstream's own plan of the batch keeps every invariant the served plan is that plan, byte for
    byte (and no substitution is named); where upstream raises, loops or places a group
    parallel_state does not build, the substitute is served, named with that reason, and it is
    Megatron-Core's static-packing plan of the same batch."""
    from batch_planner.convert import plan_to_proto
    from batch_planner.errors import PlanningError
    from batch_planner.planner import plan_batch, substitute_cp_size

    started = time.perf_counter()
    counts: dict[str, int] = {}
    for case in non_power_of_two_corpus(400, seed=2):
        request = PlanRequest.of(
            case.lengths, case.dp, case.cp, case.max_seqlen, scheduler=SchedulerKind.DYNAMIC_CP,
            min_cp_size=case.min_cp_size if case.min_cp_size > 1 else None, micro_batch_group_size=case.micro_batch_group_size,
        )
        try:
            served = plan_batch(request)
        except PlanningError as refused:
            assert refused.code.value in ("INVALID_ARGUMENT", "OUT_OF_RANGE"), f"{case.describe()}: {refused}"
            counts[f"refused {refused.code.value}"] = counts.get(f"refused {refused.code.value}", 0) + 1
            continue
        verdict = _upstream_verdict(case, request)
        assert verdict[0] != "batch limit", f"{case.describe()}: served although upstream refuses the batch"
        if verdict[0] == "valid":
            assert served.substitution is None and served.scheduler is SchedulerKind.DYNAMIC_CP, case.describe()
            expected = plan_to_proto(replace(served, micro_batches=verdict[1]))
            assert plan_to_proto(served).SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
            counts["upstream's plan"] = counts.get("upstream's plan", 0) + 1
        else:
            assert served.substitution is not None and served.substitution.reason.value == verdict[1], (case.describe(), served.substitution)
            cp = substitute_cp_size(request)
            static = plan_batch(request.replace(scheduler=SchedulerKind.STATIC_PACKING, context_parallel_size=cp,
                                                data_parallel_size=request.dp_cp_size // cp, min_cp_size=None))
            assert served.micro_batches == static.micro_batches, case.describe()
            counts[f"substitute: {verdict[1]}"] = counts.get(f"substitute: {verdict[1]}", 0) + 1
    with capsys.disabled():
        print(f"\nnon-power-of-two DPxCP, served vs upstream: {dict(sorted(counts.items()))} in {time.perf_counter() - started:.0f} s")
    assert counts.get("upstream's plan", 0) > 100
    assert all(counts.get(f"substitute: {reason}") for reason in ("upstream_error", "upstream_loop", "unbuildable_cp_group")), counts


def test_exact_path_runs_only_on_a_verified_build_and_setting(monkeypatch):
    kind = SchedulerKind.DYNAMIC_CP
    assert discover_schedulers()[kind].available
    assert exact_path_status(kind).active, exact_path_status(kind).reason
    assert "verified against Megatron-Core" in exact_path_status(kind).reason
    # The default: compiled where the compiler is importable, else the pure-Python exact path.
    expected = SchedulerImplementation.COMPILED if compiler.available() else SchedulerImplementation.EXACT
    assert exact_path_status(kind).implementation is expected, exact_path_status(kind).reason
    for setting in SchedulerImplementation:
        select_implementation(setting)
        try:
            assert exact_path_status(kind).implementation is (expected if setting is SchedulerImplementation.COMPILED else setting)
        finally:
            select_implementation(None)
    # Hybrid CP has no compiled kernel: the compiled setting runs its pure-Python exact path, and says so.
    hybrid = exact_path_status(SchedulerKind.HYBRID_CP)
    assert hybrid.implementation is SchedulerImplementation.EXACT and "no compiled kernel" in hybrid.reason

    select_implementation("upstream")
    try:
        assert not exact_path_status(kind).active
        assert "setting" in exact_path_status(kind).reason
    finally:
        select_implementation(None)

    monkeypatch.setenv("BATCH_PLANNER_SCHEDULER_IMPLEMENTATION", "upstream")
    exact_path_status.cache_clear()
    assert not exact_path_status(kind).active
    monkeypatch.setenv("BATCH_PLANNER_SCHEDULER_IMPLEMENTATION", "fast")
    exact_path_status.cache_clear()
    with pytest.raises(ValueError, match="BATCH_PLANNER_SCHEDULER_IMPLEMENTATION: got 'fast'; allowed: 'compiled', 'exact', 'upstream'"):
        exact_path_status(kind)
    monkeypatch.delenv("BATCH_PLANNER_SCHEDULER_IMPLEMENTATION")
    exact_path_status.cache_clear()

    # Another build's source (here: a fingerprint the list does not hold) runs upstream's code.
    monkeypatch.setattr("batch_planner.exact.verified.VERIFIED", {kind: {"0" * 64: "some other build"}})
    exact_path_status.cache_clear()
    try:
        status = exact_path_status(kind)
        assert not status.active
        assert f"fingerprint {fingerprint(kind)[:16]}" in status.reason and "not one the exact path was verified against" in status.reason
    finally:
        monkeypatch.undo()
        exact_path_status.cache_clear()
    assert exact_path_status(kind).active
