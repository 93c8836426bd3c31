"""The real planner server on loopback: plans, determinism across processes, health, reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batch_planner.convert import plan_from_proto, plan_to_proto, request_to_proto
from batch_planner.cost_spec import CostModel
from batch_planner.distributions import sample_lengths
from batch_planner.plan import check_plan_invariants
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import valid_cp_sizes
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.support.megatron_builds import require_scheduler
from tests.batch_planner.test_planner_core import megatron_dynamic_cp, megatron_hybrid_cp, rank_view


def long_tail_request(dp: int, cp: int, samples: int, seed: int = 11) -> PlanRequest:
    return PlanRequest.of(tuple(sample_lengths("long_tail_16k", samples, seed)), dp, cp, 4096, job="test")


@pytest.mark.parametrize("dp,cp,samples", [(4, 2, 64), (32, 2, 1024)])
def test_served_plan_equals_megatron_core_in_process(stub, dp, cp, samples):
    request = long_tail_request(dp, cp, samples)
    response = stub.Plan(request_to_proto(request), timeout=120)
    plan = plan_from_proto(response)
    assert rank_view(plan) == megatron_hybrid_cp(list(request.sequence_lengths), dp * cp, 4096)
    check_plan_invariants(plan, request, valid_cp_sizes(SchedulerKind.HYBRID_CP, dp * cp, cp, None))
    assert response.scheduler == pb.SCHEDULER_HYBRID_CP
    assert response.capacity_bound == pb.CAPACITY_BOUND_PER_SAMPLE
    assert response.megatron_core_version and response.scheduler_class == "BalancedCPScheduler"
    assert response.statistics.real_tokens == sum(request.sequence_lengths)
    assert response.statistics.micro_batch_count == len(response.micro_batches)


# (DP, CP, samples): 8, 64, 256, 16 and 24 ranks. On 24 (not a power of two) dynamic CP is planned
# batch by batch (batch_planner/domain.py): this batch gets upstream's own plan, no substitute.
DYNAMIC_CP_LAYOUTS = [(4, 2, 64), (32, 2, 512), (64, 4, 1024), (8, 2, 256), (12, 2, 384)]


def test_served_dynamic_cp_plans_equal_megatron_core_across_two_servers(planner, stub, other_planner):
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    requests = [
        PlanRequest.of(tuple(sample_lengths("lognormal_32k", n, seed=dp)), dp, cp, 8192, scheduler=SchedulerKind.DYNAMIC_CP)
        for dp, cp, n in DYNAMIC_CP_LAYOUTS
    ]
    first = [stub.Plan(request_to_proto(r), timeout=300) for r in requests]
    with grpc.insecure_channel(other_planner.address) as channel:
        second = [planner_pb2_grpc.BatchPlannerStub(channel).Plan(request_to_proto(r), timeout=300) for r in requests]
    for request, a, b in zip(requests, first, second):
        plan = plan_from_proto(a)
        # Megatron-Core's own schedule, rank for rank, in every micro-batch.
        assert rank_view(plan) == megatron_dynamic_cp(list(request.sequence_lengths), request), request.dp_cp_size
        assert a.scheduler_class == "DefaultDynamicCPScheduler" and a.capacity_bound == pb.CAPACITY_BOUND_PER_RANK_SUM
        assert a.plan_id == b.plan_id and a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
        assert not a.HasField("substitution")
    assert {len(r.micro_batches[0].cp_groups) > 1 for r in first} == {True}
    sizes_24 = {g.size for mb in first[-1].micro_batches for g in mb.cp_groups}
    assert sizes_24 <= {1, 2, 4, 8, 24} and len(sizes_24) > 1, sizes_24


@pytest.mark.parametrize("scheduler", [SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP, SchedulerKind.AUTO])
@pytest.mark.parametrize("dp,samples", [(4, 64), (32, 1024)])  # planned inline in the handler, and on a worker
def test_a_plan_asked_for_in_columns_is_the_plan_of_the_default_form(stub, scheduler, dp, samples):
    """The trainer client asks for PLAN_FORM_COLUMNS: the same plan, id and statistics as the
    default form, carried as packed arrays, and nothing in micro_batches."""
    if scheduler is not SchedulerKind.AUTO:
        require_scheduler(scheduler)
    request = PlanRequest.of(tuple(sample_lengths("lognormal_32k", samples, seed=7)), dp, 2, 8192, scheduler=scheduler, job="test")
    default = stub.Plan(request_to_proto(request), timeout=300)
    columns = stub.Plan(request_to_proto(request, pb.PLAN_FORM_COLUMNS), timeout=300)
    assert columns.HasField("columns") and not columns.micro_batches and default.micro_batches and not default.HasField("columns")
    assert columns.plan_id == default.plan_id and columns.statistics == default.statistics and columns.candidates == default.candidates
    plan = plan_from_proto(columns)
    assert plan == plan_from_proto(default)
    assert plan_to_proto(plan).SerializeToString(deterministic=True) == default.SerializeToString(deterministic=True)


def test_same_plan_across_calls_and_processes(planner, stub, other_planner):
    message = request_to_proto(long_tail_request(8, 4, 256, seed=5))
    first = stub.Plan(message, timeout=60)
    assert stub.Plan(message, timeout=60) == first
    with grpc.insecure_channel(other_planner.address) as channel:
        second = planner_pb2_grpc.BatchPlannerStub(channel).Plan(message, timeout=60)
    assert second.plan_id == first.plan_id
    assert second.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True)


def test_capabilities_report_schedulers_and_limits(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    by_kind = {s.scheduler: s for s in caps.schedulers}
    assert by_kind[pb.SCHEDULER_HYBRID_CP].available
    assert by_kind[pb.SCHEDULER_HYBRID_CP].megatron_core_class.endswith("BalancedCPScheduler")
    for kind in (pb.SCHEDULER_DYNAMIC_CP, pb.SCHEDULER_STATIC_PACKING):
        info = by_kind[kind]
        assert info.available == (info.unavailable_reason == "")
        if not info.available:
            assert "dev branch" in info.unavailable_reason
    assert caps.limits.max_samples_per_request > 0 and caps.limits.max_receive_message_bytes > 0
    # Every request limit of the server is reported, under the same name.
    from batch_planner.validation import RequestLimits
    from dataclasses import fields

    for f in fields(RequestLimits):
        assert getattr(caps.limits, f.name) == getattr(RequestLimits(), f.name), f.name
    assert caps.megatron_core_version.startswith("0.")
    assert caps.cost_model.cp_seconds_per_micro_batch > 0
    assert caps.cost_model.seconds_per_pass == pytest.approx(CostModel().seconds_per_pass)
    assert caps.cost_model.seconds_per_pass > 0


def test_health_serving_and_reflection(planner):
    with grpc.insecure_channel(planner.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "batch_planner.v1.BatchPlanner"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"batch_planner.v1.BatchPlanner", "grpc.health.v1.Health"} <= names


def test_unavailable_scheduler_is_failed_precondition(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    missing = [s for s in caps.schedulers if not s.available]
    if not missing:
        pytest.skip("the installed Megatron-Core has every scheduler")
    message = request_to_proto(long_tail_request(4, 2, 64))
    message.scheduler = missing[0].scheduler
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(message, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Megatron-LM dev branch" in err.value.details()
