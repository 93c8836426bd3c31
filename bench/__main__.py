"""Runs every benchmark and writes docs/bench/*.md, *.png and summary.md.

    python -m bench --out docs/bench            # the full run (a few minutes)
    python -m bench --out /tmp/bench --smoke    # what CI's smoke tests do, in one go
    python -m bench --only hidden,trainer_cost  # re-run some; summary.md covers every report in --out

The overhead benchmark runs first, on a server of its own with the default workers (one per core).
Then one server with 2 workers serves the plan-ahead (hidden, ahead), scaling (2-worker arm) and
drop-in benchmarks; a second with 1 worker is the other scaling arm; growth (the schedulers in
process, tens of minutes), start-up, fairness and the RL wait (servers of their own) run after both
are stopped, as does the forkserver-loss benchmark.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

from bench import (
    ahead, dropin, fairness, forkserver_loss, growth, hidden, nonpow2, overhead, quality, rl_wait, scaling, startup, trainer_cost,
)
from bench.common import argument_parser, bars_path, markdown_table, planner_server, read_bars, verdict, write_report


BENCHMARKS = (
    "overhead", "hidden", "ahead", "scaling", "dropin", "trainer_cost", "quality", "nonpow2", "growth", "startup", "fairness",
    "rl_wait", "forkserver_loss",
)


def summary(out: Path, reports: list[Path], seconds: float) -> Path:
    """The bars of every report in `reports`, from the data each run stored next to its markdown."""
    rows = []
    for path in reports:
        title, bars = read_bars(path)
        rows += [[f"[{title}]({path.name})", bar.case, bar.target, verdict(bar.met), measured(path)] for bar in bars]
    table = markdown_table(["benchmark", "case", "bar", "verdict", "measured"], rows)
    return write_report(
        out, "summary", "Benchmark summary",
        f"The benchmarks' bars (targets) and whether the last run of each benchmark reached them, with "
        f"when that run started (the last `python -m bench` call took {seconds:.0f} s).",
        [("Bars", table)],
        rows=rows,
    ).path


def measured(report: Path) -> str:
    """When the report's run started, from its machine note."""
    found = re.search(r"^Measured (\S+ \S+) ", report.read_text(), re.MULTILINE)
    return found.group(1) if found else "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    out, smoke, only = args.out, args.smoke, set(args.only.split(","))
    unknown = only - set(BENCHMARKS)
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {sorted(unknown)}; known: {', '.join(BENCHMARKS)}")
    started = time.perf_counter()
    if "overhead" in only:
        overhead.run(out, smoke)  # its own server, with the default workers
    if only & {"hidden", "ahead", "scaling", "dropin"}:
        # The 1-worker server only serves the scaling benchmark.
        one_worker = planner_server(None, workers=1) if "scaling" in only else contextlib.nullcontext(None)
        with planner_server(None, workers=2) as two, one_worker as one:
            if "hidden" in only:
                hidden.run(out, smoke, address=two)
            if "ahead" in only:
                ahead.run(out, smoke, address=two)
            if "scaling" in only:
                scaling.run(out, smoke, address_1=one, address_2=two)
            if "dropin" in only:
                dropin.run(out, smoke, address=two)
    if "trainer_cost" in only:
        trainer_cost.run(out, smoke)
    if "quality" in only:
        quality.run(out, smoke)
    if "nonpow2" in only:
        nonpow2.run(out, smoke)
    if "growth" in only:
        growth.run(out, smoke)
    if "startup" in only:
        startup.run(out, smoke)
    if "fairness" in only:
        fairness.run(out, smoke)  # its own servers: one with --max-job-share 0.5, one with 1.0
    if "rl_wait" in only:
        rl_wait.run(out, smoke)  # its own server, with the default workers (one per core)
    if "forkserver_loss" in only:
        forkserver_loss.run(out, smoke)  # its own server, 2 workers
    suffix = "_smoke" if smoke else ""
    reports = [out / f"{name}{suffix}.md" for name in BENCHMARKS if bars_path(out / f"{name}{suffix}.md").exists()]
    print(summary(out, reports, time.perf_counter() - started).read_text())


if __name__ == "__main__":
    main()
