"""No-lookahead planning (RL): the trainer's wait for one plan when the lengths exist only with the batch.

    python -m bench.rl_wait --out docs/bench              # 4,096 on 256 and 16,384 on 1,024
    python -m bench.rl_wait --out docs/bench --runs 8

In RL (verl, NeMo-RL) a step's lengths are known only once its rollouts are generated, so nothing
can be planned ahead: each step waits for one plan. A trainer (trainer_client's
BatchPlannerClient, one rank, service only: fallback off, so every plan is the server's) against
a real planner server started for the run with its default workers (`--workers 0`: one per core).
Each step is a new batch (a new seed) and one `plan_step(step, lengths)` with nothing prefetched:
the wait is the whole of one plan as the trainer sees it (the request, the planning on the server,
for `auto` every candidate over the workers with the hybrid-CP candidates that cannot win skipped,
the response and the client's checks). Cases: dynamic CP and `auto` at 4,096 samples on 256 ranks
and 16,384 on 1,024 (`lognormal_32k`, job CP 2, 8,192 tokens per rank), each on two servers side
by side: one with `--scheduler-implementation compiled` (the default) and one with `exact` (the
pure-Python exact path), interleaved seed by seed (each seed: every case on each server in turn;
only one plan is in flight at a time), after one unreported plan per case on another seed (the
first plan of a size warms the workers). After the runs each server's GetCapabilities plan rates
(median seconds per plan over its latest plans, and plans per second over its workers) are read
back. Bars: `auto` served in at most 3 s at 4,096 on 256 and at most 60 s at 16,384 on 1,024, on
every run (the max), and `auto` on the compiled server at 16,384 on 1,024 in at most
0.5 s p50.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.request import SchedulerKind
from bench.common import (
    JOB_CP_SIZE,
    MAX_SEQLEN_PER_DP_CP_RANK,
    Bar,
    BatchSize,
    Report,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    planner_server,
    planner_stub,
    verdict,
    write_report,
)

DISTRIBUTION = "lognormal_32k"
SIZES, SMOKE_SIZES = (BatchSize(4096, 256), BatchSize(16384, 1024)), (BatchSize(64, 8), BatchSize(256, 32))
SCHEDULERS = (SchedulerKind.DYNAMIC_CP, SchedulerKind.AUTO)
RUNS, SMOKE_RUNS = 5, 2
BARS_S = (3.0, 60.0)  # auto's wait, max over runs, at each of the sizes in turn
IMPLEMENTATIONS = ("compiled", "exact")  # one server each, side by side
P50_BAR_S, P50_BAR_SIZE = 0.5, BatchSize(16384, 1024)  # auto on the compiled server


@dataclass(frozen=True)
class Case:
    scheduler: str
    size: BatchSize
    waits: Spread
    candidates: str  # auto: planned / skipped / not planned of the last run's candidates
    bar_s: float | None
    implementation: str = "compiled"  # the server's --scheduler-implementation
    times: tuple[float, ...] = ()  # seed by seed (the pairing for the ratio)

    @property
    def met(self) -> bool | None:
        return None if self.bar_s is None else self.waits.max <= self.bar_s


@dataclass(frozen=True)
class Rate:
    implementation: str
    scheduler: str
    samples: int
    ranks: int
    plans_measured: int
    seconds_per_plan: float
    plans_per_second: float


def make_client(address: str, size: BatchSize, scheduler: SchedulerKind):
    from trainer_client.service.client import BatchPlannerClient
    from trainer_client.service.config import PlannerClientConfig

    config = PlannerClientConfig(
        planner_endpoint=address, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_DP_CP_RANK,
        context_parallel_size=JOB_CP_SIZE, scheduler=scheduler, job="bench", tls=False,
        deadline_seconds=600.0, fallback=False,
    )
    return BatchPlannerClient(config, dp_cp_size=size.ranks, rank=0, cp_groups=None)


def candidate_counts(plan) -> str:
    if not plan.candidates:
        return "-"
    skipped = sum(c.skipped_lower_bound is not None for c in plan.candidates)
    planned = sum(c.predicted_step_cost is not None for c in plan.candidates)
    return f"{planned} planned, {skipped} skipped, {len(plan.candidates) - planned - skipped} not planned"


def one_wait(client, step: int, lengths: tuple[int, ...]) -> tuple[float, object]:
    started = time.perf_counter()
    plan = client.plan_step(step, lengths)  # nothing prefetched: the trainer waits for this plan
    waited = time.perf_counter() - started
    if client.last_source != "service":
        raise RuntimeError(f"plan from {client.last_source}, not the service")
    return waited, plan


def plan_rates(address: str, implementation: str) -> tuple[int, list[Rate]]:
    from batch_planner.v1 import planner_pb2 as pb

    channel, stub = planner_stub(address)
    try:
        caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
    finally:
        channel.close()
    return caps.planning_workers, [
        Rate(implementation, pb.Scheduler.Name(r.scheduler).removeprefix("SCHEDULER_").lower(), r.samples, r.dp_cp_size,
             r.plans_measured, r.seconds_per_plan, r.plans_per_second)
        for r in caps.plan_rates
    ]


def measure(addresses: dict[str, str], sizes: tuple[BatchSize, ...], runs: int) -> list[Case]:
    cases = [(scheduler, size, implementation) for size in sizes for scheduler in SCHEDULERS for implementation in addresses]
    clients = {case: make_client(addresses[case[2]], case[1], case[0]) for case in cases}
    waits: dict[tuple, list[float]] = {case: [] for case in cases}
    last: dict[tuple, object] = {}
    try:
        for case, client in clients.items():  # warm-up, not reported
            one_wait(client, 100_000, make_request(DISTRIBUTION, case[1], seed=100_000).sequence_lengths)
        for seed in range(runs):
            for case, client in clients.items():
                lengths = make_request(DISTRIBUTION, case[1], seed=seed).sequence_lengths
                waited, last[case] = one_wait(client, seed, lengths)
                waits[case].append(waited)
                print(f"rl_wait: {case[0].value} {case[1].label} ({case[2]}) seed {seed}: {waited:.3f} s", flush=True)
    finally:
        for client in clients.values():
            client.close()
    bars = dict(zip(sizes, BARS_S))
    return [
        Case(s.value, b, Spread.of(waits[(s, b, i)]), candidate_counts(last[(s, b, i)]),
             bars[b] if s is SchedulerKind.AUTO and i == IMPLEMENTATIONS[0] else None, i, tuple(waits[(s, b, i)]))
        for s, b, i in cases
    ]


def ratio_text(case: Case, cases: list[Case]) -> str:
    """exact / compiled on the same seeds, on the compiled case's row."""
    other = next((c for c in cases if (c.scheduler, c.size) == (case.scheduler, case.size) and c.implementation == "exact"), None)
    if case.implementation != "compiled" or other is None:
        return "-"
    ratios = Spread.of([e / c for e, c in zip(other.times, case.times) if c > 0])
    return f"{ratios.p50:.3g}x ({ratios.min:.3g}..{ratios.max:.3g})"


