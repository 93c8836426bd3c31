"""Conversion between the protobuf contract (batch_planner.v1) and the core's plain types.

Uses protobuf only (no gRPC), so the trainer's fallback and the server share it.
"""

from __future__ import annotations

from batch_planner.cost import CostModel
from batch_planner.errors import InvalidRequestError
from batch_planner.plan import CpGroup, MicroBatch, Plan, PlanStatistics
from batch_planner.request import CapacityBound, CpLayout, PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb

SCHEDULER_TO_PROTO = {
    SchedulerKind.HYBRID_CP: pb.SCHEDULER_HYBRID_CP,
    SchedulerKind.DYNAMIC_CP: pb.SCHEDULER_DYNAMIC_CP,
    SchedulerKind.STATIC_PACKING: pb.SCHEDULER_STATIC_PACKING,
}
SCHEDULER_FROM_PROTO: dict[int, SchedulerKind] = {v: k for k, v in SCHEDULER_TO_PROTO.items()}
LAYOUT_TO_PROTO = {CpLayout.ZIGZAG: pb.CP_LAYOUT_ZIGZAG, CpLayout.CONTIGUOUS: pb.CP_LAYOUT_CONTIGUOUS}
LAYOUT_FROM_PROTO = {**{v: k for k, v in LAYOUT_TO_PROTO.items()}, pb.CP_LAYOUT_UNSPECIFIED: CpLayout.ZIGZAG}
BOUND_TO_PROTO = {
    CapacityBound.PER_SAMPLE: pb.CAPACITY_BOUND_PER_SAMPLE,
    CapacityBound.PER_RANK_SUM: pb.CAPACITY_BOUND_PER_RANK_SUM,
}
BOUND_FROM_PROTO = {v: k for k, v in BOUND_TO_PROTO.items()}


def scheduler_label(value: int) -> str:
    """A bounded metric label for a proto Scheduler value, whatever the caller sent."""
    kind = SCHEDULER_FROM_PROTO.get(value)
    return kind.value if kind else "unknown"


def request_from_proto(message: pb.PlanRequest) -> PlanRequest:
    if message.scheduler not in SCHEDULER_FROM_PROTO:
        allowed = ", ".join(pb.Scheduler.Name(v) for v in SCHEDULER_TO_PROTO.values())
        raise InvalidRequestError(
            f"scheduler: {_enum_name(pb.Scheduler, message.scheduler)} is not a scheduler; allowed: {allowed}",
            field="scheduler",
        )
    if message.cp_layout not in LAYOUT_FROM_PROTO:
        raise InvalidRequestError(
            f"cp_layout: {message.cp_layout} is unknown; allowed: CP_LAYOUT_ZIGZAG, CP_LAYOUT_CONTIGUOUS",
            field="cp_layout",
        )
    layout = message.layout
    return PlanRequest(
        sequence_lengths=tuple(message.sequence_lengths),
        data_parallel_size=layout.data_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        tensor_parallel_size=layout.tensor_parallel_size or 1,
        max_seqlen_per_dp_cp_rank=message.max_seqlen_per_dp_cp_rank,
        scheduler=SCHEDULER_FROM_PROTO[message.scheduler],
        cp_layout=LAYOUT_FROM_PROTO[message.cp_layout],
        min_cp_size=message.min_cp_size if message.HasField("min_cp_size") else None,
        max_seqs_per_micro_batch=(
            message.max_seqs_per_micro_batch if message.HasField("max_seqs_per_micro_batch") else None
        ),
        micro_batch_group_size=(
            message.micro_batch_group_size if message.HasField("micro_batch_group_size") else None
        ),
        job=message.job,
    )


def request_to_proto(request: PlanRequest) -> pb.PlanRequest:
    message = pb.PlanRequest(
        sequence_lengths=list(request.sequence_lengths),
        layout=pb.ParallelLayout(
            data_parallel_size=request.data_parallel_size,
            context_parallel_size=request.context_parallel_size,
            tensor_parallel_size=request.tensor_parallel_size,
        ),
        max_seqlen_per_dp_cp_rank=request.max_seqlen_per_dp_cp_rank,
        scheduler=SCHEDULER_TO_PROTO[request.scheduler],
        cp_layout=LAYOUT_TO_PROTO[request.cp_layout],
        job=request.job,
    )
    for name in ("min_cp_size", "max_seqs_per_micro_batch", "micro_batch_group_size"):
        value = getattr(request, name)
        if value is not None:
            setattr(message, name, value)
    return message


