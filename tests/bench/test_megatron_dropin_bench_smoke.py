"""The drop-in benchmark runs and writes its two tables (bench/dropin.py; numbers in docs/bench/dropin.md)."""

from __future__ import annotations

from bench import dropin
from tests.bench.test_bench_smoke import assert_report


def test_dropin_benchmark_smoke(tmp_path, planner):
    report = dropin.run(tmp_path, smoke=True, address=planner.address)
    assert_report(report, 4)
    assert all(row.received_max_mib <= row.global_mib for row in report.rows)
