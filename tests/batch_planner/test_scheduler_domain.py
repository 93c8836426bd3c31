"""Every request gets a plan, the named substitute, or a clear refusal, in process (the server's and
the trainer client's half, and SIGTERM while upstream loops: tests/planner_server/
test_scheduler_domain_served.py, which runs the cases defined here).

- The reproducers (Megatron-Core looping, raising IndexError or asserting): on a layout outside
  the domain, or a batch upstream refuses, each is refused (INVALID_ARGUMENT naming the field) or
  answered OUT_OF_RANGE (upstream's own refusal of the batch, named); on a layout planned batch by
  batch (dynamic CP on a DPxCP that is not a power of two) each gets the substitute, named with
  upstream's failure, with the same plan id everywhere. Never INTERNAL: in process, on
  Megatron-Core's own code (scheduler_implementation=upstream: a loop is cut off).
- batch_planner/domain.py agrees with the sweep's measurements (docs/domain/*.json, made by
  scripts/characterize_domain.py) and docs/design.md holds its table.
- A seeded property test over random layouts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from batch_planner import bounded
from batch_planner.convert import plan_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.domain import BATCH_LIMITS, DOMAINS, domain_table
from batch_planner.errors import ErrorCode, PlanningError
from batch_planner.exact.verified import SchedulerImplementation, select_implementation
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import discover_schedulers
from batch_planner.substitute import SubstituteReason
from tests.support.planner_process import ROOT
from tests.support.megatron_builds import require_scheduler
from tests.support.reliability_support import assert_plan_well_formed

DYNAMIC, STATIC, HYBRID, AUTO = SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING, SchedulerKind.HYBRID_CP, SchedulerKind.AUTO

# Found with the exact path (SchedulerWouldNotTerminate): upstream's align_sample_id_groups loops
# for ever on these, with at least micro_batch_group_size samples. 12 ranks and 6 samples: planned
# inline by a default server; 48 ranks: on a worker.
LOOPS_INLINE = PlanRequest.of((2538, 3172, 3192, 58, 2900, 1874), 6, 2, 1024, scheduler=DYNAMIC, micro_batch_group_size=3)
LOOPS_ON_A_WORKER = PlanRequest.of((1891, 1984, 2718, 1604, 3280, 909, 434, 2048, 166), 4, 12, 1024,
                                   scheduler=DYNAMIC, micro_batch_group_size=3)

# (name, request, the code, the field the message starts with)
REPRODUCERS = [
    # 1. dynamic CP with VPP grouping and fewer samples than micro_batch_group_size (upstream would
    #    loop for ever on these 48 ranks): refused by validation.
    ("too-few-samples-48-ranks", PlanRequest.of((22, 46), 4, 12, 7, scheduler=DYNAMIC, micro_batch_group_size=14),
     "INVALID_ARGUMENT", "micro_batch_group_size"),
    ("too-few-samples-48-ranks-b", PlanRequest.of((100, 200, 300), 8, 6, 4096, scheduler=DYNAMIC, micro_batch_group_size=4),
     "INVALID_ARGUMENT", "micro_batch_group_size"),
    # 2. dynamic CP on an odd DPxCP: parallel_state needs an even one.
    ("dynamic-odd-3-ranks", PlanRequest.of((100, 200, 300), 3, 1, 4096, scheduler=DYNAMIC), "INVALID_ARGUMENT", "layout"),
    # 3. dynamic CP, VPP grouping with few samples: upstream asserts "no tail microbatch has enough ids".
    ("vpp-2-samples-group-54", PlanRequest.of((31818, 31818), 2, 4, 32768, scheduler=DYNAMIC, micro_batch_group_size=54),
     "INVALID_ARGUMENT", "micro_batch_group_size"),
    ("vpp-4-samples-group-3", PlanRequest.of((100, 200, 300, 400), 16, 2, 4096, scheduler=DYNAMIC, micro_batch_group_size=3),
     "OUT_OF_RANGE", "sequence_lengths"),
    # 4. static packing with max_seqs_per_micro_batch and VPP grouping: "Not enough samples to move".
    ("static-packing-49-samples", PlanRequest.of(tuple(range(100, 5000, 100))[:49], 1, 8, 8192, scheduler=STATIC,
                                                 max_seqs_per_micro_batch=1, micro_batch_group_size=2), "OUT_OF_RANGE", "sequence_lengths"),
    # hybrid CP on a non-power-of-two DPxCP (IndexError in 0.19's fill_empty_gpus).
    ("hybrid-20-ranks", PlanRequest.of(tuple(sample_lengths("lognormal_32k", 64, seed=1)), 10, 2, 8192, scheduler=HYBRID),
     "INVALID_ARGUMENT", "layout"),
]
# (name, request, why upstream's plan is not valid): dynamic CP on a DPxCP that is not a power of
# two, where the substitute is served.
SUBSTITUTED = [
    # upstream's align_sample_id_groups loops for ever (VPP grouping).
    ("loops-12-ranks-inline", LOOPS_INLINE, SubstituteReason.UPSTREAM_LOOP),
    ("loops-48-ranks-worker", LOOPS_ON_A_WORKER, SubstituteReason.UPSTREAM_LOOP),
    # IndexError in fill_empty_gpus_once, without VPP.
    *[(f"indexerror-{n}-ranks", PlanRequest.of(tuple(sample_lengths("megatron_dcp", 64, seed=n)), n, 1, per_rank, scheduler=DYNAMIC),
       SubstituteReason.UPSTREAM_ERROR) for n, per_rank in ((26, 8192), (30, 8192), (108, 4096))],
    # a CP group parallel_state does not build (16 on 24 ranks).
    ("group-16-on-24-ranks", PlanRequest.of(tuple(min(n, 32768) for n in sample_lengths("lognormal_32k", 48, seed=11)), 12, 2, 4096,
                                            scheduler=DYNAMIC), SubstituteReason.UNBUILDABLE_CP_GROUP),
]
SUBSTITUTED_IDS = [name for name, *_ in SUBSTITUTED]
IDS = [name for name, *_ in REPRODUCERS]


def _available(request: PlanRequest) -> None:
    require_scheduler(request.scheduler)


def _answer(request: PlanRequest):
    try:
        return plan_batch(request)
    except PlanningError as error:
        return error


def _check_refusal(result, code: str, field: str) -> None:
    assert isinstance(result, PlanningError), "planned a request the domain refuses"
    assert result.code.value == code, result
    assert result.code is not ErrorCode.INTERNAL
    assert str(result).startswith(f"{field}: "), result


@pytest.mark.parametrize("implementation", list(SchedulerImplementation))
@pytest.mark.parametrize("name, request_, code, field", REPRODUCERS, ids=IDS)
def test_reproducers_are_refused_or_answered_out_of_range_in_process(name, request_, code, field, implementation):
    _available(request_)
    select_implementation(implementation)  # upstream: Megatron-Core's own code, which can loop
    try:
        plan_batch(PlanRequest.of((512,) * 8, 2, 2, 4096, scheduler=request_.scheduler))  # imports paid
        result = _answer(request_)
    finally:
        select_implementation(None)
    _check_refusal(result, code, field)
    if code == "INVALID_ARGUMENT" and field == "layout":
        assert ("power of two" in str(result) and "auto" in str(result)) or "even" in str(result), result
    if code == "OUT_OF_RANGE":
        assert any(limit.upstream_message in str(result) for limit in BATCH_LIMITS), result


def _the_substitute(request: PlanRequest):
    """What must be served: Megatron-Core's static-packing plan of the same batch."""
    from batch_planner.planner import substitute_cp_size

    cp = substitute_cp_size(request)
    return plan_batch(request.replace(scheduler=STATIC, context_parallel_size=cp, data_parallel_size=request.dp_cp_size // cp,
                                      min_cp_size=None))


