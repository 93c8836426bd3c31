"""The auto policy against the real Megatron-Core: it never serves a plan predicted dearer than the
job's own static CP, is deterministic, lists every candidate (and why one has no plan), follows the
cost model it is given, and refuses clearly when no candidate can plan."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_planner.auto import candidates
from batch_planner.convert import plan_from_proto, plan_to_proto, request_to_proto
from batch_planner.cost_spec import CostModel, CostModelSpec
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.errors import InvalidRequestError
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.megatron_builds import require_scheduler
from tests.planner_process import start_planner

AUTO = SchedulerKind.AUTO
PROFILE = settings(derandomize=True, database=None, deadline=None, max_examples=40,
                   suppress_health_check=[HealthCheck.too_slow])


def auto_request(distribution="lognormal_32k", samples=64, dp=4, cp=2, limit=8192, seed=0, **options) -> PlanRequest:
    return PlanRequest.of(tuple(sample_lengths(distribution, samples, seed)), dp, cp, limit, scheduler=AUTO, **options)


def served(plan):
    (winner,) = [c for c in plan.candidates if c.served]
    return winner


@PROFILE
@given(
    distribution=st.sampled_from(sorted(DISTRIBUTIONS)),
    samples=st.integers(8, 96),
    layout=st.sampled_from([(4, 1), (2, 2), (4, 2), (2, 4), (8, 2), (3, 2), (6, 2)]),
    limit=st.sampled_from([4096, 8192, 16384]),
    seed=st.integers(0, 10_000),
    per_token=st.sampled_from([1.0, 20.0]),  # today's calibration, and a 20x heavier model
)
def test_auto_never_predicts_worse_than_the_jobs_static_cp_and_is_deterministic(distribution, samples, layout, limit, seed, per_token):
    require_scheduler(SchedulerKind.STATIC_PACKING)
    dp, cp = layout
    base = CostModel()
    model = CostModel(seconds_per_token=base.seconds_per_token * per_token,
                      seconds_per_attention_token_pair=base.seconds_per_attention_token_pair * per_token)
    request = auto_request(distribution, samples, dp, cp, limit, seed, cost_model=CostModelSpec(coefficients=model))
    try:
        plan = plan_batch(request)
    except InvalidRequestError as refused:  # no candidate holds the batch: said, with every reason
        assert "static_cp" in str(refused) and "dynamic_cp" in str(refused)
        return
    again = plan_batch(request)
    assert again == plan and again.plan_id == plan.plan_id and again.candidates == plan.candidates
    job_static = plan.candidates[0]
    assert job_static.name == f"static_cp{cp}"
    if job_static.predicted_step_cost is not None:
        assert plan.statistics.predicted_step_cost <= job_static.predicted_step_cost
        assert plan.statistics.predicted_speedup_over_static_cp >= 1.0
    planned = [c.predicted_step_cost for c in plan.candidates if c.predicted_step_cost is not None]
    assert plan.statistics.predicted_step_cost == min(planned) == served(plan).predicted_step_cost
    assert plan.scheduler is served(plan).scheduler and plan.scheduler is not AUTO


def test_candidates_are_the_documented_ones_in_order():
    names = [c.name for c in candidates(auto_request(dp=4, cp=2, limit=8192))]
    assert names == [
        "static_cp2",
        "dynamic_cp max_seqlen=8192", "dynamic_cp max_seqlen=8192 min_cp=2",
        "dynamic_cp max_seqlen=6144", "dynamic_cp max_seqlen=6144 min_cp=2",
        "dynamic_cp max_seqlen=4096", "dynamic_cp max_seqlen=4096 min_cp=2",
        "hybrid_cp max_seqlen=8192", "hybrid_cp max_seqlen=6144", "hybrid_cp max_seqlen=4096",
        "static_cp1", "static_cp4", "static_cp8",
    ]
    restricted = auto_request(auto_schedulers=(SchedulerKind.DYNAMIC_CP,))
    assert {c.request.scheduler for c in candidates(restricted)} == {SchedulerKind.DYNAMIC_CP}


def test_a_candidate_that_cannot_plan_is_listed_with_its_reason_and_never_served():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    plan = plan_batch(auto_request(samples=96, dp=12, cp=2))  # 24 ranks: 0.19's hybrid CP cannot plan it
    hybrid = [c for c in plan.candidates if c.scheduler is SchedulerKind.HYBRID_CP]
    assert hybrid and all(c.predicted_step_cost is None and "power of two" in c.not_planned_reason for c in hybrid)
    assert not any(c.served for c in hybrid)
    assert served(plan).predicted_step_cost is not None


def test_the_cost_model_decides_the_winner():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    request = auto_request("long_tail_16k", 128, dp=4, cp=2, limit=8192)
    cheap_cp = CostModel(cp_seconds_per_micro_batch=0.0, seconds_per_pass=0.0)
    dear_cp = CostModel(cp_seconds_per_micro_batch=5.0, cp_seconds_per_token=1e-3)
    cheap, dear = (plan_batch(request.replace(cost_model=CostModelSpec(coefficients=m))) for m in (cheap_cp, dear_cp))
    assert served(cheap).name != served(dear).name
    # Dear CP: as few samples on CP > 1 as the budget allows (those longer than 8,192 tokens).
    on_cp = {name: sum(size > 1 for size in p.sample_cp_sizes().values()) for name, p in (("cheap", cheap), ("dear", dear))}
    assert on_cp["dear"] == sum(n > 8192 for n in request.sequence_lengths) < on_cp["cheap"], on_cp
    assert plan_batch(request.replace(cost_model=CostModelSpec(preset="llama3-70b-h200"))).statistics.predicted_step_cost > (
        plan_batch(request).statistics.predicted_step_cost
    )


def test_no_candidate_left_is_a_clear_error():
    request = PlanRequest.of((100_000,), 2, 1, 1024, scheduler=AUTO)  # more than 2 ranks x 1,024 hold
    with pytest.raises(InvalidRequestError) as refused:
        plan_batch(request)
    assert refused.value.field == "scheduler"
    assert "auto found no candidate" in str(refused.value) and "static_cp1:" in str(refused.value)


@pytest.fixture(scope="module")
def second_planner():
    server = start_planner(workers=1)
    yield server
    server.stop()


def test_served_auto_plans_are_identical_across_servers_and_list_candidates(stub, second_planner):
    message = request_to_proto(auto_request("bimodal", 128, dp=8, cp=2))
    first = stub.Plan(message, timeout=300)
    with grpc.insecure_channel(second_planner.address) as channel:
        second = planner_pb2_grpc.BatchPlannerStub(channel).Plan(message, timeout=300)
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    assert first.scheduler != pb.SCHEDULER_AUTO and len(first.candidates) == 14  # 16 ranks: static CP 1-16
    assert sum(c.served for c in first.candidates) == 1
    plan = plan_from_proto(first)
    assert served(plan).scheduler is plan.scheduler
    assert first.plan_id != plan_batch(auto_request("bimodal", 128, dp=8, cp=2).replace(scheduler=plan.scheduler)).plan_id


LLAMA_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
                ffn_hidden_size=14336, vocab_size=128256, gated_mlp=1)
H200 = dict(peak_bf16_flops=9.9e14, sustained_fraction=0.5, attention_sustained_fraction=0.5,
            cp_bandwidth_bytes_per_second=4.5e11, cp_exposed_fraction=0.1, seconds_per_layer_pass=4.5e-4,
            seconds_per_pass_base=0.0, cp_seconds_per_layer_pass=2.75e-3)

BAD_COST_MODELS = [
    ("unknown preset", pb.CostModelSpec(preset="gpt-9"), ["cost_model.preset", "gpt-9", "llama3-8b-h200"]),
    ("negative coefficient", pb.CostModelSpec(coefficients=pb.CostModelCoefficients(seconds_per_token=-1.0)),
     ["cost_model.coefficients.seconds_per_token", "-1.0"]),
    ("every plan free", pb.CostModelSpec(coefficients=pb.CostModelCoefficients()), ["cost_model", "free"]),
    ("profile missing a field", pb.CostModelSpec(model=pb.ModelProfile(num_layers=32), hardware=pb.HardwareProfile()),
     ["cost_model.model.", "missing"]),
    ("zero hidden size", pb.CostModelSpec(model=pb.ModelProfile(**{**LLAMA_8B, "hidden_size": 0}), hardware=pb.HardwareProfile(**H200)),
     ["cost_model.model.hidden_size", "got 0"]),
    ("absurd sustained fraction", pb.CostModelSpec(model=pb.ModelProfile(**LLAMA_8B), hardware=pb.HardwareProfile(**{**H200, "sustained_fraction": 7.0})),
     ["cost_model.hardware.sustained_fraction", "7.0"]),
    ("model without hardware", pb.CostModelSpec(model=pb.ModelProfile(**LLAMA_8B)), ["cost_model.hardware", "missing"]),
]


@pytest.mark.parametrize("spec,words", [c[1:] for c in BAD_COST_MODELS], ids=[c[0] for c in BAD_COST_MODELS])
def test_a_bad_cost_model_is_refused_naming_the_field(stub, spec, words):
    message = request_to_proto(auto_request())
    message.cost_model.CopyFrom(spec)
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(message, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for word in words:
        assert word in err.value.details(), (word, err.value.details())


def test_a_profile_in_the_request_prices_the_plan(stub):
    message = request_to_proto(auto_request())
    message.cost_model.CopyFrom(pb.CostModelSpec(model=pb.ModelProfile(**LLAMA_8B), hardware=pb.HardwareProfile(**H200)))
    heavy = stub.Plan(message, timeout=120).statistics.predicted_step_cost
    assert heavy > 10 * stub.Plan(request_to_proto(auto_request()), timeout=120).statistics.predicted_step_cost


def test_capabilities_list_auto_and_the_presets(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    assert any(s.scheduler == pb.SCHEDULER_AUTO and s.available for s in caps.schedulers)
    assert {"h200-bench-calibrated", "llama3-8b-h200", "llama3-70b-h100", "qwen3-30b-a3b-h200"} <= set(caps.cost_model_presets)


def test_the_servers_workers_plan_auto_candidates_side_by_side_to_the_in_process_answer(stub, planner):
    """256 samples on 32 ranks: past the inline bound, so the candidates go to the workers one
    task each and the answer is assembled from them; it is the in-process answer, byte for byte."""
    request = auto_request("lognormal_32k", 256, dp=16, cp=2)
    served_bytes = stub.Plan(request_to_proto(request), timeout=300).SerializeToString(deterministic=True)
    assert served_bytes == plan_to_proto(plan_batch(request)).SerializeToString(deterministic=True)
    text = urllib.request.urlopen(planner.metrics_url, timeout=10).read().decode()
    assert "batch_planner_auto_winners_total{" in text


def test_an_auto_request_holds_a_slot_per_worker_not_per_candidate():
    # One worker and 3 queued: 4 slots. auto's 13 candidates run one at a time on its one slot
    # (more candidates than the server has slots).
    server = start_planner("--max-queued-requests", "3", "--inline-max-samples", "0", workers=1)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            response = stub.Plan(request_to_proto(auto_request(samples=32)), timeout=120)
    finally:
        server.stop()
    assert len(response.candidates) == 13 and response.micro_batches
