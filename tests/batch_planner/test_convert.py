"""batch_planner/convert.py: requests and plans through their protobuf messages and back, field
for field (a plan's bytes those of a field-by-field build, and its groups read back as the
constructor makes them), in both plan forms (micro_batches and columns; an unknown form reads as
micro_batches), and an unknown scheduler, and columns that do not fit together, refused with their
field named."""

from __future__ import annotations

import pickle
import re
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from batch_planner.convert import MalformedPlanError, plan_from_proto, plan_to_proto, request_from_proto, request_to_proto, wants_columns
from batch_planner.distributions import sample_lengths
from batch_planner.errors import InvalidRequestError
from batch_planner.plan import CpGroup, MicroBatch, MicroBatches, Plan
from batch_planner.planner import plan_batch
from batch_planner.request import CpLayout, PaddingRule, PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from tests.support.megatron_builds import best_local_scheduler


def test_a_request_survives_its_message():
    request = PlanRequest.of(tuple(sample_lengths("long_tail_16k", 32, seed=3)), 4, 2, 8192, scheduler=SchedulerKind.STATIC_PACKING,
                             cp_layout=CpLayout.CONTIGUOUS, max_seqs_per_micro_batch=4, micro_batch_group_size=2, job="convert")
    assert request_from_proto(request_to_proto(request)) == request
    assert request_from_proto(pb.PlanRequest.FromString(request_to_proto(request).SerializeToString())) == request
    verl = request.replace(padding=PaddingRule.VERL, min_local_rows=16)
    assert request_from_proto(pb.PlanRequest.FromString(request_to_proto(verl).SerializeToString())) == verl


def test_a_plan_carries_its_padding():
    request = PlanRequest.of(tuple(sample_lengths("long_tail_16k", 32, seed=5)), 4, 2, 8192, scheduler=best_local_scheduler(),
                             cp_layout=CpLayout.CONTIGUOUS, padding=PaddingRule.VERL)
    if request.scheduler is not SchedulerKind.HYBRID_CP:
        request = request.replace(min_local_rows=16)
    plan = plan_batch(request)
    again = plan_from_proto(pb.PlanResponse.FromString(plan_to_proto(plan).SerializeToString()))
    assert (again.padding, again.min_local_rows) == (plan.padding, plan.min_local_rows) == (PaddingRule.VERL, request.min_local_rows)


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


def test_the_plan_form_is_a_preference_and_an_unknown_one_reads_as_micro_batches():
    request = PlanRequest.of((100, 200), 2, 1, 4096)
    message = request_to_proto(request, pb.PLAN_FORM_COLUMNS)
    assert wants_columns(message) and not wants_columns(request_to_proto(request))
    message.plan_form = 7  # type: ignore[assignment]  # a form a newer client may ask for
    assert not wants_columns(message) and request_from_proto(message) == request


@pytest.mark.parametrize("index", range(11))
def test_the_columns_form_carries_the_same_plan_and_reads_back_as_it(index):
    """A plan in the columns form: no micro_batches in the message, the same plan read back (equal,
    same hash, same groups), and the micro_batches form of what was read is the original's bytes."""
    plan = _plans()[index]
    message = plan_to_proto(plan, columns=True)
    assert not message.micro_batches and message.HasField("columns")
    again = plan_from_proto(pb.PlanResponse.FromString(message.SerializeToString(deterministic=True)))
    assert isinstance(again.micro_batches, MicroBatches) and len(again.micro_batches) == len(plan.micro_batches)
    assert again == plan and hash(again) == hash(plan)
    if plan.statistics is not None:
        assert again.statistics == plan.statistics
    as_read = replace(plan, statistics=again.statistics)  # no statistics are read back as zeros, in either form
    assert plan_to_proto(again).SerializeToString(deterministic=True) == plan_to_proto(as_read).SerializeToString(deterministic=True)
    columns_bytes = plan_to_proto(as_read, columns=True).SerializeToString(deterministic=True)
    assert plan_to_proto(again, columns=True).SerializeToString(deterministic=True) == columns_bytes
    for read, made in zip((g for mb in again.micro_batches for g in mb.cp_groups), (g for mb in plan.micro_batches for g in mb.cp_groups)):
        assert type(read) is CpGroup and vars(read) == vars(made)


def test_the_cores_micro_batches_read_as_their_tuple_and_pickle_unbuilt():
    plan = _plans()[3]
    micro_batches = plan.micro_batches
    assert isinstance(micro_batches, MicroBatches)
    copy = pickle.loads(pickle.dumps(micro_batches))
    assert isinstance(copy, MicroBatches) and copy._built is None  # pickled as its columns
    built = tuple(micro_batches)
    assert micro_batches == built and built == micro_batches and copy == micro_batches and hash(copy) == hash(built)
    assert micro_batches[0] == built[0] and micro_batches[1:] == built[1:] and repr(micro_batches) == repr(built)
    assert micro_batches != built[1:] and (micro_batches == list(built)) is False
    assert micro_batches + built == built + micro_batches == built * 2 == 2 * micro_batches == micro_batches * 2