@pytest.mark.parametrize("implementation", list(SchedulerImplementation))
@pytest.mark.parametrize("name, request_, reason", SUBSTITUTED, ids=SUBSTITUTED_IDS)
def test_failing_batches_get_the_named_substitute_in_process(name, request_, reason, implementation, monkeypatch):
    """Upstream's own code (implementation=upstream) loops on two of these: it is cut off (the
    limit lowered here to keep the test short) and the same substitute, with the same id, served."""
    _available(request_)
    monkeypatch.setattr(bounded, "DEFAULT_LIMIT_SECONDS", 1.0)
    select_implementation(implementation)
    try:
        plan = plan_batch(request_)
    finally:
        select_implementation(None)
    assert plan.substitution is not None and plan.substitution.requested is DYNAMIC
    assert plan.substitution.reason is reason, plan.substitution
    assert plan.scheduler is STATIC and plan.scheduler_class == "DpBalancedScheduler"
    expected = _the_substitute(request_)
    assert plan.micro_batches == expected.micro_batches
    assert plan.plan_id == plan_batch(request_).plan_id  # the exact path's id: the same on either implementation
    assert plan.plan_id != expected.plan_id  # a substitute's id says what it stands in for
    assert_plan_well_formed(plan_to_proto(plan), list(request_.sequence_lengths), request_.dp_cp_size)


