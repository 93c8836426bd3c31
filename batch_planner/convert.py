"""Conversion between the protobuf contract (batch_planner.v1) and the core's plain types.

Uses protobuf only (no gRPC), so the trainer's fallback and the server share it.
"""

from __future__ import annotations

from dataclasses import Field, fields
from itertools import accumulate, pairwise
from typing import Any, Callable, Iterable, Sequence

from google.protobuf.message import Message as ProtoMessage

from batch_planner.cost_spec import COEFFICIENT_NAMES, CostModel, CostModelSpec, spec_from_mapping
from batch_planner.errors import InvalidRequestError
from batch_planner.precision import Precision
from batch_planner.plan import CandidateSummary, GroupColumns, MicroBatch, MicroBatches, Plan, PlanStatistics, new_cp_group
from batch_planner.request import CapacityBound, CpLayout, PaddingRule, PlanningOptions, PlanRequest, SchedulerKind
from batch_planner.substitute import SubstituteReason, Substitution
from batch_planner.v1 import planner_pb2 as pb

# The request metadata key that carries PlanRequest.job: the server reads it at admission (per-job
# fairness) without parsing the message; the client sends it with every Plan call. It must equal
# the message's `job` when both are set (docs/design.md, "The contract").
JOB_METADATA_KEY = "batch-planner-job"

SCHEDULER_TO_PROTO = {
    SchedulerKind.HYBRID_CP: pb.SCHEDULER_HYBRID_CP,
    SchedulerKind.DYNAMIC_CP: pb.SCHEDULER_DYNAMIC_CP,
    SchedulerKind.STATIC_PACKING: pb.SCHEDULER_STATIC_PACKING,
    SchedulerKind.AUTO: pb.SCHEDULER_AUTO,
}
SCHEDULER_FROM_PROTO: dict[int, SchedulerKind] = {v: k for k, v in SCHEDULER_TO_PROTO.items()}
REASON_TO_PROTO = {reason: pb.SubstituteReason.Value(f"SUBSTITUTE_REASON_{reason.name}") for reason in SubstituteReason}
REASON_FROM_PROTO: dict[int, SubstituteReason] = {v: k for k, v in REASON_TO_PROTO.items()}
LAYOUT_TO_PROTO = {CpLayout.ZIGZAG: pb.CP_LAYOUT_ZIGZAG, CpLayout.CONTIGUOUS: pb.CP_LAYOUT_CONTIGUOUS}
LAYOUT_FROM_PROTO = {**{v: k for k, v in LAYOUT_TO_PROTO.items()}, pb.CP_LAYOUT_UNSPECIFIED: CpLayout.ZIGZAG}
PADDING_TO_PROTO = {rule: pb.PaddingRule.Value(f"PADDING_RULE_{rule.name}") for rule in PaddingRule}
PADDING_FROM_PROTO = {**{v: k for k, v in PADDING_TO_PROTO.items()}, pb.PADDING_RULE_UNSPECIFIED: PaddingRule.MEGATRON_CORE}
PRECISION_TO_PROTO = {precision: pb.Precision.Value(f"PRECISION_{precision.name}") for precision in Precision}
PRECISION_FROM_PROTO = {**{v: k for k, v in PRECISION_TO_PROTO.items()}, pb.PRECISION_UNSPECIFIED: Precision.BF16}
BOUND_TO_PROTO = {
    CapacityBound.PER_SAMPLE: pb.CAPACITY_BOUND_PER_SAMPLE,
    CapacityBound.PER_RANK_SUM: pb.CAPACITY_BOUND_PER_RANK_SUM,
}
BOUND_FROM_PROTO = {v: k for k, v in BOUND_TO_PROTO.items()}


def scheduler_label(value: int) -> str:
    """A bounded metric label for a proto Scheduler value, whatever the caller sent."""
    kind = SCHEDULER_FROM_PROTO.get(value)
    return kind.value if kind else "unknown"


