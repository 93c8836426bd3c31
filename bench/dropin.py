"""The Megatron-LM drop-in (trainer_client.megatron_lm) against Megatron-Core's own wrappers, at
1,024 samples on 64 DPxCP ranks (DP 32 x CP 2).

    python -m bench.dropin --out docs/bench

1. Planning on the step's critical path. Megatron-Core's wrappers run the scheduler on every rank
   inside `next()`: that time is measured here by calling the same scheduler class in-process on
   the same global lengths (BalancedCPScheduler for `--hybrid-context-parallel`,
   DefaultDynamicCPScheduler for `--sequence-packing-scheduler default_dynamic_cp`). The drop-in
   asks the planner for step N+1 while step N trains: the trainer-visible wait is `plan_step` on
   the asking rank with plan-ahead, against a real server (2 workers), after a simulated step (a
   sleep: on a GPU trainer the host thread mostly waits for the device) of twice the slowest
   synchronous planning latency. Not included on either side: the lengths all-gather (both do one)
   and the drop-in's plan broadcast and agreement check (one broadcast and one all-gather of 32
   bytes per rank over the DPxCP group).
2. Bytes each rank receives per step. The drop-in and 0.19's HybridCPDataLoaderWrapper move each
   sample to the ranks that run it (all-to-all inside the DP group): a rank receives its samples'
   tokens. The dev branch's reroute (data_schedule_utils.reroute_samples_to_dcp_ranks) all-gathers
   every field over the DP group, so each rank's receive buffer is DP x the largest local share.
   Computed from the plan of each batch with the four per-token fields of Megatron-LM's SFT samples
   (tokens, labels, position_ids int64; loss_mask float32: 28 bytes per token); the formula is the
   one `route_samples` uses for its split sizes (its counters are checked in
   tests/trainer_client/megatron_lm/test_megatron_dropin_distributed.py on 4 and 8 gloo ranks).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.planner import plan_batch
from batch_planner.request import SchedulerKind
from bench.common import (
    BatchSize,
    Report,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    planner_server,
    write_report,
)

SIZE = BatchSize(1024, 64)
SMOKE_SIZE = BatchSize(64, 8)
DISTRIBUTIONS = ("lognormal_32k", "bimodal")
BYTES_PER_TOKEN = 8 + 8 + 8 + 4  # tokens, labels, position_ids (int64), loss_mask (float32)
STEPS, SMOKE_STEPS = 12, 3


def megatron_in_process_seconds(request, repeats: int) -> Spread:
    """The scheduler call each of Megatron-Core's wrappers makes on every rank, every step."""
    from batch_planner.schedulers import _DpCpGroupSize

    seqlens = [(i, n) for i, n in enumerate(request.sequence_lengths)]
    times = []
    for _ in range(repeats + 1):  # the first call imports Megatron-Core and is not counted
        started = time.perf_counter()
        if request.scheduler is SchedulerKind.HYBRID_CP:
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

            BalancedCPScheduler(request.max_seqlen_per_dp_cp_rank, _DpCpGroupSize(request.dp_cp_size)).get_groups_and_subsamples(seqlens, None)
        else:
            from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler

            DefaultDynamicCPScheduler(
                request.max_seqlen_per_dp_cp_rank, request.context_parallel_size, request.data_parallel_size, None, min_cp_size=1
            ).get_groups_and_subsamples(seqlens)
        times.append(time.perf_counter() - started)
    return Spread.of(times[1:])


def drop_in_wait_seconds(address: str, requests, step_seconds: float) -> Spread:
    """plan_step's wait on the asking rank with plan-ahead, one simulated step per batch."""
    from trainer_client import BatchPlannerClient, PlannerClientConfig

    first = requests[0]
    config = PlannerClientConfig(
        planner_endpoint=address, tls=False, max_seqlen_per_dp_cp_rank=first.max_seqlen_per_dp_cp_rank,
        context_parallel_size=first.context_parallel_size, scheduler=first.scheduler, deadline_seconds=60.0,
        fallback=False,  # every measured plan comes from the service
    )
    client = BatchPlannerClient(config, dp_cp_size=first.dp_cp_size, rank=0)
    waits = []
    try:
        client.prefetch(0, list(first.sequence_lengths))
        for step, request in enumerate(requests):
            if step + 1 < len(requests):
                client.prefetch(step + 1, list(requests[step + 1].sequence_lengths))
            started = time.perf_counter()
            client.plan_step(step, list(request.sequence_lengths))
            waits.append(time.perf_counter() - started)
            time.sleep(step_seconds)  # the simulated training step of this batch
    finally:
        client.close()
    return Spread.of(waits[1:])  # step 0 has nothing to hide behind