@pytest.mark.parametrize("name, request_, reason", SUBSTITUTED, ids=SUBSTITUTED_IDS)
def test_auto_plans_dynamic_cp_candidates_batch_by_batch_and_never_serves_a_substitute(name, request_, reason):
    """auto on the same batches: each dynamic-CP candidate is planned where upstream's plan of the
    batch (with that candidate's budget) is valid, and listed as not planned, naming upstream's
    failure, where it is not; auto serves the cheapest plan it has, never a substitute."""
    _available(request_)
    plan = plan_batch(request_.replace(scheduler=AUTO, micro_batch_group_size=request_.micro_batch_group_size))
    assert plan.substitution is None
    dynamic = [c for c in plan.candidates if c.scheduler is DYNAMIC]
    assert dynamic
    for candidate in dynamic:
        alone = plan_batch(request_.replace(max_seqlen_per_dp_cp_rank=candidate.max_seqlen_per_dp_cp_rank, min_cp_size=candidate.min_cp_size))
        if alone.substitution is None:
            assert candidate.predicted_step_cost is not None or candidate.skipped_lower_bound is not None, candidate
        else:
            assert candidate.predicted_step_cost is None and alone.substitution.reason.value in candidate.not_planned_reason, candidate
    assert any(c.predicted_step_cost is None and "dynamic_cp" in c.name for c in dynamic if reason.value in c.not_planned_reason)


def test_the_fallback_on_upstreams_own_code_cuts_the_loop_off_and_serves_the_same_plan(monkeypatch):
    """A trainer planning in process with Megatron-Core's own code (scheduler_implementation=
    upstream) on a batch where upstream loops for ever: the call is cut off (the limit lowered
    here), the trainer does not hang, and it gets the substitute with the exact path's plan id."""
    name, request_, reason = SUBSTITUTED[0]
    assert reason is SubstituteReason.UPSTREAM_LOOP
    _available(request_)
    expected = plan_batch(request_)
    monkeypatch.setattr(bounded, "DEFAULT_LIMIT_SECONDS", 1.0)
    client = _client(request_, "", scheduler_implementation="upstream")
    try:
        plan = client.plan_step(0, list(request_.sequence_lengths))
    finally:
        client.close()
        select_implementation(None)
    assert plan.plan_id == expected.plan_id and plan.micro_batches == expected.micro_batches
    assert plan.substitution.reason is SubstituteReason.UPSTREAM_LOOP and "cut off" in plan.substitution.detail


def _client(request: PlanRequest, endpoint: str, **options):
    from trainer_client.service.client import BatchPlannerClient
    from trainer_client.service.config import PlannerClientConfig

    config = PlannerClientConfig(
        planner_endpoint=endpoint, tls=False, scheduler=request.scheduler, context_parallel_size=request.context_parallel_size,
        max_seqlen_per_dp_cp_rank=request.max_seqlen_per_dp_cp_rank, micro_batch_group_size=request.micro_batch_group_size,
        max_seqs_per_micro_batch=request.max_seqs_per_micro_batch, calibration=False, job="domain",
        deadline_seconds=30.0, **options,
    )
    return BatchPlannerClient(config, dp_cp_size=request.dp_cp_size, rank=0)


# --- the domain against the sweep's measurements, and the table in the design doc ---------------

