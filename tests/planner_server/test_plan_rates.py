"""The planner measures its plan rate per scheduler and size class over a rolling window of served
plans, and GetCapabilities reports it with the number of planning workers, so that a job can size
its plan-ahead depth and replicas (docs/trainer-client.md, "Planning far enough ahead")."""

from __future__ import annotations

from batch_planner.convert import request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from planner_server.plan_rates import PlanRates, size_class


def test_size_classes_are_powers_of_two_and_the_window_is_bounded():
    assert [size_class(v) for v in (1, 2, 3, 64, 65, 1000, 16384)] == [1, 2, 4, 64, 128, 1024, 16384]
    rates = PlanRates(window=4)
    for seconds in (9.0, 1.0, 2.0, 3.0, 4.0):  # the first falls out of the window
        rates.record("hybrid_cp", 1000, 64, seconds)
    rates.record("dynamic_cp", 60, 8, 0.5)
    rates.record("dynamic_cp", 60, 8, 0.0)  # no time: not a measurement
    assert [(r.scheduler, r.samples, r.dp_cp_size, r.plans_measured, r.seconds_per_plan) for r in rates.snapshot()] == [
        ("dynamic_cp", 64, 8, 1, 0.5),
        ("hybrid_cp", 1024, 64, 4, 2.5),
    ]


def test_capabilities_report_the_measured_plan_rate_of_served_sizes(stub):
    lengths = sample_lengths("long_tail_16k", 100, seed=5)  # 100 samples on 16 ranks: class 128 on 16
    request = request_to_proto(PlanRequest.of(
        sequence_lengths=tuple(lengths), data_parallel_size=8, context_parallel_size=2, max_seqlen_per_dp_cp_rank=16384,
        scheduler=SchedulerKind.HYBRID_CP, job="rates",
    ))
    for _ in range(3):
        stub.Plan(request, timeout=60)
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=60)
    assert caps.planning_workers == 2
    rate = next(r for r in caps.plan_rates if (r.scheduler, r.samples, r.dp_cp_size) == (pb.SCHEDULER_HYBRID_CP, 128, 16))
    assert rate.plans_measured >= 3 and rate.seconds_per_plan > 0
    assert abs(rate.plans_per_second - caps.planning_workers / rate.seconds_per_plan) < 1e-6 * rate.plans_per_second


def test_capabilities_report_auto_at_the_worker_time_of_all_its_candidates(stub):
    """auto spread over the workers (a request too large to plan inline) is measured too: its rate
    counts every candidate's worker time, which is what one auto request costs the replica."""
    lengths = sample_lengths("long_tail_16k", 300, seed=6)  # 300 samples on 32 ranks: class 512 on 32
    request = request_to_proto(PlanRequest.of(
        sequence_lengths=tuple(lengths), data_parallel_size=16, context_parallel_size=2, max_seqlen_per_dp_cp_rank=16384,
        scheduler=SchedulerKind.AUTO, job="rates",
    ))
    response = stub.Plan(request, timeout=120)
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=60)
    rate = next(r for r in caps.plan_rates if (r.scheduler, r.samples, r.dp_cp_size) == (pb.SCHEDULER_AUTO, 512, 32))
    assert rate.plans_measured >= 1 and rate.seconds_per_plan > 0
    assert len(response.candidates) > 1