def bytes_received(request) -> dict[str, float]:
    """Per-rank receive bytes of one step: the drop-in (its samples) vs the dev reroute's gather."""
    plan = plan_batch(request)
    lengths = request.sequence_lengths
    runs = [set() for _ in range(request.dp_cp_size)]
    for mb in plan.micro_batches:
        for group in mb.cp_groups:
            for rank in group.ranks:
                runs[rank].update(group.sample_ids)
    per_rank = [sum(lengths[i] for i in ids) * BYTES_PER_TOKEN for ids in runs]
    dp = request.data_parallel_size
    share = len(lengths) // dp  # each DP rank loads an equal number of samples, in order
    local = [sum(lengths[d * share : (d + 1) * share]) for d in range(dp)]
    global_bytes = sum(lengths) * BYTES_PER_TOKEN
    return {
        "global": global_bytes,
        "drop_in_mean": statistics.mean(per_rank),
        "drop_in_max": max(per_rank),
        "dev_gather": dp * max(local) * BYTES_PER_TOKEN,
    }


@dataclass(frozen=True)
class DropInRow:
    """One scheduler and distribution: planning on the critical path, and bytes per rank."""

    scheduler: str
    distribution: str
    in_process: Spread  # Megatron-Core's scheduler in-process (what every rank pays today), s
    wait: Spread  # the drop-in's trainer-visible planning wait, s
    step_seconds: float  # the simulated step
    global_mib: float
    received_mean_mib: float
    received_max_mib: float
    dev_gather_mib: float


def run(out: Path, smoke: bool = False, address: str | None = None) -> Report[DropInRow]:
    size, steps = (SMOKE_SIZE, SMOKE_STEPS) if smoke else (SIZE, STEPS)
    rows: list[DropInRow] = []
    with planner_server(address, workers=2) as server:
        for scheduler in (SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP):
            for distribution in DISTRIBUTIONS:
                requests = [make_request(distribution, size, seed=s, scheduler=scheduler) for s in range(steps)]
                in_process = megatron_in_process_seconds(requests[0], repeats=2 if smoke else 5)
                step_seconds = max(0.05, 2 * in_process.max + 0.1)
                wait = drop_in_wait_seconds(server, requests, step_seconds)
                b = bytes_received(requests[0])
                rows.append(DropInRow(
                    scheduler.value, distribution, in_process, wait, step_seconds, b["global"] / 2**20,
                    b["drop_in_mean"] / 2**20, b["drop_in_max"] / 2**20, b["dev_gather"] / 2**20,
                ))
    timing = markdown_table(
        ["scheduler", "distribution", "Megatron-Core in-process scheduling, every rank, ms p50 (min-max)",
         "drop-in planning wait ms p50", "drop-in wait ms max", "simulated step s", "in-process / wait"],
        [[r.scheduler, r.distribution, f"{r.in_process.p50 * 1e3:.1f} ({r.in_process.min * 1e3:.1f}-{r.in_process.max * 1e3:.1f})",
          f"{r.wait.p50 * 1e3:.2f}", f"{r.wait.max * 1e3:.2f}", f"{r.step_seconds:.2f}",
          f"{r.in_process.p50 / max(r.wait.p50, 1e-6):,.0f}x"] for r in rows],
    )
    traffic = markdown_table(
        ["scheduler", "distribution", "global batch MiB", "drop-in received MiB per rank (mean)",
         "drop-in received MiB (max rank)", "max rank / global", "dev reroute gather buffer MiB per rank"],
        [[r.scheduler, r.distribution, f"{r.global_mib:.1f}", f"{r.received_mean_mib:.2f}", f"{r.received_max_mib:.2f}",
          f"{100 * r.received_max_mib / r.global_mib:.1f}%", f"{r.dev_gather_mib:.1f}"] for r in rows],
    )
    suffix = "_smoke" if smoke else ""
    return write_report(
        out, f"dropin{suffix}", "Megatron-LM drop-in vs Megatron-Core's wrappers",
        f"{size.samples:,} samples on {size.ranks} DPxCP ranks (DP {size.ranks // 2} x CP 2), {steps} steps per row. "
        "See bench/dropin.py for what each column measures.",
        [("Planning on the critical path", timing), ("Bytes each rank receives per step", traffic)],
        rows=rows,
    )


def main(argv: list[str] | None = None) -> None:
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    print(run(args.out, args.smoke).path.read_text())


if __name__ == "__main__":
    main()
