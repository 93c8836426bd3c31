"""Planning far enough ahead: a simulated trainer whose step is shorter than one plan's latency.

    python -m bench.ahead --out docs/bench                       # 16,384 samples on 1,024 ranks, auto
    python -m bench.ahead --out docs/bench --depth 4 --step-fraction 0.5 --steps 12 --scheduler hybrid_cp

A trainer loop (trainer_client's BatchPlannerClient, one rank, service only, `--scheduler`: `auto`
by default) against a real server with `--workers` planning workers (default 0: the server's
default, one per core). It first measures one plan's latency L (synchronous
`plan_step` calls). The training step is then a sleep of `step_fraction` x L: shorter than one
plan, so planning one step ahead cannot hide it, and longer than L / depth, so `depth` plans in
flight over the workers can. Two runs on the same batches, one after the other:

- depth k (`plan_ahead_depth` k): at the start of each step the trainer prefetches the next k
  steps (those already pending are kept), sleeps, then takes the next step's plan;
- depth 1: the same loop, one step ahead (the wait the trainer would have had).

The wait is the time `plan_step` blocks. The first `depth` steps of a run fill the pipeline (the
plans of the first steps are all requested at once) and are reported apart; the bar is on the
steps after them. The lead (plan arrival to its step) comes from the client's own
`batch_planner_client_plan_lead_seconds` metric. Bar: steady-state wait p99 <= 1 ms with depth k.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

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
    pyplot,
    save_figure,
    verdict,
    write_report,
)

DISTRIBUTION = "lognormal_32k"
SIZE, SMOKE_SIZE = BatchSize(16384, 1024), BatchSize(256, 32)
DEPTH, WORKERS, STEP_FRACTION, STEPS, SYNC_CALLS = 2, 0, 0.8, 12, 2
SCHEDULER = "auto"
TRAINER_NICE = -5  # the simulated trainer's priority once the server runs (the server keeps 0)
BAR_S, BAR = 1e-3, "steady-state wait p99 <= 1 ms"


@dataclass(frozen=True)
class Settings:
    size: BatchSize
    depth: int
    workers: int
    step_fraction: float
    steps: int
    scheduler: str = SCHEDULER


@dataclass(frozen=True)
class RunResult:
    depth: int
    warmup_waits: list[float]  # the first `depth` steps: filling the pipeline
    waits: list[float]  # the steps after them
    mean_lead: float  # from the client's lead histogram, every step of the run
    late_steps: int  # batch_planner_client_late_plans_total
    sources: dict[str, int]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.waits)


@dataclass(frozen=True)
class AheadResult:
    settings: Settings
    latency: Spread  # synchronous plan_step: one plan's latency
    step_seconds: float
    deep: RunResult
    shallow: RunResult

    @property
    def met(self) -> bool:
        return self.deep.spread.p99 <= BAR_S


def make_client(address: str, size: BatchSize, depth: int, scheduler: str = SCHEDULER):
    from trainer_client.service.client import BatchPlannerClient
    from trainer_client.service.config import PlannerClientConfig
    from batch_planner.request import SchedulerKind

    config = PlannerClientConfig(
        planner_endpoint=address, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_DP_CP_RANK,
        context_parallel_size=JOB_CP_SIZE, scheduler=SchedulerKind(scheduler), job="bench", tls=False,
        deadline_seconds=600.0, fallback=False, plan_ahead_depth=depth,
    )
    return BatchPlannerClient(config, dp_cp_size=size.ranks, rank=0, cp_groups=None)


def batches(size: BatchSize, count: int, first_seed: int) -> list[tuple[int, ...]]:
    return [make_request(DISTRIBUTION, size, seed=first_seed + s).sequence_lengths for s in range(count)]


def sync_latency(address: str, size: BatchSize, calls: int, scheduler: str) -> Spread:
    client = make_client(address, size, 1, scheduler)
    times = []
    try:
        for k, lengths in enumerate(batches(size, calls, 50_000)):
            started = time.perf_counter()
            client.plan_step(10_000 + k, lengths)  # never prefetched: planned synchronously
            times.append(time.perf_counter() - started)
    finally:
        client.close()
    return Spread.of(times)


def trainer_loop(address: str, size: BatchSize, depth: int, steps: int, step_seconds: float, scheduler: str) -> RunResult:
    data = batches(size, steps + depth + 1, 0)
    client = make_client(address, size, depth, scheduler)
    waits, sources = [], []
    try:
        client.prefetch(0, data[0])
        client.plan_step(0, data[0])  # the first plan cannot be hidden; not counted
        for step in range(steps):
            for ahead in range(step + 1, step + depth + 1):
                client.prefetch(ahead, data[ahead])
            time.sleep(step_seconds)  # the training step
            started = time.perf_counter()
            plan = client.plan_step(step + 1, data[step + 1])
            waits.append(time.perf_counter() - started)
            # A trainer runs the step with its plan and drops it afterwards: freeing a 16,384-sample
            # plan takes about a millisecond, which the trainer pays whatever planned it, so it is
            # kept out of the timed wait (discarding the result inside it measured that instead).
            del plan
            sources.append(str(client.last_source))
        registry, labels = client.metrics.registry, {"training_job": client.metrics.job}
        lead_sum = registry.get_sample_value("batch_planner_client_plan_lead_seconds_sum", labels) or 0.0
        lead_count = registry.get_sample_value("batch_planner_client_plan_lead_seconds_count", labels) or 1.0
        late = registry.get_sample_value("batch_planner_client_late_plans_total", labels) or 0.0
    finally:
        client.close()
    counts = {s: sources.count(s) for s in sorted(set(sources))}
    warm = min(depth, steps - 1)
    return RunResult(depth, waits[:warm], waits[warm:], lead_sum / lead_count, int(late), counts)


def raise_priority(increment: int) -> bool:
    """On a cluster the trainer and the planner are different machines; here they share two cores
    with the planner's busy workers, so the trainer (which mostly sleeps) gets a higher priority
    than they do: its wake-up at the end of a step does not wait for a core. False when not allowed."""
    import os

    try:
        os.nice(increment)
    except OSError:
        return False
    return True


def measure(address: str, settings: Settings) -> AheadResult:
    latency = sync_latency(address, settings.size, SYNC_CALLS, settings.scheduler)
    step_seconds = settings.step_fraction * latency.p50
    deep = trainer_loop(address, settings.size, settings.depth, settings.steps, step_seconds, settings.scheduler)
    shallow = trainer_loop(address, settings.size, 1, settings.steps, step_seconds, settings.scheduler)
    return AheadResult(settings, latency, step_seconds, deep, shallow)


def plot(result: AheadResult, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, marker in ((result.shallow, "s"), (result.deep, "o")):
        waits = run.warmup_waits + run.waits
        ax.plot(range(1, len(waits) + 1), [max(w * 1e3, 1e-3) for w in waits], marker=marker,
                label=f"depth {run.depth}")
    ax.axhline(1.0, color="#c44e52", linestyle="--", label="bar: 1 ms")
    ax.axvline(result.deep.depth + 0.5, color="gray", linestyle=":", label=f"pipeline filled (depth {result.deep.depth})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("trainer-visible wait, ms (log)")
    s = result.settings
    ax.set_title(f"{s.scheduler}, {s.size.label} ranks, {workers_text(s.workers)}; step {result.step_seconds:.1f} s, "
                 f"one plan {result.latency.p50:.1f} s", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run_row(result: AheadResult, run: RunResult) -> list[object]:
    ms = 1e3
    warm = f"{statistics.median(run.warmup_waits) * ms:.1f} (max {max(run.warmup_waits) * ms:.1f})" if run.warmup_waits else "-"
    is_deep = run is result.deep
    return [
        f"depth {run.depth}", len(run.waits), warm, run.spread.fmt(ms, 3), f"{run.spread.p99 * ms:.3f}",
        f"{run.mean_lead:.3g}", run.late_steps, ", ".join(f"{k}: {v}" for k, v in run.sources.items()),
        BAR if is_deep else "(comparison)", verdict(result.met) if is_deep else "-",
    ]


def workers_text(workers: int) -> str:
    """--workers as the server reads it: 0 is its default, one per available core."""
    import os

    return f"{workers} workers" if workers else f"default workers ({len(os.sched_getaffinity(0))}, one per core)"


def run(
    out: Path, smoke: bool = False, address: str | None = None, depth: int = DEPTH, workers: int = WORKERS,
    step_fraction: float = STEP_FRACTION, steps: int = STEPS, scheduler: str = SCHEDULER, name: str = "ahead",
    max_job_share: float | None = None,
) -> Report[AheadResult]:
    size = SMOKE_SIZE if smoke else SIZE
    settings = Settings(size, 2 if smoke else depth, workers, step_fraction, 4 if smoke else steps, scheduler)
    server_args = ("--max-job-share", str(max_job_share)) if max_job_share is not None else ()
    with planner_server(address, workers=workers, args=server_args) as addr:
        raised = raise_priority(TRAINER_NICE) if not smoke else False
        try:
            result = measure(addr, settings)
        finally:
            if raised:
                raise_priority(-TRAINER_NICE)
    name += "_smoke" if smoke else ""
    plot(result, out / f"{name}.png")
    lat = result.latency
    setup = markdown_table(
        ["batch", "workers", "one plan s p50 (min..max)", "step s", "step / plan", "plan / depth s", "steps per run"],
        [[size.label, workers_text(workers), lat.fmt(1, 2), f"{result.step_seconds:.2f}", f"{step_fraction:g}",
          f"{lat.p50 / settings.depth:.2f}", settings.steps]],
    )
    table = markdown_table(
        ["run", "steady steps", "pipeline-fill wait ms p50 (max)", "steady wait ms p50 (min..max)",
         "steady wait ms p99", "mean lead s", "late steps", "plans from", "bar", "verdict"],
        [run_row(result, result.deep), run_row(result, result.shallow)],
    )
    return write_report(
        out, name, "Planning far enough ahead: step shorter than one plan",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nThe trainer ran at nice {TRAINER_NICE if raised else 0} once the server (nice 0) was up"
        + (" (on a cluster they are different machines; here the trainer's wake-up at the end of a step "
           "would otherwise queue behind the planner's busy workers for a core)." if raised else ".")
        + f"\n\nBatches: `{DISTRIBUTION}`, scheduler `{scheduler}`, a new seed every step. Server: "
        + (f"`--max-job-share {max_job_share:g}`" if max_job_share is not None else "default settings") + ".",
        [("Setup", setup), ("Results", table + f"\n\n![plan ahead by depth]({name}.png)")],
        rows=[result],
        bars=[Bar(f"{scheduler}, {size.label}, depth {settings.depth}, {workers_text(workers)}", BAR, result.met)],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--address", help="use this running planner instead of starting one")
    parser.add_argument("--depth", type=int, default=DEPTH, help="plan_ahead_depth of the deep run")
    parser.add_argument("--workers", type=int, default=WORKERS, help="planning workers of the server started")
    parser.add_argument("--step-fraction", type=float, default=STEP_FRACTION, help="step time / one plan's latency")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per run")
    parser.add_argument("--scheduler", default=SCHEDULER, help="the trainer's scheduler (auto, dynamic_cp, hybrid_cp)")
    parser.add_argument("--name", default="ahead", help="report name: <out>/<name>.md and .png")
    parser.add_argument("--max-job-share", type=float, default=None,
                        help="the started server's --max-job-share (auto holds at most one slot per worker)")
    args = parser.parse_args(argv)
    report = run(args.out, args.smoke, args.address, args.depth, args.workers, args.step_fraction, args.steps,
                 args.scheduler, args.name, args.max_job_share)
    print(report.path.read_text())


if __name__ == "__main__":
    main()
