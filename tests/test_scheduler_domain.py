"""Every request gets a plan, the named substitute, or a clear refusal, and the server stops on SIGTERM.

- The reproducers (Megatron-Core looping, raising IndexError or asserting): on a layout outside
  the domain, or a batch upstream refuses, each is refused (INVALID_ARGUMENT naming the field) or
  answered OUT_OF_RANGE (upstream's own refusal of the batch, named); on a layout planned batch by
  batch (dynamic CP on a DPxCP that is not a power of two) each gets the substitute, named with
  upstream's failure, with the same plan id everywhere. Never INTERNAL: in process, on
  Megatron-Core's own code (scheduler_implementation=upstream: a loop is cut off), through the
  server, and through the trainer client, with and without a service.
- batch_planner/domain.py agrees with the sweep's measurements (docs/domain/*.json, made by
  scripts/characterize_domain.py) and docs/design.md holds its table.
- A seeded property test over random layouts.
- SIGTERM while upstream code loops in a worker and in a handler thread (a server whose domain
  check is switched off, tests/unbounded_domain): the process ends within --drain-seconds + 5 s.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import grpc
import pytest

from batch_planner import bounded
from batch_planner.convert import plan_to_proto, request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.domain import BATCH_LIMITS, DOMAINS, domain_table
from batch_planner.errors import ErrorCode, PlanningError
from batch_planner.exact.verified import SchedulerImplementation, select_implementation
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import discover_schedulers
from batch_planner.substitute import SubstituteReason
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.planner_process import ROOT, start_planner
from tests.megatron_builds import require_scheduler
from tests.reliability_support import assert_plan_well_formed, metric, wait_for_metric, wait_until

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
def test_substitutes_through_the_server_are_named_counted_logged_and_get_the_in_process_id(planner, stub, name, request_, reason):
    _available(request_)
    expected = plan_batch(request_)
    labels = {"scheduler": "dynamic_cp", "reason": reason.value}
    before = metric(planner, "batch_planner_substituted_total", **labels)
    response = stub.Plan(request_to_proto(request_), timeout=30)
    assert response.plan_id == expected.plan_id
    # Counted under its reason, and logged with the request's plan id and what it stands in for.
    wait_for_metric(planner, "batch_planner_substituted_total", lambda v: v == before + 1, "the substitute counted", **labels)
    wait_until(lambda: f"plan_id={expected.plan_id}" in planner.log and f"substitute_reason={reason.value}" in planner.log or None,
               30, "the substitute logged")
    assert response.scheduler == pb.SCHEDULER_STATIC_PACKING and response.HasField("substitution")
    assert response.substitution.requested == pb.SCHEDULER_DYNAMIC_CP
    assert pb.SubstituteReason.Name(response.substitution.reason) == f"SUBSTITUTE_REASON_{reason.name}"
    assert response.substitution.detail == expected.substitution.detail


@pytest.mark.parametrize("with_service", [False, True], ids=["in-process-fallback", "service"])
def test_the_trainer_client_gets_the_substitute_with_the_same_id(planner, with_service):
    name, request_, reason = SUBSTITUTED[0]
    _available(request_)
    expected = plan_batch(request_)
    client = _client(request_, planner.address if with_service else "")
    try:
        plan = client.plan_step(0, list(request_.sequence_lengths))
    finally:
        client.close()
    plan = getattr(plan, "plan", plan)
    assert plan.plan_id == expected.plan_id and plan.substitution == expected.substitution


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


@pytest.mark.parametrize("name, request_, code, field", REPRODUCERS, ids=IDS)
def test_reproducers_through_the_server_get_the_in_process_answer(stub, name, request_, code, field):
    _available(request_)
    expected = _answer(request_)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Plan(request_to_proto(request_), timeout=30)
    assert caught.value.code().name == code
    assert caught.value.details() == str(expected)


def _client(request: PlanRequest, endpoint: str, **options):
    from trainer_client.client import BatchPlannerClient
    from trainer_client.config import PlannerClientConfig

    config = PlannerClientConfig(
        planner_endpoint=endpoint, tls=False, scheduler=request.scheduler, context_parallel_size=request.context_parallel_size,
        max_seqlen_per_dp_cp_rank=request.max_seqlen_per_dp_cp_rank, micro_batch_group_size=request.micro_batch_group_size,
        max_seqs_per_micro_batch=request.max_seqs_per_micro_batch, calibration=False, job="domain",
        deadline_seconds=30.0, **options,
    )
    return BatchPlannerClient(config, dp_cp_size=request.dp_cp_size, rank=0)


@pytest.mark.parametrize("with_service", [False, True], ids=["in-process-fallback", "service"])
@pytest.mark.parametrize("name, request_, code, field", REPRODUCERS, ids=IDS)
def test_the_trainer_client_raises_the_same_clear_error_at_once(planner, name, request_, code, field, with_service):
    """Without a service the client plans in process: validation refuses before any scheduler
    runs; with one, the refusal is not retried and not planned in process again (REJECT)."""
    from trainer_client.rpc_client import PlanRejectedError

    _available(request_)
    expected = _answer(request_)
    client = _client(request_, planner.address if with_service else "")
    try:
        with pytest.raises(PlanRejectedError) as caught:
            client.plan_step(0, list(request_.sequence_lengths))
        fallbacks = sum(s.value for m in client.metrics.registry.collect() if m.name == "batch_planner_client_fallbacks"
                        for s in m.samples if s.name.endswith("_total"))
    finally:
        client.close()
    assert caught.value.code == code and caught.value.server_message == str(expected)
    assert fallbacks == 0, "a refusal was planned in process again"


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


# --- upstream's own code on the server: a loop cut off within the deadline -----------------------


def test_a_server_on_upstreams_own_code_cuts_loops_off_within_the_deadline_inline_and_on_a_worker():
    """`--scheduler-implementation upstream`: the two looping reproducers, one planned inline in a
    handler thread and one on a worker, each with a 4 s deadline. Each is cut off before its
    deadline and answered with the substitute (not DEADLINE_EXCEEDED, not INTERNAL), with the exact
    path's plan id; the worker and the handler are free again: the next requests are planned."""
    require_scheduler(DYNAMIC)
    server = start_planner("--inline-max-ranks", "16", "--inline-max-samples", "128", "--scheduler-implementation", "upstream",
                           workers=1)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            for request_ in (LOOPS_INLINE, LOOPS_ON_A_WORKER):
                response = stub.Plan(request_to_proto(request_), timeout=4.0)
                assert response.plan_id == plan_batch(request_).plan_id
                assert response.substitution.reason == pb.SUBSTITUTE_REASON_UPSTREAM_LOOP
                assert "cut off" in response.substitution.detail, response.substitution.detail
            for request_ in (LOOPS_INLINE.replace(micro_batch_group_size=None), LOOPS_ON_A_WORKER.replace(micro_batch_group_size=None)):
                stub.Plan(request_to_proto(request_), timeout=30)
    finally:
        server.stop()