def _scheduler_of(value: int, field: str) -> SchedulerKind:
    if value not in SCHEDULER_FROM_PROTO:
        allowed = ", ".join(pb.Scheduler.Name(v) for v in SCHEDULER_TO_PROTO.values())
        raise InvalidRequestError(
            f"{field}: {_enum_name(pb.Scheduler, value)} is not a scheduler; allowed: {allowed}", field=field
        )
    return SCHEDULER_FROM_PROTO[value]


def dp_cp_ranks(layout: pb.ParallelLayout) -> int:
    """The DPxCP ranks a request's layout asks for, before validation (an unset CP counts as 1)."""
    return layout.data_parallel_size * max(1, layout.context_parallel_size)


def request_from_proto(message: pb.PlanRequest) -> PlanRequest:
    """The request's planning fields (its plan_form is not one: `wants_columns`)."""
    _scheduler_of(message.scheduler, "scheduler")
    if message.cp_layout not in LAYOUT_FROM_PROTO:
        raise InvalidRequestError(
            f"cp_layout: {message.cp_layout} is unknown; allowed: CP_LAYOUT_ZIGZAG, CP_LAYOUT_CONTIGUOUS",
            field="cp_layout",
        )
    if message.padding not in PADDING_FROM_PROTO:
        allowed = ", ".join(pb.PaddingRule.Name(v) for v in PADDING_TO_PROTO.values())
        raise InvalidRequestError(f"padding: {message.padding} is unknown; allowed: {allowed}", field="padding")
    if message.precision not in PRECISION_FROM_PROTO:
        allowed = ", ".join(pb.Precision.Name(v) for v in PRECISION_TO_PROTO.values())
        raise InvalidRequestError(f"precision: {message.precision} is unknown; allowed: {allowed}", field="precision")
    options = {f.name: _read(message, f) for f in _OPTIONS}
    return PlanRequest(
        sequence_lengths=tuple(message.sequence_lengths[:]),  # one list, not id by id
        data_parallel_size=message.layout.data_parallel_size,
        options=PlanningOptions(**options),
        job=message.job,
    )


def wants_columns(message: pb.PlanRequest) -> bool:
    """Whether the request asks for its plan in the columns form (PlanResponse.columns). Any other
    plan_form, one this server does not know included, is answered with micro_batches, which every
    client reads: the field is a preference, so a newer client's form is not a refusal here."""
    return message.plan_form == pb.PLAN_FORM_COLUMNS


def request_to_proto(request: PlanRequest, plan_form: pb.PlanForm = pb.PLAN_FORM_MICRO_BATCHES) -> pb.PlanRequest:
    """`plan_form`: how the answer should carry the plan (the trainer client asks for columns)."""
    message = pb.PlanRequest(
        sequence_lengths=list(request.sequence_lengths),
        layout=pb.ParallelLayout(data_parallel_size=request.data_parallel_size),
        job=request.job,
        plan_form=plan_form,
    )
    for f in _OPTIONS:
        value = getattr(request.options, f.name)
        if value is not None:
            holder, name = _proto_place(message, f)
            converted = _TO_PROTO.get(f.name, _same)(value)
            if isinstance(converted, ProtoMessage):
                getattr(holder, name).CopyFrom(converted)
            elif isinstance(converted, list):
                getattr(holder, name).extend(converted)
            else:
                setattr(holder, name, converted)
    return message


def cost_spec_to_proto(spec: CostModelSpec) -> pb.CostModelSpec:
    message = pb.CostModelSpec(preset=spec.preset)
    if spec.coefficients is not None:
        message.coefficients.CopyFrom(cost_model_to_proto(spec.coefficients))
    for name in ("model", "hardware"):
        profile = getattr(spec, name)
        if profile is not None:
            getattr(message, name).CopyFrom(getattr(pb, type(profile).__name__)(**{f.name: getattr(profile, f.name) for f in fields(profile)}))
    return message


