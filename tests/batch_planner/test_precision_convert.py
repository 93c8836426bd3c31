"""`precision` and `sequence_parallel` through the proto (PlanRequest 15, 16; PlanResponse 16, 17): a
request and a plan survive their messages for every precision with and without sequence parallelism,
unset fields read as bf16 with sequence parallelism, an unknown precision value is refused naming the
field, the value and what is allowed, and FP8 with verl's padding is refused by validation."""

from __future__ import annotations

import pytest

from batch_planner.convert import plan_from_proto, plan_to_proto, request_from_proto, request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.errors import InvalidRequestError
from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import PaddingRule, PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from tests.support.megatron_builds import best_local_scheduler

LENGTHS = tuple(sample_lengths("long_tail_16k", 32, seed=11))


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("precision", list(Precision))
def test_a_request_and_its_plan_survive_their_messages(precision, sequence_parallel):
    request = PlanRequest.of(LENGTHS, 4, 2, 8192, scheduler=best_local_scheduler(), tensor_parallel_size=2, precision=precision,
                             sequence_parallel=sequence_parallel)
    message = request_to_proto(request)
    assert message.precision == pb.Precision.Value(f"PRECISION_{precision.name}") and message.sequence_parallel is sequence_parallel
    assert request_from_proto(pb.PlanRequest.FromString(message.SerializeToString())) == request
    plan = plan_batch(request)
    assert (plan.precision, plan.sequence_parallel) == (precision, sequence_parallel)
    for columns in (False, True):
        again = plan_from_proto(pb.PlanResponse.FromString(plan_to_proto(plan, columns=columns).SerializeToString()))
        assert (again.precision, again.sequence_parallel) == (precision, sequence_parallel)
        assert again.statistics.alignment_padding_tokens == plan.statistics.alignment_padding_tokens
        if not columns:  # the micro-batches form reads back as the same plan
            assert again == plan


def test_unset_fields_read_as_bf16_with_sequence_parallelism():
    message = request_to_proto(PlanRequest.of(LENGTHS, 4, 2, 8192))
    message.ClearField("precision")
    message.ClearField("sequence_parallel")
    request = request_from_proto(message)
    assert (request.precision, request.sequence_parallel) == (Precision.BF16, True)
    response = plan_to_proto(plan_batch(PlanRequest.of(LENGTHS, 4, 2, 8192)))
    response.ClearField("precision")
    response.ClearField("sequence_parallel")
    plan = plan_from_proto(response)
    assert (plan.precision, plan.sequence_parallel) == (Precision.BF16, True)


def test_the_precision_changes_the_plan_id():
    ids = {plan_batch(PlanRequest.of(LENGTHS, 4, 2, 8192, precision=p)).plan_id for p in Precision}
    assert len(ids) == len(Precision)


def test_an_unknown_precision_value_is_refused_naming_the_field_the_value_and_the_allowed():
    message = request_to_proto(PlanRequest.of(LENGTHS, 4, 2, 8192))
    message.precision = 99
    with pytest.raises(InvalidRequestError) as refused:
        request_from_proto(message)
    error = refused.value
    assert error.field == "precision" and "precision: 99 is unknown" in str(error)
    assert all(pb.Precision.Name(v) in str(error) for v in pb.Precision.values() if v != pb.PRECISION_UNSPECIFIED)


@pytest.mark.parametrize("precision", [p for p in Precision if p is not Precision.BF16])
def test_fp8_with_verls_padding_is_refused_naming_the_field(precision):
    with pytest.raises(InvalidRequestError) as refused:
        plan_batch(PlanRequest.of(LENGTHS, 4, 2, 8192, padding=PaddingRule.VERL, precision=precision))
    error = refused.value
    assert error.field == "precision" and precision.value in str(error) and "allowed with padding verl: bf16" in str(error)
