"""Planning hidden behind the step: the trainer-visible wait when step N+1's plan is requested
at the start of step N.

    python -m bench.hidden --out docs/bench

A simulated trainer loop against a real server (2 workers): at the start of step N it asks for
the plan of step N+1, then "trains" for `step` seconds (a sleep: on a GPU trainer the host thread
mostly waits for the device), then takes the plan of step N+1 and records how long that took.
The step time is set to twice the slowest synchronous planning latency measured just before, so
every step is longer than planning. The same run also measures the synchronous wait (no plan
ahead) for comparison. Bar (issue 5): p99 wait <= 1 ms.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from batch_planner.convert import plan_from_proto, request_to_proto
from batch_planner.plan import Plan
from batch_planner.request import PlanRequest
from bench.common import (
    BatchSize,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    planner_server,
    planner_stub,
    pyplot,
    save_figure,
    verdict,
    write_report,
)

DISTRIBUTION = "lognormal_32k"
CASES = ((BatchSize(64, 8), 40), (BatchSize(1024, 64), 20))  # (size, steps)
SYNC_CALLS = 8
MIN_STEP_S = 0.05


class ThreadPlanAhead:
    """Plan ahead with one background thread and the plain gRPC stub.

    Stand-in for trainer_client's plan-ahead API, which was not on main when this was written:
    the same pattern (prefetch(step, request), get(step) waits for what is not ready)."""

    API = "background thread + gRPC stub (trainer_client's plan-ahead API was not on main)"

    def __init__(self, stub):
        self._stub = stub
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-plan-ahead")
        self._pending: dict[int, Future[Plan]] = {}

    def _plan(self, request: PlanRequest) -> Plan:
        return plan_from_proto(self._stub.Plan(request_to_proto(request), timeout=300))

    def prefetch(self, step: int, request: PlanRequest) -> None:
        self._pending[step] = self._executor.submit(self._plan, request)

    def get(self, step: int, request: PlanRequest) -> float:
        """Seconds this call waited for the plan of `step`."""
        started = time.perf_counter()
        self._pending.pop(step).result()
        return time.perf_counter() - started

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass(frozen=True)
class CaseResult:
    size: BatchSize
    step_seconds: float
    sync: Spread
    waits: Spread


def measure(stub, size: BatchSize, steps: int) -> CaseResult:
    requests = [make_request(DISTRIBUTION, size, seed=s) for s in range(steps + SYNC_CALLS + 2)]
    sync = []
    for request in requests[steps + 1 :]:
        started = time.perf_counter()
        plan_from_proto(stub.Plan(request_to_proto(request), timeout=300))
        sync.append(time.perf_counter() - started)
    step_seconds = max(MIN_STEP_S, 2 * max(sync))
    ahead = ThreadPlanAhead(stub)
    try:
        ahead.prefetch(0, requests[0])
        ahead.get(0, requests[0])  # the first step's plan cannot be hidden; not counted
        waits = []
        for step in range(steps):
            ahead.prefetch(step + 1, requests[step + 1])
            time.sleep(step_seconds)  # the training step
            waits.append(ahead.get(step + 1, requests[step + 1]))
    finally:
        ahead.close()
    return CaseResult(size, step_seconds, Spread.of(sync), Spread.of(waits))


def run(out: Path, smoke: bool = False, address: str | None = None) -> Path:
    cases = ((BatchSize(64, 8), 3),) if smoke else CASES
    with planner_server(address, workers=2) as addr:
        channel, stub = planner_stub(addr)
        with channel:
            results = [measure(stub, size, steps) for size, steps in cases]
    ms = 1e3
    table = markdown_table(
        ["batch", "steps", "step s", "synchronous wait ms p50 (min..max)", "plan-ahead wait ms p50 (min..max)",
         "plan-ahead wait ms p99", "bar", "verdict"],
        [[r.size.label, r.waits.runs, f"{r.step_seconds:.3f}", r.sync.fmt(ms), r.waits.fmt(ms, 3),
          f"{r.waits.p99 * ms:.3f}", "p99 <= 1 ms", verdict(r.waits.p99 <= 1e-3)] for r in results],
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
        + f"\n\nPlan-ahead implementation used: {ThreadPlanAhead.API}. Batches: `{DISTRIBUTION}`, hybrid CP, "
        "a new seed every step; the synchronous wait includes decoding the plan, as does the plan-ahead thread.",
        [("Results", table + f"\n\n![plan ahead](hidden{suffix}.png)")],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--address", help="use this running planner instead of starting one")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.address).read_text())


if __name__ == "__main__":
    main()
