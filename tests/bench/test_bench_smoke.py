"""Smoke runs of the benchmarks (bench/): each one runs end to end on a tiny input, returns its
typed rows, writes a well-formed markdown table and its plots, and stores its bars as the data the
summary is built from. No timing is asserted: speed is what the full benchmarks report
(docs/benchmarks.md)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("matplotlib", reason="the benchmarks plot with matplotlib: install the `bench` extra")

from bench import (  # noqa: E402
    ahead, auto_transfer, fairness, forkserver_loss, growth, hidden, nonpow2, overhead, quality, rl_wait, scaling, side_by_side, startup,
    trainer_cost,
)
from bench.__main__ import summary  # noqa: E402
from bench.common import DISTRIBUTION_NAMES, Bar, BatchSize, Report, read_bars, write_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALLEST = BatchSize(64, 8)


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every table in `text` as rows of cells (header first, separator dropped)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            if not all(c and set(c) <= {"-", ":"} for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def assert_report(report: Report, min_rows: int) -> None:
    """The report has the rows asked for; its markdown tables are well formed, with no empty cell
    and a row per typed row in the first; the plots it shows exist as PNGs."""
    assert len(report.rows) >= min_rows, f"{report.path.name}: {len(report.rows)} rows"
    text = report.path.read_text()
    tables = markdown_tables(text)
    assert tables, f"{report.path.name}: no table"
    for header, *rows in tables:
        for row in rows:
            assert len(row) == len(header), f"{report.path.name}: row {row} does not match header {header}"
            assert all(cell for cell in row), f"{report.path.name}: empty cell in {row}"
    for line in text.splitlines():
        if line.startswith("!["):
            image = report.path.parent / line[line.index("(") + 1 : line.index(")")]
            assert image.read_bytes()[:8] == PNG_MAGIC, f"{image} is not a PNG"


def assert_bars_stored(report: Report) -> None:
    """The summary's data: what the run returned is what it stored."""
    assert read_bars(report.path) == (report.title, report.bars)


def test_overhead_smoke(tmp_path, planner):
    report = overhead.run(tmp_path, smoke=True, address=planner.address)
    assert_report(report, 1)
    assert report.rows[0].size == SMALLEST
    assert report.rows[0].scheduler.runs == 5
    assert [(bar.case, bar.target) for bar in report.bars] == [("64 on 8", "added (rpc - run_scheduler) p50 <= 1 ms")]
    row = report.rows[0]
    assert row.plan_batch.runs == row.encode.runs == row.decode.runs == row.server.rpc.runs == row.floor.runs == 5
    # The bare gRPC arm is the floor of the Plan RPC: rpc - floor - run_scheduler > -run_scheduler.
    assert row.floor.min > 0 and row.server.beyond_floor.p50 + row.scheduler.p50 > 0
    assert "added beyond bare gRPC" in report.path.read_text()
    assert_bars_stored(report)


def test_overhead_side_by_side_smoke(tmp_path, planner):
    # This tree stands in for the baseline checkout: the harness starts its server from that
    # checkout and measures both, interleaved; the report names the baseline's commit.
    report = overhead.run(tmp_path, smoke=True, address=planner.address, baseline=side_by_side.ROOT)
    assert_report(report, 1)
    row = report.rows[0]
    assert row.baseline is not None and row.baseline.rpc.runs == row.server.rpc.runs == 5
    baseline = side_by_side.trees(side_by_side.ROOT)[1]
    assert report.path.name == f"overhead_vs_{baseline.commit}_smoke.md"
    text = report.path.read_text()
    assert "New and baseline side by side" in text and f"**baseline** = commit {baseline.commit}" in text
    assert_bars_stored(report)


def test_side_by_side_refuses_a_flag_a_tree_lacks():
    trees = side_by_side.trees(side_by_side.ROOT)
    side_by_side.check_flags(trees, ["--max-job-share", "0.5", "--drain-seconds=5"])
    with pytest.raises(SystemExit, match="has no --no-such-flag"):
        side_by_side.check_flags(trees, ["--no-such-flag", "1"])