def plan_to_proto(plan: Plan) -> pb.PlanResponse:
    stats = plan.statistics
    response = pb.PlanResponse(
        plan_id=plan.plan_id,
        scheduler=SCHEDULER_TO_PROTO[plan.scheduler],
        scheduler_class=plan.scheduler_class,
        megatron_core_version=plan.megatron_core_version,
        capacity_bound=BOUND_TO_PROTO[plan.capacity_bound],
        dp_cp_size=plan.dp_cp_size,
        cp_layout=LAYOUT_TO_PROTO[plan.cp_layout],
        tensor_parallel_size=plan.tensor_parallel_size,
    )
    for micro_batch in plan.micro_batches:
        mb = response.micro_batches.add()
        for group in micro_batch.cp_groups:
            mb.cp_groups.add(
                first_rank=group.first_rank,
                size=group.size,
                sample_ids=group.sample_ids,
                real_tokens=group.real_tokens,
                padded_tokens=group.padded_tokens,
            )
    if stats is not None:
        s = response.statistics
        s.real_tokens = stats.real_tokens
        s.padded_tokens = stats.padded_tokens
        s.padding_ratio = stats.padding_ratio
        s.micro_batch_count = stats.micro_batch_count
        for size, samples, tokens in stats.cp_size_mix:
            s.cp_size_mix.add(cp_size=size, samples=samples, real_tokens=tokens)
        s.predicted_step_cost = stats.predicted_step_cost
        s.lower_bound_cost = stats.lower_bound_cost
        s.balance_efficiency = stats.balance_efficiency
        s.static_cp_step_cost = stats.static_cp_step_cost
        s.predicted_speedup_over_static_cp = stats.predicted_speedup_over_static_cp
    return response


def plan_from_proto(message: pb.PlanResponse) -> Plan:
    s = message.statistics
    stats = PlanStatistics(
        real_tokens=s.real_tokens,
        padded_tokens=s.padded_tokens,
        padding_ratio=s.padding_ratio,
        micro_batch_count=s.micro_batch_count,
        cp_size_mix=tuple((c.cp_size, c.samples, c.real_tokens) for c in s.cp_size_mix),
        predicted_step_cost=s.predicted_step_cost,
        lower_bound_cost=s.lower_bound_cost,
        balance_efficiency=s.balance_efficiency,
        static_cp_step_cost=s.static_cp_step_cost,
        predicted_speedup_over_static_cp=s.predicted_speedup_over_static_cp,
    )
    return Plan(
        plan_id=message.plan_id,
        scheduler=SCHEDULER_FROM_PROTO[message.scheduler],
        scheduler_class=message.scheduler_class,
        megatron_core_version=message.megatron_core_version,
        dp_cp_size=message.dp_cp_size,
        tensor_parallel_size=message.tensor_parallel_size or 1,
        cp_layout=LAYOUT_FROM_PROTO[message.cp_layout],
        capacity_bound=BOUND_FROM_PROTO[message.capacity_bound],
        micro_batches=tuple(
            MicroBatch(
                tuple(
                    CpGroup(g.first_rank, g.size, tuple(g.sample_ids), g.real_tokens, g.padded_tokens)
                    for g in mb.cp_groups
                )
            )
            for mb in message.micro_batches
        ),
        statistics=stats,
    )


def cost_model_to_proto(model: CostModel) -> pb.CostModelCoefficients:
    return pb.CostModelCoefficients(
        seconds_per_token=model.seconds_per_token,
        seconds_per_attention_token_pair=model.seconds_per_attention_token_pair,
        cp_seconds_per_micro_batch=model.cp_seconds_per_micro_batch,
        cp_seconds_per_token=model.cp_seconds_per_token,
        seconds_per_pass=model.seconds_per_pass,
    )


def _enum_name(enum, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        return str(value)
