"""batch_planner/convert.py: requests and plans through their protobuf messages and back, field
for field, and an unknown scheduler value refused with its field named."""

from __future__ import annotations

import pytest

from batch_planner.convert import plan_from_proto, plan_to_proto, request_from_proto, request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.errors import InvalidRequestError
from batch_planner.planner import plan_batch
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from tests.megatron_builds import best_local_scheduler


def test_a_request_survives_its_message():
    request = PlanRequest.of(tuple(sample_lengths("long_tail_16k", 32, seed=3)), 4, 2, 8192, scheduler=SchedulerKind.STATIC_PACKING,
                             cp_layout=CpLayout.CONTIGUOUS, max_seqs_per_micro_batch=4, micro_batch_group_size=2, job="convert")
    assert request_from_proto(request_to_proto(request)) == request
    assert request_from_proto(pb.PlanRequest.FromString(request_to_proto(request).SerializeToString())) == request


def test_a_plan_survives_its_message_and_its_bytes_are_deterministic():
    scheduler = best_local_scheduler()
    plan = plan_batch(PlanRequest.of(tuple(sample_lengths("long_tail_16k", 48, seed=4)), 4, 2, 8192, scheduler=scheduler))
    message = plan_to_proto(plan)
    again = plan_from_proto(pb.PlanResponse.FromString(message.SerializeToString()))
    assert again == plan
    assert plan_to_proto(again).SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)


def test_an_unknown_scheduler_value_is_refused_with_its_field():
    message = request_to_proto(PlanRequest.of((100, 200), 2, 1, 4096))
    message.scheduler = 99
    with pytest.raises(InvalidRequestError) as refused:
        request_from_proto(message)
    assert refused.value.field == "scheduler"
