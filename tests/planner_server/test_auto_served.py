"""The auto policy through a real server: served auto plans are the same on every server and the
in-process answer, byte for byte, even when the server's workers plan the candidates side by side;
a bad cost model is refused naming the field; a profile in the request prices the plan; the
capabilities list auto and the presets; an auto request holds one slot per worker, not per
candidate. The in-process half: tests/batch_planner/test_auto.py."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from batch_planner.convert import plan_from_proto, plan_to_proto, request_to_proto
from batch_planner.planner import plan_batch
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.batch_planner.test_auto import auto_request, served
from tests.support.planner_process import start_planner

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


def test_served_auto_plans_are_identical_across_servers_and_list_candidates(stub, other_planner):
    message = request_to_proto(auto_request("bimodal", 128, dp=8, cp=2))
    first = stub.Plan(message, timeout=300)
    with grpc.insecure_channel(other_planner.address) as channel:
        second = planner_pb2_grpc.BatchPlannerStub(channel).Plan(message, timeout=300)
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    assert first.scheduler != pb.SCHEDULER_AUTO and len(first.candidates) == 14  # 16 ranks: static CP 1-16
    assert sum(c.served for c in first.candidates) == 1
    plan = plan_from_proto(first)
    assert served(plan).scheduler is plan.scheduler
    assert first.plan_id != plan_batch(auto_request("bimodal", 128, dp=8, cp=2).replace(scheduler=plan.scheduler)).plan_id


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
    """A model ten times the default's (the replay's Llama-3-8B fit) in the request: a 320-layer
    stack of Llama-3-8B's layers is priced at several times the default's step."""
    message = request_to_proto(auto_request())
    message.cost_model.CopyFrom(pb.CostModelSpec(model=pb.ModelProfile(**{**LLAMA_8B, "num_layers": 320}), hardware=pb.HardwareProfile(**H200)))
    heavy = stub.Plan(message, timeout=120).statistics.predicted_step_cost
    assert heavy > 5 * stub.Plan(request_to_proto(auto_request()), timeout=120).statistics.predicted_step_cost


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