DOMAIN_FILES = sorted((ROOT / "docs" / "domain").glob("*.json"))


def plans_every_batch(scheduler: SchedulerKind, dp_cp_size: int, option_class: str) -> bool:
    """Whether the domain says `scheduler` plans every batch on `dp_cp_size` ranks in the sweep's
    option class ("no_vpp", or "vpp": micro_batch_group_size > 1)."""
    domain = DOMAINS[scheduler]
    return domain.exact_sizes(dp_cp_size) and (option_class == "no_vpp" or domain.vpp)


@pytest.mark.parametrize("path", DOMAIN_FILES, ids=[p.stem for p in DOMAIN_FILES])
def test_the_domain_accepts_exactly_the_layouts_the_sweep_found_plannable(path: Path):
    """Every batch is planned by upstream exactly where the sweep saw no failure; every other
    even size is planned batch by batch (with the substitute) by a scheduler that substitutes,
    and refused by one that does not."""
    report = json.loads(path.read_text())
    checked = 0
    for name, found in report["schedulers"].items():
        if not found["available"]:
            continue
        domain = DOMAINS[SchedulerKind(name)]
        for option_class, measured in found["classes"].items():
            accepted = set(measured["accepted_sizes"])
            for size in measured["sizes"]:
                assert plans_every_batch(SchedulerKind(name), size, option_class) == (size in accepted), (
                    f"{name} {option_class} on DPxCP {size}: the sweep says "
                    f"{'plannable' if size in accepted else measured['failing'].get(str(size))}"
                )
                if size not in accepted:
                    assert domain.per_batch(size) == domain.substitutes, f"{name} on DPxCP {size}"
                    assert (size in measured["substitute_sizes"]) == domain.per_batch(size), f"{path.name}: {name} on DPxCP {size}"
                checked += 1
    assert checked > 50


def test_design_doc_holds_the_domain_table():
    design = (ROOT / "docs" / "design.md").read_text()
    assert domain_table() in design, "docs/design.md's domain table differs from batch_planner.domain.domain_table()"


# --- a seeded property test over random layouts --------------------------------------------------


def _random_request(rng: random.Random) -> PlanRequest:
    dp_cp = rng.choice([2 * rng.randint(1, 64), 2 ** rng.randint(1, 7)])
    cp = rng.choice([c for c in (1, 2, 4, 8) if dp_cp % c == 0])
    many = rng.random() < 0.5
    count = rng.randint(64, 512) if many else rng.randint(1, 12)
    per_rank = rng.choice([1024, 4096, 8192])
    lengths = tuple(max(1, min(per_rank * cp, n)) for n in sample_lengths(rng.choice(["megatron_dcp", "long_tail_16k"]), count,
                                                                          rng.randint(0, 999)))
    # The schedulers this build has (the release leg has hybrid CP only), auto always.
    scheduler = rng.choice([k for k in (DYNAMIC, DYNAMIC, STATIC, HYBRID) if discover_schedulers()[k].available] + [AUTO])
    group = rng.choice([None, None, *range(1, 9)]) if scheduler is not HYBRID else None
    max_seqs = rng.choice([None, None, 1, 2, 8]) if scheduler is STATIC else None
    return PlanRequest.of(lengths, dp_cp // cp, cp, per_rank, scheduler=scheduler, micro_batch_group_size=group,
                          max_seqs_per_micro_batch=max_seqs)


def test_random_layouts_get_a_valid_plan_or_a_refusal():
    rng = random.Random(24)
    plan_batch(PlanRequest.of((512,) * 8, 2, 2, 4096))  # imports paid
    answers = []
    for _ in range(160):
        request = _random_request(rng)
        result = _answer(request)
        if isinstance(result, PlanningError):
            assert result.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.OUT_OF_RANGE, ErrorCode.FAILED_PRECONDITION), (
                f"{result.code.value} for {request}: {result}")
            assert result.field and str(result).startswith(result.field), result
        else:
            assert_plan_well_formed(plan_to_proto(result), list(request.sequence_lengths), request.dp_cp_size)
        answers.append(result)
    refused = sum(isinstance(result, PlanningError) for result in answers)
    assert len(answers) - refused >= 40 and refused >= 20, (len(answers) - refused, refused)