def test_scaling_smoke(tmp_path, planner):
    # Both arms on the session's server: the smoke checks the harness, not the scaling.
    report = scaling.run(tmp_path, smoke=True, address_1=planner.address, address_2=planner.address)
    assert_report(report, 1)
    assert min(report.rows[0].result.one) > 0
    assert_bars_stored(report)


def test_hidden_smoke(tmp_path, planner):
    report = hidden.run(tmp_path, smoke=True, address=planner.address)
    assert_report(report, 1)
    assert report.rows[0].waits.runs == 3
    # Every measured plan came from the service (the client's fallback is off in the benchmark).
    assert report.rows[0].sources == {"service": 3}, report.rows[0].sources
    assert_bars_stored(report)


def test_ahead_smoke(tmp_path, planner):
    report = ahead.run(tmp_path, smoke=True, address=planner.address)
    assert_report(report, 1)
    result = report.rows[0]
    assert (result.deep.depth, result.shallow.depth) == (2, 1)
    assert len(result.deep.warmup_waits) + len(result.deep.waits) == result.settings.steps
    assert result.deep.sources == {"service": result.settings.steps}  # fallback is off in the benchmark
    assert 0 < result.step_seconds < result.latency.p50
    assert_bars_stored(report)


def test_growth_smoke(tmp_path):
    report = growth.run(tmp_path, smoke=True)
    assert_report(report, 4)
    measured = [c for c in report.rows if c.measured]
    assert measured and all(c.seconds.p50 > 0 for c in measured)
    # Every cell is measured or marked as the fit's extrapolation, never both.
    assert all(c.measured or c.error or c.predicted is not None for c in report.rows)
    # The exact path is measured in every cell, upstream side by side on the same batches.
    exact = [c for c in report.rows if c.implementation == "exact"]
    upstream = [c for c in report.rows if c.implementation == "upstream"]
    assert exact and all(c.measured for c in exact) and len(upstream) == len(exact)
    assert all(len(u.times) == len(e.times) for u, e in zip(upstream, exact) if u.measured)
    text = report.path.read_text()
    assert "Fitted exponents" in text and "upstream / exact" in text


def test_growth_fit_recovers_known_exponents():
    cells = [growth.Cell("x", BatchSize(s, r), growth.Spread.of([1e-6 * s**1.5 * r**0.5]), None)
             for s in (64, 256, 1024) for r in (8, 64)]
    fit = growth.fit(cells)
    assert fit is not None and abs(fit.samples_exp - 1.5) < 1e-6 and abs(fit.ranks_exp - 0.5) < 1e-6
    assert abs(fit.predict(BatchSize(16384, 1024)) - 1e-6 * 16384**1.5 * 1024**0.5) < 1e-6


def test_rl_wait_smoke(tmp_path, planner):
    report = rl_wait.run(tmp_path, smoke=True, address=planner.address)
    assert_report(report, 4)
    cases = [r for r in report.rows if isinstance(r, rl_wait.Case)]
    assert {(c.scheduler, c.size) for c in cases} == {(s.value, b) for s in rl_wait.SCHEDULERS for b in rl_wait.SMOKE_SIZES}
    assert all(c.waits.runs == rl_wait.SMOKE_RUNS and c.waits.min > 0 for c in cases)
    assert all(c.candidates != "-" for c in cases if c.scheduler == "auto")  # auto lists its candidates
    assert_bars_stored(report)


def test_trainer_cost_smoke(tmp_path):
    report = trainer_cost.run(tmp_path, smoke=True)
    assert_report(report, 5)
    applies = [r for r in report.rows if r.what.startswith("apply")]
    assert len(applies) == 2  # default threads and one thread
    for apply in applies:
        assert apply.values.runs == 8  # one run per rank of the 8-rank plan
        assert apply.met is not None
    assert len(report.bars) == 2
    assert_bars_stored(report)


