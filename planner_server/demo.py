"""`planner-demo`: plan a realistic long-tail batch on a running planner and print the plan."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batch_planner.convert import JOB_METADATA_KEY, SCHEDULER_FROM_PROTO, plan_from_proto, request_to_proto
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.plan import Plan
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc


# What the statistics' lower bound counts (batch_planner/lower_bound.py, docs/cost-model.md).
BOUND_INCLUDES = (
    "what no plan avoids: even work + passes of the fewest micro-batches + CP terms of samples longer "
    "than one rank, or one sample's own pass where larger"
)


def render_plan(plan: Plan, request: PlanRequest, max_rows: int = 12) -> str:
    lines = []
    s = plan.statistics
    lines.append(
        f"plan {plan.plan_id}  scheduler={plan.scheduler.value} ({plan.scheduler_class}, Megatron-Core "
        f"{plan.megatron_core_version})  capacity bound={plan.capacity_bound.value}"
    )
    lines.append(
        f"{request.num_samples} samples, DP={request.data_parallel_size} CP={request.context_parallel_size} "
        f"TP={request.tensor_parallel_size} ({plan.dp_cp_size} DPxCP ranks), "
        f"max_seqlen_per_dp_cp_rank={request.max_seqlen_per_dp_cp_rank}"
    )
    lines.append("")
    lines.append(f"{'mb':>3} {'ranks':>9} {'cp':>3} {'samples':>8} {'lengths (first few)':<34} {'real':>9} {'padded':>9}")
    rows = 0
    for index, micro_batch in enumerate(plan.micro_batches):
        for group in micro_batch.cp_groups:
            if rows >= max_rows:
                break
            lens = [request.sequence_lengths[i] for i in group.sample_ids]
            shown = ",".join(str(x) for x in lens[:5]) + (",..." if len(lens) > 5 else "")
            ranks = f"{group.first_rank}-{group.first_rank + group.size - 1}"
            lines.append(
                f"{index:>3} {ranks:>9} {group.size:>3} {len(lens):>8} {shown:<34} {group.real_tokens:>9} {group.padded_tokens:>9}"
            )
            rows += 1
    total_groups = sum(len(mb.cp_groups) for mb in plan.micro_batches)
    if total_groups > rows:
        lines.append(f"... {total_groups - rows} more CP groups")
    lines.append("")
    mix = ", ".join(f"CP{size}: {n} samples ({tokens} tokens)" for size, n, tokens in s.cp_size_mix)
    lines.append(f"micro-batches: {s.micro_batch_count}   CP-size mix: {mix}")
    lines.append(
        f"tokens: {s.real_tokens} real, {s.padded_tokens} padded, padding ratio {s.padding_ratio:.4%}"
    )
    lines.append(
        f"predicted step cost {s.predicted_step_cost * 1e3:.2f} ms; static CP{request.context_parallel_size} "
        f"{s.static_cp_step_cost * 1e3:.2f} ms -> predicted speedup {s.predicted_speedup_over_static_cp:.2f}x"
    )
    lines.append(
        f"lower bound {s.lower_bound_cost * 1e3:.2f} ms ({BOUND_INCLUDES}) -> balance efficiency "
        f"{s.balance_efficiency:.1%} (100% = nothing left to recover)"
    )
    if plan.candidates:
        lines.append("")
        lines.append(f"auto: {len(plan.candidates)} candidates, predicted step cost (ms):")
        for c in plan.candidates:
            cost = f"{c.predicted_step_cost * 1e3:9.2f}" if c.predicted_step_cost is not None else "        -"
            if c.served:
                note = "  <- served"
            elif c.skipped_lower_bound is not None:
                note = f"  (skipped: its lower bound {c.skipped_lower_bound * 1e3:.2f} is above the served cost)"
            else:
                note = f"  ({c.not_planned_reason})" if c.not_planned_reason else ""
            lines.append(f"  {c.name:<36} {cost}{note}")
    return "\n".join(lines)


# Which scheduler `--scheduler best` asks for: the first of these the server has. auto serves the
# cheapest of Megatron-Core's plans and the job's static CP; dynamic CP (which packs each CP group
# into one pass) wins on most long-tail batches (docs/benchmarks.md).
PREFERENCE = (SchedulerKind.AUTO, SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING)


def best_scheduler(caps: pb.Capabilities) -> SchedulerKind:
    available = {SCHEDULER_FROM_PROTO.get(s.scheduler) for s in caps.schedulers if s.available}
    return next((kind for kind in PREFERENCE if kind in available), SchedulerKind.HYBRID_CP)


def _wait_until_serving(channel: grpc.Channel, timeout: float) -> None:
    """Returns once the planner's readiness (health "") says SERVING: it has warmed up."""
    serving = health_pb2.HealthCheckResponse.SERVING
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True)
    for answer in watch:
        if answer.status == serving:
            watch.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="planner-demo", description=__doc__)
    parser.add_argument("--endpoint", default="localhost:50051")
    parser.add_argument("--distribution", default="long_tail_16k", choices=sorted(DISTRIBUTIONS))
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-seqlen-per-rank", type=int, default=8192)
    parser.add_argument(
        "--scheduler", default="best", choices=["best", *(k.value for k in SchedulerKind)],
        help="best: the first of %s the server has" % ", ".join(k.value for k in PREFERENCE),
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    lengths = tuple(sample_lengths(args.distribution, args.samples, args.seed))
    with grpc.insecure_channel(args.endpoint) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        try:
            _wait_until_serving(channel, args.timeout)  # a warming replica answers Plan UNAVAILABLE at once
            caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=args.timeout, wait_for_ready=True)
            request = PlanRequest.of(
                sequence_lengths=lengths,
                data_parallel_size=args.dp,
                context_parallel_size=args.cp,
                tensor_parallel_size=args.tp,
                max_seqlen_per_dp_cp_rank=args.max_seqlen_per_rank,
                scheduler=best_scheduler(caps) if args.scheduler == "best" else SchedulerKind(args.scheduler),
                cp_layout=CpLayout.ZIGZAG,
                job="demo",
            )
            metadata = ((JOB_METADATA_KEY, request.job),)  # what the server admits by, as the trainer client sends it
            response = stub.Plan(request_to_proto(request), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"planner at {args.endpoint} answered {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    available = [pb.Scheduler.Name(s.scheduler) for s in caps.schedulers if s.available]
    print(f"planner {args.endpoint}: Megatron-Core {caps.megatron_core_version}, schedulers {', '.join(available)}")
    print(f"batch: {args.samples} samples from {args.distribution!r} (seed {args.seed})\n")
    print(render_plan(plan_from_proto(response), request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