def p50_bar(cases: list[Case]) -> Bar | None:
    found = next((c for c in cases if c.scheduler == "auto" and c.size == P50_BAR_SIZE and c.implementation == "compiled"), None)
    if found is None:
        return None
    return Bar(f"auto, {P50_BAR_SIZE.label}, compiled server: {found.waits.p50:.3f} s", f"wait p50 <= {P50_BAR_S:g} s", found.waits.p50 <= P50_BAR_S)


def run(out: Path, smoke: bool = False, address: str | None = None, runs: int = RUNS) -> Report[Case | Rate]:
    sizes, runs = (SMOKE_SIZES, SMOKE_RUNS) if smoke else (SIZES, runs)
    implementations = IMPLEMENTATIONS if address is None else IMPLEMENTATIONS[:1]  # a given server: its own setting
    with contextlib.ExitStack() as stack:
        addresses = {
            i: stack.enter_context(planner_server(address, workers=0, args=("--scheduler-implementation", i))) for i in implementations
        }
        cases = measure(addresses, sizes, runs)
        rates = []
        for implementation, addr in addresses.items():
            workers, found = plan_rates(addr, implementation)
            rates += found
    suffix = "_smoke" if smoke else ""
    table = markdown_table(
        ["scheduler", "samples on ranks", "server", "runs", "wait s p50", "wait s min..max", "exact / compiled (same seeds)",
         "auto's candidates (last run)", "bar", "verdict"],
        [[c.scheduler, c.size.label, c.implementation, c.waits.runs, f"{c.waits.p50:.3f}", f"{c.waits.min:.3f}..{c.waits.max:.3f}",
          ratio_text(c, cases), c.candidates, f"max <= {c.bar_s:g} s" if c.bar_s else "-", verdict(c.met) if c.met is not None else "-"]
         for c in cases],
    )
    rate_table = markdown_table(
        ["server", "scheduler", "samples (class)", "DPxCP ranks (class)", "plans measured", "seconds per plan (median)", "plans per second"],
        [[r.implementation, r.scheduler, f"<= {r.samples:,}", f"<= {r.ranks:,}", r.plans_measured, f"{r.seconds_per_plan:.3g}",
          f"{r.plans_per_second:.3g}"] for r in rates],
    )
    bars = [Bar(f"auto, {c.size.label}", f"wait max <= {c.bar_s:g} s", bool(c.met)) for c in cases if c.bar_s]
    bars += [bar for bar in [p50_bar(cases)] if bar is not None]
    return write_report(
        out, f"rl_wait{suffix}", "No-lookahead planning (RL): the wait for one plan",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        [("Results", table),
         (f"Plan rates each server reported (GetCapabilities, {workers} planning workers each)", rate_table)],
        rows=[*cases, *rates],
        bars=bars,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--address", help="use this running planner instead of starting one")
    parser.add_argument("--runs", type=int, default=RUNS, help="runs (seeds) per case")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.address, args.runs).path.read_text())


if __name__ == "__main__":
    main()
