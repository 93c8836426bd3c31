"""The drop-in benchmark runs and writes its two tables (bench/dropin.py; numbers in docs/bench/dropin.md)."""

from __future__ import annotations

from bench import dropin
from bench.common import parse_markdown_tables
from tests.test_bench_smoke import assert_report


def test_dropin_benchmark_smoke(tmp_path, planner):
    path = dropin.run(tmp_path, smoke=True, address=planner.address)
    assert_report(path, 4, ["drop-in planning wait ms p50"])
    header, *rows = parse_markdown_tables(path.read_text())[1]
    traffic = [dict(zip(header, row)) for row in rows]
    assert len(traffic) == 4
    assert all(float(r["drop-in received MiB (max rank)"]) <= float(r["global batch MiB"]) for r in traffic)
