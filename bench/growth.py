"""Growth: scheduler time from 64 to 65,536 samples and 8 to 4,096 DPxCP ranks, Megatron-Core's own
code, the exact path and its compiled execution side by side.

    python -m bench.growth --out docs/bench                 # measure what fits, extrapolate the rest
    python -m bench.growth --out docs/bench --cap-seconds 120 --schedulers dynamic_cp
    python -m bench.growth --out docs/bench --schedulers dynamic_cp --sizes 256x32,1024x128,4096x256,16384x1024,65536x4096

Each cell is one scheduler on one batch size (`lognormal_32k`, job CP 2, 8,192 tokens per rank),
timed in a timing process of its own with one torch thread, pinned to one core where the OS allows
(`os.sched_setaffinity`), after a warm-up plan per scheduler and implementation
(`batch_planner.schedulers.run_scheduler`: the scheduler's call and nothing else). The
implementations plan the same batches, interleaved run by run in that process: for each seed,
Megatron-Core's own code (`upstream`, `select_implementation("upstream")`), then the pure-Python
exact path (`exact`, batch_planner/exact, byte-identical plans), then its compiled execution
(`compiled`, the same plans; compiled before the first run), so each ratio of a cell (upstream /
exact, exact / compiled, upstream / compiled) is the median of ratios of runs on the same batch. Cells run smallest first; once three cells of an
implementation are measured, a log-log fit `t = a * samples^b * ranks^c` over them predicts the
next cell, and where the fit predicts upstream above `--cap-seconds` upstream is not run: its time
is the fit's extrapolation, marked as such, never a measurement (the number shown is the final fit
over every measured cell, so it can differ from the prediction that skipped the cell). The exact
path is measured in every cell. Runs per cell: repeated until `--min-seconds` of the slowest
implementation's time or `--max-runs`, each on a new seed; the tables show the median and min..max.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from batch_planner.request import SchedulerKind
from bench.common import (
    Bar,
    Report,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    pyplot,
    save_figure,
    verdict,
    write_report,
    BatchSize,
)

DISTRIBUTION = "lognormal_32k"
SAMPLES = (64, 256, 1024, 4096, 16384)
RANKS = (8, 32, 128, 256, 1024)
SMOKE_SAMPLES, SMOKE_RANKS = (64, 128), (8, 16)
CAP_S, MIN_S, MAX_RUNS = 120.0, 3.0, 5
IMPLEMENTATIONS = ("upstream", "exact", "compiled")  # the order of the runs on each batch
# Past the grid: one larger size (the exact path measured, upstream extrapolated).
EXTRA_SIZES = (BatchSize(65536, 4096),)
# The bars, on dynamic CP in the same run: upstream / exact at 4,096 on 256, the exact path's
# time at 16,384 on 1,024 on one core, and the compiled path's there.
RATIO_BAR, RATIO_SIZE = 30.0, BatchSize(4096, 256)
TIME_BAR_S, TIME_SIZE = 10.0, BatchSize(16384, 1024)
COMPILED_BAR_S = 0.05


def schedulers() -> tuple[SchedulerKind, ...]:
    """The schedulers with an exact path: hybrid and dynamic CP (`auto` on request, --schedulers)."""
    return (SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP)


@dataclass(frozen=True)
class Fit:
    """t = exp(log_a) * samples^samples_exp * ranks^ranks_exp, least squares in log space."""

    log_a: float
    samples_exp: float
    ranks_exp: float
    cells: int

    def predict(self, size: BatchSize) -> float:
        return math.exp(self.log_a + self.samples_exp * math.log(size.samples) + self.ranks_exp * math.log(size.ranks))


@dataclass(frozen=True)
class Cell:
    scheduler: str
    size: BatchSize
    seconds: Spread | None  # measured; None when extrapolated or failed
    predicted: float | None  # the fit's prediction (for every cell once a fit exists)
    error: str = ""  # why a measured cell has no time (the scheduler refused the batch)
    implementation: str = "upstream"
    times: tuple[float, ...] = ()  # run by run, seed 0, 1, ... (the pairing for the ratio)

    @property
    def measured(self) -> bool:
        return self.seconds is not None


def fit(cells: list[Cell]) -> Fit | None:
    """Least squares of log t on (1, log samples, log ranks); None below three measured cells or
    when the points do not span both axes."""
    points = [(math.log(c.size.samples), math.log(c.size.ranks), math.log(c.seconds.p50)) for c in cells if c.seconds]
    if len(points) < 3:
        return None
    n = len(points)
    sx, sy, sz = (sum(p[i] for p in points) / n for i in range(3))
    xx = sum((p[0] - sx) ** 2 for p in points)
    yy = sum((p[1] - sy) ** 2 for p in points)
    xy = sum((p[0] - sx) * (p[1] - sy) for p in points)
    xz = sum((p[0] - sx) * (p[2] - sz) for p in points)
    yz = sum((p[1] - sy) * (p[2] - sz) for p in points)
    det = xx * yy - xy * xy
    if abs(det) < 1e-9:
        return None
    b = (xz * yy - yz * xy) / det
    c = (yz * xx - xz * xy) / det
    return Fit(sz - b * sx - c * sy, b, c, n)


def scheduler_call(scheduler: str):
    """What a cell times: Megatron-Core's call alone; for `auto` (not one of Megatron-Core's
    classes: every candidate scheduler, then priced) the whole of plan_batch."""
    from batch_planner.planner import plan_batch
    from batch_planner.schedulers import run_scheduler

    return plan_batch if scheduler == "auto" else run_scheduler


def pin_to_one_core() -> str:
    """Pins this process to the last core it may run on; says which (or why not)."""
    try:
        core = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError) as exc:
        return f"not pinned ({type(exc).__name__})"
    return f"pinned to core {core}"


def timer_initializer(kinds: tuple[str, ...]) -> None:
    """The timing process: one torch thread, one core, every scheduler imported and run once per
    implementation on a small batch (the first call imports Megatron-Core, seconds that are no
    part of planning)."""
    import torch

    from batch_planner.exact.verified import select_implementation

    torch.set_num_threads(1)
    pin_to_one_core()
    from batch_planner.exact.prepare import prepare

    for kind in kinds:
        for implementation in IMPLEMENTATIONS:
            select_implementation(implementation)
            prepare()
            scheduler_call(kind)(make_request(DISTRIBUTION, BatchSize(64, 8), seed=10_000, scheduler=SchedulerKind(kind)))


def timer_setup() -> str:
    """In the timing process: how it is pinned, and which code each implementation runs."""
    from batch_planner.exact.verified import exact_path_status, select_implementation

    status = {}
    for implementation in IMPLEMENTATIONS[1:]:
        select_implementation(implementation)
        status.update({f"{k.value} ({implementation})": exact_path_status(k).reason for k in schedulers()})
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"timing process on cores {affinity}; exact path: " + "; ".join(f"{k}: {r}" for k, r in status.items())


def time_cell(args: tuple[str, int, int, float, int, tuple[str, ...]]) -> tuple[dict[str, list[float]], str]:
    """In the timing process: on new seeds until min_seconds (of the slowest implementation) or
    max_runs, each batch planned by every implementation asked for, one after the other."""
    from batch_planner.errors import PlanningError
    from batch_planner.exact.verified import select_implementation

    scheduler, samples, ranks, min_seconds, max_runs, implementations = args
    plan = scheduler_call(scheduler)
    times: dict[str, list[float]] = {i: [] for i in implementations}
    for seed in range(max_runs):
        request = make_request(DISTRIBUTION, BatchSize(samples, ranks), seed=seed, scheduler=SchedulerKind(scheduler))
        for implementation in implementations:
            select_implementation(implementation)
            started = time.perf_counter()
            try:
                plan(request)
            except PlanningError as error:
                return times, error.message.split(":")[0][:80]
            times[implementation].append(time.perf_counter() - started)
        if max(sum(t) for t in times.values()) >= min_seconds:
            break
    return times, ""


def grid(samples: tuple[int, ...], ranks: tuple[int, ...], extra: tuple[BatchSize, ...] = ()) -> list[BatchSize]:
    """Cells in order of growing work (samples x ranks), so the fit exists before the big ones."""
    cells = {BatchSize(s, r) for s in samples for r in ranks} | set(extra)
    return sorted(cells, key=lambda b: (b.samples * b.ranks, b.ranks))


def measure_scheduler(
    pool, scheduler: str, sizes: list[BatchSize], cap: float, min_s: float, max_runs: int,
    progress=None,
) -> dict[str, list[Cell]]:
    """Every cell of `scheduler`: the exact path always, upstream where its fit so far predicts at
    most `cap`. `progress(cells)` is called after each cell (partial reports)."""
    cells: dict[str, list[Cell]] = {i: [] for i in IMPLEMENTATIONS}
    for size in sizes:
        predicted = {}
        for implementation, done in cells.items():
            current = fit(done)
            predicted[implementation] = current.predict(size) if current else None
        run = tuple(i for i in IMPLEMENTATIONS if i != "upstream" or (predicted[i] or 0.0) <= cap)
        times, error = pool.apply(time_cell, ((scheduler, size.samples, size.ranks, min_s, max_runs, run),))
        for implementation in IMPLEMENTATIONS:
            measured = times.get(implementation, [])
            seconds = Spread.of(measured) if measured and not error else None
            cells[implementation].append(Cell(
                scheduler, size, seconds, predicted[implementation], error if implementation in run else "",
                implementation, tuple(measured),
            ))
        print(f"growth: {scheduler} {size.label}: {error or {i: [round(t, 4) for t in v] for i, v in times.items()}}", flush=True)
        if progress is not None:
            progress(cells)
    return {implementation: refit(done) for implementation, done in cells.items()}


def refit(cells: list[Cell]) -> list[Cell]:
    """The cells with every prediction replaced by the final fit's (over every measured cell)."""
    final = fit(cells)
    return [replace(c, predicted=final.predict(c.size) if final else None) for c in cells]