def cost_spec_from_proto(message: pb.CostModelSpec) -> CostModelSpec:
    """The request's spec; a bad one is an InvalidRequestError naming the field (batch_planner/cost_spec.py)."""
    values: dict[str, Any] = {}
    if message.preset:
        values["preset"] = message.preset
    if message.HasField("coefficients"):
        # proto3 doubles have no presence: every coefficient is sent, 0 included.
        values["coefficients"] = {f.name: getattr(message.coefficients, f.name) for f in message.coefficients.DESCRIPTOR.fields}
    for name in ("model", "hardware"):
        if message.HasField(name):
            values[name] = {f.name: value for f, value in getattr(message, name).ListFields()}
    return spec_from_mapping(values)


# Options whose proto form differs from the Python value (enums, messages), and how 0 reads.
_TO_PROTO: dict[str, Callable[[Any], Any]] = {
    "scheduler": SCHEDULER_TO_PROTO.__getitem__,
    "cp_layout": LAYOUT_TO_PROTO.__getitem__,
    "padding": PADDING_TO_PROTO.__getitem__,
    "precision": PRECISION_TO_PROTO.__getitem__,
    "cost_model": cost_spec_to_proto,
    "auto_schedulers": lambda kinds: [SCHEDULER_TO_PROTO[k] for k in kinds],
}
_FROM_PROTO: dict[str, Callable[[Any], Any]] = {
    "scheduler": SCHEDULER_FROM_PROTO.__getitem__,
    "cp_layout": LAYOUT_FROM_PROTO.__getitem__,
    "padding": PADDING_FROM_PROTO.__getitem__,
    "precision": PRECISION_FROM_PROTO.__getitem__,
    "tensor_parallel_size": lambda value: value or 1,  # 0 is read as 1 (the proto's comment)
    "cost_model": cost_spec_from_proto,
    "auto_schedulers": lambda values: tuple(_scheduler_of(v, "auto_schedulers") for v in values),
}


def _same(value: Any) -> Any:
    return value


def _proto_place(message: Any, f: Field) -> tuple[Any, str]:
    """The message holding option `f` (per its `proto` metadata) and the field name in it."""
    *path, name = _PLACES[f.name]
    for part in path:
        message = getattr(message, part)
    return message, name


_OPTIONS = fields(PlanningOptions)
_PLACES = {f.name: tuple(f.metadata["proto"].split(".")) for f in _OPTIONS}  # each option's place, split once


def _has_presence(places: tuple[str, ...]) -> bool:
    descriptor = pb.PlanRequest.DESCRIPTOR
    for part in places[:-1]:
        descriptor = descriptor.fields_by_name[part].message_type
    return descriptor.fields_by_name[places[-1]].has_presence


_OPTIONAL = {name: _has_presence(places) for name, places in _PLACES.items()}  # which options can be unset


def _read(message: pb.PlanRequest, f: Field) -> Any:
    holder, name = _proto_place(message, f)
    if _OPTIONAL[f.name] and not holder.HasField(name):  # an optional field: unset is its default (None), not 0
        return f.default
    return _FROM_PROTO.get(f.name, _same)(getattr(holder, name))


# PlanStatistics' figures, each a field of the same name in batch_planner.v1.PlanStatistics.
_STATISTICS = tuple(f.name for f in fields(PlanStatistics) if f.name != "cp_size_mix")


