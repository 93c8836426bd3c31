"""Smoke runs of the benchmarks (bench/): each one runs end to end on a tiny input and writes a
well-formed markdown table and its plots. No timing is asserted: speed is what the full
benchmarks report (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the benchmarks plot with matplotlib: install the `bench` extra")

from bench import hidden, overhead, quality, scaling, startup, trainer_cost  # noqa: E402
from bench.common import parse_markdown_tables  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_report(path: Path, min_rows: int, required_columns: list[str]) -> list[dict[str, str]]:
    """The report's first table has consistent rows and the columns asked for; every table is
    well formed; the plots it shows exist as PNGs."""
    text = path.read_text()
    tables = parse_markdown_tables(text)
    assert tables, f"{path.name}: no table"
    for table in tables[1:]:
        assert all(len(row) == len(table[0]) for row in table), f"{path.name}: ragged table {table}"
    header, *rows = tables[0]
    assert len(rows) >= min_rows, f"{path.name}: {len(rows)} rows"
    for row in rows:
        assert len(row) == len(header), f"{path.name}: row {row} does not match header {header}"
        assert all(cell for cell in row), f"{path.name}: empty cell in {row}"
    for column in required_columns:
        assert column in header, f"{path.name}: no column {column!r} in {header}"
    for line in text.splitlines():
        if line.startswith("!["):
            image = path.parent / line[line.index("(") + 1 : line.index(")")]
            assert image.read_bytes()[:8] == PNG_MAGIC, f"{image} is not a PNG"
    return [dict(zip(header, row)) for row in rows]


def test_overhead_smoke(tmp_path, planner):
    rows = assert_report(overhead.run(tmp_path, smoke=True, address=planner.address), 1, ["verdict"])
    assert rows[0]["samples on ranks"] == "64 on 8"
    assert rows[0]["runs"] == "5"
    assert rows[0]["verdict"] in ("met", "**NOT MET**")


def test_scaling_smoke(tmp_path, planner):
    # Both arms on the session's server: the smoke checks the harness, not the scaling.
    rows = assert_report(
        scaling.run(tmp_path, smoke=True, address_1=planner.address, address_2=planner.address), 1, ["verdict"]
    )
    assert float(rows[0]["--workers 1 plans/s p50 (min..max)"].split()[0]) > 0


def test_hidden_smoke(tmp_path, planner):
    rows = assert_report(hidden.run(tmp_path, smoke=True, address=planner.address), 1, ["plan-ahead wait ms p99"])
    assert rows[0]["steps"] == "3"
    # Every measured plan came from the service (the client's fallback is off in the benchmark).
    assert rows[0]["plans from"] == "service: 3", rows[0]["plans from"]


def test_trainer_cost_smoke(tmp_path):
    rows = assert_report(trainer_cost.run(tmp_path, smoke=True), 5, ["ms p50 (min..max)"])
    applies = [r for r in rows if r["what"].startswith("apply")]
    assert len(applies) == 2  # default threads and one thread
    for apply in applies:
        assert apply["runs"] == "8"  # one run per rank of the 8-rank plan
        assert apply["verdict"] in ("met", "**NOT MET**")


def test_quality_smoke(tmp_path):
    rows = assert_report(quality.run(tmp_path, smoke=True), 4 * 6, ["cost / lower bound", "CP-size mix (cp:samples)"])
    hybrid = [r for r in rows if r["plan"] == "hybrid CP"]
    assert len(hybrid) == 4
    # Nothing beats the lower bound under the cost model.
    assert all(float(r["cost / lower bound"]) >= 0.999 for r in hybrid)
    # Every sample appears in the CP-size mix of every plan.
    assert all(sum(int(p.split(":")[1]) for p in r["CP-size mix (cp:samples)"].split(", ")) == 64 for r in hybrid)
    for r in rows:
        if r["cost / lower bound"] == "-":
            assert r["note"].startswith("not available in Megatron-Core"), r


def test_startup_smoke(tmp_path):
    rows = assert_report(startup.run(tmp_path, smoke=True), 1, ["start to SERVING s p50 (min..max)"])
    assert rows[0]["--workers"] == "1"
    assert rows[0]["worker processes found"] == "1"
