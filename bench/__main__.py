"""Runs every benchmark and writes docs/bench/*.md, *.png and summary.md.

    python -m bench --out docs/bench            # the full run (a few minutes)
    python -m bench --out /tmp/bench --smoke    # what CI's smoke tests do, in one go

One server with 2 workers serves the overhead, plan-ahead and scaling (2-worker arm) benchmarks;
a second with 1 worker is the other scaling arm; start-up runs last, after both are stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import hidden, overhead, quality, scaling, startup, trainer_cost
from bench.common import argument_parser, markdown_table, parse_markdown_tables, planner_server, write_report


def summary(out: Path, reports: list[Path], seconds: float) -> Path:
    rows = []
    for path in reports:
        text = path.read_text()
        title = text.splitlines()[0].lstrip("# ")
        for table in parse_markdown_tables(text):
            header, *body = table
            if "verdict" not in header:
                continue
            for row in body:
                cells = dict(zip(header, row))
                case = row[0] if header[0] != "runs" else ""
                rows.append([f"[{title}]({path.name})", case, cells.get("bar", "-"), cells["verdict"]])
    table = markdown_table(["benchmark", "case", "bar", "verdict"], rows)
    return write_report(
        out, "summary", "Benchmark summary",
        f"Bars of issue 5 and whether this run reached them. Full run: {seconds:.0f} s.",
        [("Bars", table)],
    )


def main(argv: list[str] | None = None) -> None:
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    out, smoke = args.out, args.smoke
    started = time.perf_counter()
    reports = []
    with planner_server(None, workers=2) as two, planner_server(None, workers=1) as one:
        reports.append(overhead.run(out, smoke, address=two))
        reports.append(hidden.run(out, smoke, address=two))
        reports.append(scaling.run(out, smoke, address_1=one, address_2=two))
    reports.append(trainer_cost.run(out, smoke))
    reports.append(quality.run(out, smoke))
    reports.append(startup.run(out, smoke))
    print(summary(out, reports, time.perf_counter() - started).read_text())


if __name__ == "__main__":
    main()