def test_quality_smoke(tmp_path):
    report = quality.run(tmp_path, smoke=True)
    assert_report(report, len(DISTRIBUTION_NAMES) * 6)
    rows = [r for r in report.rows if isinstance(r, quality.Row)]
    autos = [r for r in report.rows if isinstance(r, quality.AutoRow)]
    hybrid = [r for r in rows if r.name == "hybrid CP"]
    assert len(hybrid) == len(DISTRIBUTION_NAMES)  # one a distribution
    # Nothing beats the lower bound under the cost model.
    assert all(r.cost_over_bound >= 0.999 for r in hybrid)
    # Every sample appears in the CP-size mix of every plan.
    assert all(sum(int(p.split(":")[1]) for p in r.cp_mix.split(", ")) == 64 for r in hybrid)
    for r in rows:
        if r.cost_over_bound is None:
            assert r.note.startswith(("not available in Megatron-Core", "refused: ")), r
    # auto: every distribution under every preset, never slower than the best static CP it tried.
    assert len(autos) == len(DISTRIBUTION_NAMES) * len(quality.AUTO_PRESETS)
    assert all(a.cost_over_bound >= 0.999 and (a.speedup_over_best_static or 1.0) >= 1.0 for a in autos)


def test_nonpow2_smoke(tmp_path):
    report = nonpow2.run(tmp_path, smoke=True)
    assert [r.dp_cp for r in report.rows] == [8, 12, 16]
    for r in report.rows:
        # one seed x every distribution x every density
        assert r.batches == r.upstream + sum(r.substitutes.values()) + r.refused == len(DISTRIBUTION_NAMES) * len(nonpow2.SAMPLES_PER_RANK)
        assert r.auto_ratio_geomean >= 1.0 - 1e-9  # auto with dynamic CP never predicts worse than without
    assert_bars_stored(report)


def test_auto_transfer_smoke(tmp_path):
    # The handler's two ways of loading auto's candidates answer the same bytes (the run asserts
    # it), each arm timed every run.
    report = auto_transfer.run(tmp_path, smoke=True)
    assert [(r.what, r.size.samples) for r in report.rows] == [("handler", 64)]
    assert report.rows[0].first.runs == report.rows[0].second.runs == auto_transfer.SMOKE_RUNS


def test_startup_smoke(tmp_path):
    report = startup.run(tmp_path, smoke=True)
    assert_report(report, 1)
    assert report.rows[0].workers == 1
    assert report.rows[0].worker_counts == (1,)


def test_forkserver_loss_smoke(tmp_path):
    report = forkserver_loss.run(tmp_path, smoke=True)
    assert_report(report, 2)
    assert [row[0] for row in report.rows] == ["after a kill", "steady"]
    assert report.rows[0][1] > 0  # plans were sent while the forkserver and a worker were replaced


def test_fairness_smoke(tmp_path):
    report = fairness.run(tmp_path, smoke=True)
    assert_report(report, 3)
    alone, beside, unbounded = report.rows
    assert alone.latency is not None and beside.latency is not None
    # With the per-job share the quiet job is admitted beside the burst; without it, it is refused.
    assert "RESOURCE_EXHAUSTED" not in beside.quiet_codes
    assert "RESOURCE_EXHAUSTED" in unbounded.quiet_codes
    assert [b.case for b in report.bars] == ["quiet job's p99 beside the bursting job / alone"]


def test_summary_lists_the_stored_bars_of_every_report(tmp_path):
    with_bars = write_report(tmp_path, "a", "Benchmark A", "intro", [], rows=[], bars=[Bar("64 on 8", "<= 1 ms", False)])
    without = write_report(tmp_path, "b", "Benchmark B", "intro", [], rows=[])
    text = summary(tmp_path, [with_bars.path], 1.0).read_text()
    [row] = markdown_tables(text)[0][1:]
    assert row[:4] == ["[Benchmark A](a.md)", "64 on 8", "<= 1 ms", "**NOT MET**"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", row[4]), row  # when run A started, from its machine note
    assert not (tmp_path / "b.bars.json").exists() and without.bars == ()
