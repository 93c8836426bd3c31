"""The drop-in benchmark runs and writes its two tables (bench/dropin.py; numbers in docs/bench/dropin.md)."""

from __future__ import annotations

from bench import dropin
from tests.test_bench_smoke import assert_report


def test_dropin_benchmark_smoke(tmp_path, planner):
    rows = assert_report(dropin.run(tmp_path, smoke=True, address=planner.address), 8, ["drop-in planning wait ms p50"])
    traffic = [r for r in rows if "global batch MiB" in r]
    assert traffic and all(float(r["drop-in received MiB (max rank)"]) <= float(r["global batch MiB"]) for r in traffic)