def plan_to_proto(plan: Plan, columns: bool = False) -> pb.PlanResponse:
    """The plan's PlanResponse, built in one constructor call: upb fills every nested message in C
    from plain dicts and lists, several times faster than one add() per CP group. `columns`: its CP
    groups in the columns form (PlanResponse.columns, from the plan's GroupColumns), else as
    micro_batches."""
    stats = plan.statistics
    return pb.PlanResponse(
        plan_id=plan.plan_id,
        scheduler=SCHEDULER_TO_PROTO[plan.scheduler],
        scheduler_class=plan.scheduler_class,
        megatron_core_version=plan.megatron_core_version,
        micro_batches=None if columns else micro_batches_to_proto(plan.micro_batches),
        columns=_columns_to_proto(plan.micro_batches) if columns else None,
        statistics=None if stats is None else _statistics_to_proto(stats),
        capacity_bound=BOUND_TO_PROTO[plan.capacity_bound],
        dp_cp_size=plan.dp_cp_size,
        cp_layout=LAYOUT_TO_PROTO[plan.cp_layout],
        tensor_parallel_size=plan.tensor_parallel_size,
        candidates=[_candidate_to_proto(c) for c in plan.candidates],
        substitution=None if plan.substitution is None else _substitution_to_proto(plan.substitution),
        padding=PADDING_TO_PROTO[plan.padding],
        min_local_rows=plan.min_local_rows,
        precision=PRECISION_TO_PROTO[plan.precision],
        sequence_parallel=plan.sequence_parallel,
    )


def _substitution_to_proto(substitution: Substitution) -> pb.Substitution:
    return pb.Substitution(
        requested=SCHEDULER_TO_PROTO[substitution.requested], reason=REASON_TO_PROTO[substitution.reason], detail=substitution.detail,
    )


def micro_batches_to_proto(micro_batches: Sequence[MicroBatch]) -> list[dict]:
    """PlanResponse.micro_batches as the constructor takes them: a CP group's own field dict is its
    message's fields (same names), with no attribute read per field."""
    return [{"cp_groups": [vars(group) for group in micro_batch.cp_groups]} for micro_batch in micro_batches]


def _columns_to_proto(micro_batches: Sequence[MicroBatch]) -> pb.PlanColumns:
    """The groups as PlanColumns: packed arrays, filled by upb from lists in C."""
    if isinstance(micro_batches, MicroBatches):
        columns = micro_batches.columns
    else:
        columns = GroupColumns.of(micro_batches, sum(len(g.sample_ids) for mb in micro_batches for g in mb.cp_groups))
    return pb.PlanColumns(
        groups_per_micro_batch=[end - start for start, end in pairwise(columns.micro_batch_starts)],
        first_ranks=columns.first_ranks,
        sizes=columns.sizes,
        sample_counts=columns.sample_counts,
        sample_ids=columns.sample_ids,
        real_tokens=columns.real_tokens,
        padded_tokens=columns.padded_tokens,
    )


def _statistics_to_proto(stats: PlanStatistics) -> pb.PlanStatistics:
    mix = [pb.CpSizeCount(cp_size=size, samples=samples, real_tokens=tokens) for size, samples, tokens in stats.cp_size_mix]
    return pb.PlanStatistics(cp_size_mix=mix, **{name: getattr(stats, name) for name in _STATISTICS})


def _candidate_to_proto(c: CandidateSummary) -> pb.Candidate:
    return pb.Candidate(
        name=c.name, scheduler=SCHEDULER_TO_PROTO[c.scheduler], max_seqlen_per_dp_cp_rank=c.max_seqlen_per_dp_cp_rank,
        context_parallel_size=c.context_parallel_size, planned=c.predicted_step_cost is not None,
        predicted_step_cost=c.predicted_step_cost or 0.0, served=c.served, not_planned_reason=c.not_planned_reason,
        skipped=c.skipped_lower_bound is not None, lower_bound_cost=c.skipped_lower_bound or 0.0,
        **({"min_cp_size": c.min_cp_size} if c.min_cp_size is not None else {}),
    )