def paired_ratio(upstream: Cell, exact: Cell) -> Spread | None:
    """upstream / exact (or any slower / faster pair), run by run on the same batch; None where
    either was not measured."""
    pairs = [u / e for u, e in zip(upstream.times, exact.times) if e > 0]
    return Spread.of(pairs) if upstream.seconds and exact.seconds and pairs else None


def cell_text(cell: Cell) -> str:
    if cell.error:
        return f"refused: {cell.error}"
    if cell.seconds is not None:
        s = cell.seconds
        return f"{s.p50:.3g} s ({s.min:.3g}..{s.max:.3g}, {s.runs} runs)"
    return f"*~{cell.predicted:.3g} s, extrapolated*" if cell.predicted else "not run"


def ratio_text(upstream: Cell, exact: Cell) -> str:
    ratio = paired_ratio(upstream, exact)
    if ratio is not None:
        return f"**{ratio.p50:.3g}x** ({ratio.min:.3g}..{ratio.max:.3g})"
    if exact.seconds and upstream.predicted and not upstream.error:
        return f"*~{upstream.predicted / exact.seconds.p50:.3g}x, upstream extrapolated*"
    return "-"


def table(cells: list[Cell], samples: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    by = {(c.size.samples, c.size.ranks): c for c in cells}
    rows = [[f"{s:,}"] + [cell_text(by[(s, r)]) if (s, r) in by else "pending" for r in ranks] for s in samples]
    return markdown_table(["samples \\ DPxCP ranks"] + [str(r) for r in ranks], rows)


# The ratios a side-by-side table shows: (slower, faster) implementations.
RATIOS = (("upstream", "exact"), ("exact", "compiled"), ("upstream", "compiled"))


def side_by_side(by_implementation: dict[str, list[Cell]]) -> str:
    """One row per cell: every implementation's time and the paired ratios."""
    names = [i for i in IMPLEMENTATIONS if i in by_implementation]
    ratios = [(a, b) for a, b in RATIOS if a in by_implementation and b in by_implementation]
    rows = []
    for cells in zip(*(by_implementation[i] for i in names)):
        by = dict(zip(names, cells))
        rows.append([cells[0].size.label] + [cell_text(c) for c in cells] + [ratio_text(by[a], by[b]) for a, b in ratios])
    return markdown_table(
        ["samples on DPxCP ranks"] + [f"{i} s/plan" for i in names] + [f"{a} / {b} (same batches)" for a, b in ratios], rows
    )


def plot(results: dict[str, dict[str, list[Cell]]], ranks: tuple[int, ...], path: Path) -> None:
    """A column per scheduler, a row per implementation; filled markers measured, hollow extrapolated."""
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(len(IMPLEMENTATIONS), len(names), figsize=(6 * len(names), 4.2 * len(IMPLEMENTATIONS)),
                             squeeze=False, sharey="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, scheduler in enumerate(names):
        for row_index, implementation in enumerate(IMPLEMENTATIONS):
            ax, cells = axes[row_index][column], results[scheduler][implementation]
            for color, r in zip(colors, ranks):
                row = sorted((c for c in cells if c.size.ranks == r), key=lambda c: c.size.samples)
                done = [(c.size.samples, c.seconds.p50) for c in row if c.seconds]
                guess = [(c.size.samples, c.predicted) for c in row if not c.seconds and not c.error and c.predicted]
                if done:
                    ax.plot(*zip(*done), marker="o", color=color, label=f"{r} ranks")
                if guess:
                    ax.plot(*zip(*(done[-1:] + guess)), linestyle=":", color=color)
                    ax.plot(*zip(*guess), marker="o", fillstyle="none", linestyle="none", color=color)
            f = fit(cells)
            exps = f" ~ samples^{f.samples_exp:.2f} x ranks^{f.ranks_exp:.2f}" if f else ""
            ax.set_title(f"{scheduler}, {implementation}{exps}", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("samples per global batch")
            ax.set_ylabel("scheduler seconds per plan (one core)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, title="filled: measured, hollow: extrapolated", title_fontsize=7)
    save_figure(fig, path)


def fit_text(scheduler: str, implementation: str, f: Fit | None) -> list[object]:
    if f is None:
        return [scheduler, implementation, "-", "-", "-", "fewer than 3 measured cells"]
    return [scheduler, implementation, f.cells, f"{f.samples_exp:.2f}", f"{f.ranks_exp:.2f}", f"{math.exp(f.log_a):.3g}"]


def bars(results: dict[str, dict[str, list[Cell]]]) -> list[Bar]:
    """The bars on dynamic CP (RATIO_BAR, TIME_BAR_S, COMPILED_BAR_S), where this run has their cells."""
    if "dynamic_cp" not in results:
        return []
    by = {(i, c.size): c for i, cells in results["dynamic_cp"].items() for c in cells}
    found: list[Bar] = []
    upstream, exact = by.get(("upstream", RATIO_SIZE)), by.get(("exact", RATIO_SIZE))
    ratio = paired_ratio(upstream, exact) if upstream and exact else None
    if ratio is not None:
        found.append(Bar(f"dynamic CP {RATIO_SIZE.label}: upstream / exact {ratio.p50:.3g}x", f">= {RATIO_BAR:g}x", ratio.p50 >= RATIO_BAR))
    big = by.get(("exact", TIME_SIZE))
    if big is not None and big.seconds is not None:
        found.append(Bar(f"dynamic CP {TIME_SIZE.label}, exact: {big.seconds.p50:.3g} s", f"<= {TIME_BAR_S:g} s on one core", big.seconds.p50 <= TIME_BAR_S))
    compiled = by.get(("compiled", TIME_SIZE))
    if compiled is not None and compiled.seconds is not None:
        speedup = paired_ratio(big, compiled) if big is not None else None
        found.append(Bar(
            f"dynamic CP {TIME_SIZE.label}, compiled: {compiled.seconds.p50 * 1000:.3g} ms"
            + (f" (exact / compiled {speedup.p50:.3g}x)" if speedup else ""),
            f"<= {COMPILED_BAR_S * 1000:g} ms p50 on one core", compiled.seconds.p50 <= COMPILED_BAR_S,
        ))
    return found


def write(
    out: Path, suffix: str, results: dict[str, dict[str, list[Cell]]], samples: tuple[int, ...], ranks: tuple[int, ...],
    cap: float, min_seconds: float, max_runs: int, setup: str, partial: bool = False,
) -> Report[Cell]:
    plot(results, ranks, out / f"growth{suffix}.png")
    sections = []
    for name, by_implementation in results.items():
        sections.append((f"{name}: {', '.join(by_implementation)}, side by side", side_by_side(by_implementation)))
        for implementation, cells in by_implementation.items():
            sections.append((f"{name}, {implementation}: seconds per plan", table(cells, samples, ranks)))
    sections.append((
        "Fitted exponents (measured cells only)",
        markdown_table(["scheduler", "implementation", "cells fitted", "samples exponent", "ranks exponent", "a (s)"],
                       [fit_text(n, i, fit(cells)) for n, by_i in results.items() for i, cells in by_i.items()])
        + f"\n\n![growth](growth{suffix}.png)",
    ))
    found = bars(results)
    if found:
        sections.append(("Bars", markdown_table(["case", "bar", "verdict"], [[b.case, b.target, verdict(b.met)] for b in found])))
    return write_report(
        out, f"growth{suffix}", "Growth of scheduler time with samples and ranks: Megatron-Core's code, the exact path and its compiled execution",
        ("**Partial: the run is still going.**\n\n" if partial else "")
        + (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nThis run: cap {cap:g} s per upstream cell, at least {min_seconds:g} s or {max_runs} runs per cell; "
        f"{setup}. A cell in *italics* was not run: its time is the fit's extrapolation (the load average "
        "below is the one when the report was written).",
        sections,
        rows=[c for by_i in results.values() for cells in by_i.values() for c in cells],
        bars=found,
    )


def run(
    out: Path, smoke: bool = False, cap: float = CAP_S, min_seconds: float = MIN_S, max_runs: int = MAX_RUNS,
    kinds: tuple[SchedulerKind, ...] | None = None, only_sizes: tuple[BatchSize, ...] = (),
) -> Report[Cell]:
    """The grid (or `only_sizes`, smallest work first) for each scheduler of `kinds`."""
    from batch_planner.schedulers import discover_schedulers

    samples, ranks = (SMOKE_SAMPLES, SMOKE_RANKS) if smoke else (SAMPLES, RANKS)
    if smoke:
        min_seconds, max_runs = 0.0, 1
    available = {k for k, a in discover_schedulers().items() if a.available} | {SchedulerKind.AUTO}
    chosen = [k for k in (kinds or schedulers()) if k in available]
    sizes = grid((), (), only_sizes) if only_sizes else grid(samples, ranks, () if smoke else EXTRA_SIZES)
    if only_sizes:
        samples = tuple(sorted({b.samples for b in only_sizes}))
        ranks = tuple(sorted({b.ranks for b in only_sizes}))
    names = tuple(k.value for k in chosen)
    suffix = "_smoke" if smoke else ""
    results: dict[str, dict[str, list[Cell]]] = {}
    # One spawned timing process (one torch thread, one core), so this process's imports and
    # threads are not in the measurement.
    with multiprocessing.get_context("spawn").Pool(1, timer_initializer, (names,)) as pool:
        setup = f"load average when the run started {os.getloadavg()[0]:.2f}; " + pool.apply(timer_setup)
        print(f"growth: {setup}", flush=True)

        def progress(name: str, cells: dict[str, list[Cell]]) -> None:
            if not smoke:
                write(out, suffix, {**results, name: cells}, samples, ranks, cap, min_seconds, max_runs, setup, partial=True)

        for name in names:
            results[name] = measure_scheduler(
                pool, name, sizes, cap, min_seconds, max_runs, lambda cells, name=name: progress(name, cells))
    return write(out, suffix, results, samples, ranks, cap, min_seconds, max_runs, setup)


def parse_cells(text: str) -> list[tuple[str, BatchSize]]:
    """'dynamic_cp:4096x512,hybrid_cp:16384x1024' -> [(scheduler, size), ...]"""
    cells = []
    for item in text.split(","):
        scheduler, size = item.split(":")
        samples, ranks = size.split("x")
        cells.append((SchedulerKind(scheduler).value, BatchSize(int(samples), int(ranks))))
    return cells


def run_cells(out: Path, cells: list[tuple[str, BatchSize]], jobs: int, max_runs: int) -> Report[Cell]:
    """Named cells only, `jobs` at a time, each in its own one-thread timing process (one run each
    unless --max-runs), both implementations on the same batches: for a machine with more cores
    than cells, to measure what the sequential run can only extrapolate."""
    names = tuple(sorted({name for name, _ in cells}))
    with multiprocessing.get_context("spawn").Pool(jobs, timer_initializer, (names,), maxtasksperchild=1) as pool:
        futures = [pool.apply_async(time_cell, ((n, b.samples, b.ranks, math.inf, max_runs, IMPLEMENTATIONS),)) for n, b in cells]
        results = [f.get() for f in futures]
    rows = [
        Cell(n, b, Spread.of(t[i]) if t.get(i) and not e else None, None, e, i, tuple(t.get(i, ())))
        for (n, b), (t, e) in zip(cells, results) for i in IMPLEMENTATIONS
    ]
    width = len(IMPLEMENTATIONS)
    table_rows = [
        [cells[0].scheduler, cells[0].size.label] + [cell_text(c) for c in cells] + [ratio_text(cells[0], c) for c in cells[1:]]
        for cells in (rows[k : k + width] for k in range(0, len(rows), width))
    ]
    return write_report(
        out, "growth_cells", "Scheduler time of named cells, measured in parallel",
        f"Each cell in its own timing process with one torch thread, {jobs} cells at a time "
        f"(`python -m bench.growth --cells ...`), {', then '.join(IMPLEMENTATIONS)} on each batch, on the same inputs as "
        "docs/bench/growth.md.",
        [("Results", markdown_table(
            ["scheduler", "samples on ranks"] + [f"{i} s/plan" for i in IMPLEMENTATIONS] + [f"upstream / {i}" for i in IMPLEMENTATIONS[1:]],
            table_rows,
        ))],
        rows=rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--cap-seconds", type=float, default=CAP_S, help="skip upstream cells the fit predicts above this")
    parser.add_argument("--min-seconds", type=float, default=MIN_S, help="scheduler time to collect per cell")
    parser.add_argument("--max-runs", type=int, default=MAX_RUNS, help="most runs per cell")
    parser.add_argument("--schedulers", default="", help="comma-separated subset (default: hybrid_cp,dynamic_cp)")
    parser.add_argument("--cells", default="", help="measure only these, e.g. dynamic_cp:4096x512,hybrid_cp:64x8")
    parser.add_argument("--jobs", type=int, default=1, help="with --cells: cells measured at once")
    parser.add_argument("--sizes", default="", help="only these sizes instead of the grid, e.g. 1024x128,4096x256 (samples x ranks)")
    args = parser.parse_args(argv)
    if args.cells:
        print(run_cells(args.out, parse_cells(args.cells), args.jobs, args.max_runs).path.read_text())
        return
    kinds = tuple(SchedulerKind(s) for s in args.schedulers.split(",") if s) or None
    sizes = tuple(BatchSize(*map(int, item.split("x"))) for item in args.sizes.split(",") if item)
    report = run(args.out, args.smoke, args.cap_seconds, args.min_seconds, args.max_runs, kinds, sizes)
    print(report.path.read_text())


if __name__ == "__main__":
    main()
