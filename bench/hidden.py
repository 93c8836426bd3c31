"""Planning hidden behind the step: the trainer-visible wait when step N+1's plan is requested
at the start of step N.

    python -m bench.hidden --out docs/bench

A simulated trainer loop (trainer_client's BatchPlannerClient, one rank, service only) against
a real server (2 workers): at the start of step N it prefetches the plan of step N+1, then "trains"
for `step` seconds (a sleep: on a GPU trainer the host thread mostly waits for the device), then takes the plan of step N+1 and records how long that took.
The step time is set to twice the slowest synchronous planning latency measured just before, so
every step is longer than planning. The same run also measures the synchronous wait (no plan
ahead) for comparison. Bar: p99 wait <= 1 ms.
"""

from __future__ import annotations

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
CASES = ((BatchSize(64, 8), 40), (BatchSize(1024, 64), 20))  # (size, steps)
SYNC_CALLS = 8
MIN_STEP_S = 0.05
BAR_S, BAR = 1e-3, "p99 <= 1 ms"


API = "trainer_client.BatchPlannerClient: prefetch(step + 1, lengths) then plan_step(step + 1, lengths)"


def make_client(address: str, size: BatchSize):
    """The trainer client as one rank of a `size.ranks`-rank job, service only (no fallback, so
    every plan measured comes from the server)."""
    from trainer_client.service.client import BatchPlannerClient
    from trainer_client.service.config import PlannerClientConfig

    config = PlannerClientConfig(
        planner_endpoint=address,
        max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_DP_CP_RANK,
        context_parallel_size=JOB_CP_SIZE,
        job="bench",
        tls=False,
        deadline_seconds=300.0,
        fallback=False,
    )
    return BatchPlannerClient(config, dp_cp_size=size.ranks, rank=0, cp_groups=None)


@dataclass(frozen=True)
class CaseResult:
    size: BatchSize
    step_seconds: float
    sync: Spread
    waits: Spread
    sources: dict[str, int]  # plans by where they came from (service, fallback)

    @property
    def met(self) -> bool:
        return self.waits.p99 <= BAR_S

    def sources_text(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.sources.items())


def measure(address: str, size: BatchSize, steps: int) -> CaseResult:
    lengths = [make_request(DISTRIBUTION, size, seed=s).sequence_lengths for s in range(steps + SYNC_CALLS + 2)]
    client = make_client(address, size)
    sources: list[str] = []
    try:
        sync = []
        for k, batch in enumerate(lengths[steps + 1 :]):
            step = 10_000 + k  # never prefetched: plan_step plans synchronously
            started = time.perf_counter()
            client.plan_step(step, batch)
            sync.append(time.perf_counter() - started)
        step_seconds = max(MIN_STEP_S, 2 * max(sync))
        client.prefetch(0, lengths[0])
        client.plan_step(0, lengths[0])  # the first step's plan cannot be hidden; not counted
        waits = []
        for step in range(steps):
            client.prefetch(step + 1, lengths[step + 1])
            time.sleep(step_seconds)  # the training step
            started = time.perf_counter()
            client.plan_step(step + 1, lengths[step + 1])
            waits.append(time.perf_counter() - started)
            sources.append(str(client.last_source))
    finally:
        client.close()
    counts = {s: sources.count(s) for s in sorted(set(sources))}
    return CaseResult(size, step_seconds, Spread.of(sync), Spread.of(waits), counts)


def run(out: Path, smoke: bool = False, address: str | None = None) -> Report[CaseResult]:
    cases = ((BatchSize(64, 8), 3),) if smoke else CASES
    with planner_server(address, workers=2) as addr:
        results = [measure(addr, size, steps) for size, steps in cases]
    ms = 1e3
    table = markdown_table(
        ["batch", "steps", "step s", "synchronous wait ms p50 (min..max)", "plan-ahead wait ms p50 (min..max)",
         "plan-ahead wait ms p99", "plans from", "bar", "verdict"],
        [[r.size.label, r.waits.runs, f"{r.step_seconds:.3f}", r.sync.fmt(ms), r.waits.fmt(ms, 3),
          f"{r.waits.p99 * ms:.3f}", r.sources_text(), BAR, verdict(r.met)] for r in results],
    )
    suffix = "_smoke" if smoke else ""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    labels = [r.size.label for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.sync.p50 * ms for r in results], 0.4, label="synchronous (no plan ahead), p50")
    ax.bar([i + 0.2 for i in x], [max(r.waits.p99 * ms, 1e-3) for r in results], 0.4, label="plan ahead, p99")
    ax.axhline(1.0, color="#c44e52", linestyle="--", label="bar: 1 ms")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("trainer-visible wait per step, ms (log)")
    ax.legend(fontsize=8)
    save_figure(fig, out / f"hidden{suffix}.png")
    return write_report(
        out, f"hidden{suffix}", "Planning hidden behind the training step",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nPlan-ahead API used: {API}; the wait is the time `plan_step` takes. Batches: `{DISTRIBUTION}`, hybrid CP, "
        "a new seed every step; the synchronous wait includes decoding the plan, as does the plan-ahead thread.",
        [("Results", table + f"\n\n![plan ahead](hidden{suffix}.png)")],
        rows=results,
        bars=[Bar(r.size.label, BAR, r.met) for r in results],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--address", help="use this running planner instead of starting one")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.address).path.read_text())


if __name__ == "__main__":
    main()