def plan_from_proto(message: pb.PlanResponse) -> Plan:
    s = message.statistics
    mix = tuple((c.cp_size, c.samples, c.real_tokens) for c in s.cp_size_mix)
    stats = PlanStatistics(cp_size_mix=mix, **{name: getattr(s, name) for name in _STATISTICS})
    return Plan(
        plan_id=message.plan_id,
        scheduler=SCHEDULER_FROM_PROTO[message.scheduler],
        scheduler_class=message.scheduler_class,
        megatron_core_version=message.megatron_core_version,
        dp_cp_size=message.dp_cp_size,
        tensor_parallel_size=message.tensor_parallel_size or 1,
        cp_layout=LAYOUT_FROM_PROTO[message.cp_layout],
        capacity_bound=BOUND_FROM_PROTO[message.capacity_bound],
        micro_batches=_columns_from_proto(message.columns) if message.HasField("columns") else micro_batches_from_proto(message.micro_batches),
        statistics=stats,
        candidates=tuple(
            CandidateSummary(
                c.name, SCHEDULER_FROM_PROTO[c.scheduler], c.max_seqlen_per_dp_cp_rank,
                c.min_cp_size if c.HasField("min_cp_size") else None, c.context_parallel_size,
                c.predicted_step_cost if c.planned else None, c.served, c.not_planned_reason,
                c.lower_bound_cost if c.skipped else None,
            )
            for c in message.candidates
        ),
        substitution=_substitution_from_proto(message.substitution) if message.HasField("substitution") else None,
        padding=PADDING_FROM_PROTO[message.padding],
        min_local_rows=message.min_local_rows if message.HasField("min_local_rows") else None,
        # A server that does not know the fields sends neither: bf16, and sequence parallelism.
        precision=PRECISION_FROM_PROTO.get(message.precision, Precision.BF16),
        sequence_parallel=message.sequence_parallel if message.HasField("sequence_parallel") else True,
    )


def _substitution_from_proto(message: pb.Substitution) -> Substitution:
    return Substitution(SCHEDULER_FROM_PROTO[message.requested], REASON_FROM_PROTO[message.reason], message.detail)


def micro_batches_from_proto(messages: Iterable[pb.MicroBatch]) -> tuple[MicroBatch, ...]:
    """The plan's micro-batches. Thousands of CP groups in a large plan: each is made by
    plan.new_cp_group (the dataclass's own object, without its __init__), its sample ids read as
    one list rather than id by id."""
    return tuple(
        MicroBatch(tuple([new_cp_group(g.first_rank, g.size, tuple(g.sample_ids[:]), g.real_tokens, g.padded_tokens) for g in mb.cp_groups]))
        for mb in messages
    )


def _columns_from_proto(message: pb.PlanColumns) -> MicroBatches:
    """The plan's micro-batches from the columns form, unbuilt (MicroBatches): each column read as
    one list. Columns that do not fit together raise MalformedPlanError naming them."""
    per_micro_batch, counts, sample_ids = message.groups_per_micro_batch[:], message.sample_counts[:], message.sample_ids[:]
    group_columns = {name: getattr(message, name)[:] for name in ("first_ranks", "sizes", "real_tokens", "padded_tokens")}
    groups = sum(per_micro_batch)
    uneven = [f"{name} has {len(column)}" for name, column in {"sample_counts": counts, **group_columns}.items() if len(column) != groups]
    if uneven:
        raise MalformedPlanError(f"PlanResponse.columns: groups_per_micro_batch adds up to {groups} groups, but {', '.join(uneven)}")
    if sum(counts) != len(sample_ids):
        raise MalformedPlanError(f"PlanResponse.columns: sample_counts add up to {sum(counts)}, but sample_ids has {len(sample_ids)}")
    return MicroBatches(GroupColumns.from_columns(
        list(accumulate(per_micro_batch, initial=0)), group_columns["first_ranks"], group_columns["sizes"], counts, sample_ids,
        group_columns["real_tokens"], group_columns["padded_tokens"],
    ))


class MalformedPlanError(ValueError):
    """A PlanResponse whose plan cannot be read: its columns do not fit together."""


# What micro_batches_to_proto relies on (tests/batch_planner/test_convert.py checks it): a CpGroup holds its
# fields, and only them, in its __dict__ (a plain frozen dataclass: no __slots__, no __post_init__),
# named as batch_planner.v1.CpGroup's fields.


def cost_model_to_proto(model: CostModel) -> pb.CostModelCoefficients:
    return pb.CostModelCoefficients(**{name: getattr(model, name) for name in COEFFICIENT_NAMES})


def _enum_name(enum, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        return str(value)