# --- shutdown while upstream code loops ----------------------------------------------------------


def test_sigterm_ends_the_server_within_drain_seconds_while_upstream_loops_inline_and_on_a_worker(monkeypatch):
    """The domain check switched off (tests/unbounded_domain) and Megatron-Core's own code
    (scheduler_implementation=upstream): the two looping reproducers really loop, one in a gRPC
    handler thread (12 ranks, 6 samples: inline) and one on a worker (48 ranks)."""
    require_scheduler(DYNAMIC)
    drain = 2.0
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'unbounded_domain'}")
    server = start_planner(
        "--drain-seconds", str(drain), "--inline-max-ranks", "16", "--inline-max-samples", "128",
        "--scheduler-implementation", "upstream", workers=1,
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            calls = [stub.Plan.future(request_to_proto(r), timeout=120) for r in (LOOPS_INLINE, LOOPS_ON_A_WORKER)]
            wait_for_metric(server, "batch_planner_in_flight_requests", lambda v: v >= 2, "both plans running")
            wait_for_metric(server, "batch_planner_busy_workers", lambda v: v >= 1, "the worker planning")
            assert not any(call.done() for call in calls), "a looping plan returned"
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(drain + 30)
            took = time.monotonic() - started
        assert took < drain + 5, f"the server took {took:.1f} s to exit after SIGTERM, --drain-seconds is {drain}"
        assert "still planning inline" in server.log or "did not finish" in server.log, server.log[-2000:]
    finally:
        server.stop(signal.SIGKILL)