@pytest.mark.parametrize("column,change,message", [
    ("first_ranks", lambda c: c.append(0), "groups_per_micro_batch adds up to {groups} groups, but first_ranks has {more}"),
    ("padded_tokens", lambda c: c.pop(), "groups_per_micro_batch adds up to {groups} groups, but padded_tokens has {fewer}"),
    ("sample_counts", lambda c: c.append(0), "groups_per_micro_batch adds up to {groups} groups, but sample_counts has {more}"),
    ("sample_ids", lambda c: c.append(0), "sample_counts add up to {samples}, but sample_ids has {more_samples}"),
])
def test_columns_that_do_not_fit_together_are_refused_naming_them(column, change, message):
    response = plan_to_proto(_plans()[1], columns=True)
    groups, samples = len(response.columns.first_ranks), len(response.columns.sample_ids)
    change(getattr(response.columns, column))
    expected = message.format(groups=groups, more=groups + 1, fewer=groups - 1, samples=samples, more_samples=samples + 1)
    with pytest.raises(MalformedPlanError, match=re.escape("PlanResponse.columns: " + expected)):
        plan_from_proto(response)


def _reference_response(plan) -> bytes:
    """The plan's response built field by field, one add() per micro-batch and CP group: what
    plan_to_proto's single constructor call must give, byte for byte."""
    message = plan_to_proto(replace(plan, micro_batches=()))
    for micro_batch in plan.micro_batches:
        mb = message.micro_batches.add()
        for g in micro_batch.cp_groups:
            mb.cp_groups.add(first_rank=g.first_rank, size=g.size, sample_ids=g.sample_ids, real_tokens=g.real_tokens,
                             padded_tokens=g.padded_tokens)
    return message.SerializeToString(deterministic=True)


def _plans() -> list[Plan]:
    plans = [
        plan_batch(PlanRequest.of(tuple(sample_lengths(distribution, samples, seed=5)), ranks // 2, 2, 8192, scheduler=kind))
        for kind, distribution in ((best_local_scheduler(), "lognormal_32k"), (SchedulerKind.HYBRID_CP, "lognormal_32k"),
                                   (SchedulerKind.STATIC_PACKING, "long_tail_16k"), (SchedulerKind.AUTO, "long_tail_16k"))
        for samples, ranks in ((8, 2), (300, 32))
    ]
    edge_groups = (CpGroup(0, 0, (), 0, 0), CpGroup(3, 1, (2**32 - 1, 0, 127, 128), 2**40, 2**64 - 1))
    return plans + [replace(plans[0], statistics=None), replace(plans[0], micro_batches=()),
                    replace(plans[0], micro_batches=(MicroBatch(()), MicroBatch(edge_groups)))]


@pytest.mark.parametrize("index", range(11))
def test_a_plans_bytes_are_those_of_its_fields_set_one_by_one_and_read_back_as_the_same_plan(index):
    plan = _plans()[index]
    data = plan_to_proto(plan).SerializeToString(deterministic=True)
    assert data == _reference_response(plan)
    again = plan_from_proto(pb.PlanResponse.FromString(data))
    assert again == plan and again.candidates == plan.candidates
    assert repr(again.micro_batches) == repr(plan.micro_batches) and hash(again.micro_batches) == hash(plan.micro_batches)
    if plan.statistics is not None:
        assert again.statistics == plan.statistics
    for read, made in zip((g for mb in again.micro_batches for g in mb.cp_groups), (g for mb in plan.micro_batches for g in mb.cp_groups)):
        assert type(read) is CpGroup and vars(read) == vars(made) and read.ranks == made.ranks
        assert pickle.loads(pickle.dumps(read)) == made
        with pytest.raises(FrozenInstanceError):
            read.size = 2  # type: ignore[misc]


@pytest.mark.parametrize("group", [CpGroup(-1, 1, (1,), 1, 1), CpGroup(0, 1, (2**32,), 1, 1), CpGroup(0, 1, (1.5,), 1, 1)])  # type: ignore[arg-type]
def test_a_group_the_proto_cannot_hold_is_refused_as_by_a_field_by_field_build(group):
    plan = replace(_plans()[0], micro_batches=(MicroBatch((group,)),))
    with pytest.raises((ValueError, TypeError)) as field_by_field:
        _reference_response(plan)
    with pytest.raises(field_by_field.type, match=re.escape(str(field_by_field.value))):
        plan_to_proto(plan)


def test_a_cp_group_holds_exactly_its_fields_named_as_the_proto_fields():
    """What convert's fast paths rely on: CpGroup messages are built from a group's __dict__ and
    groups are read back by setting it (no __slots__, no __post_init__, nothing cached in it)."""
    assert [f.name for f in fields(CpGroup)] == [f.name for f in pb.CpGroup.DESCRIPTOR.fields]
    assert not hasattr(CpGroup, "__slots__") and not hasattr(CpGroup, "__post_init__")
    group = CpGroup(2, 2, (0, 1), 3, 4)
    for name in dir(group):
        getattr(group, name)  # every property, once
    assert list(vars(group)) == [f.name for f in fields(CpGroup)]
