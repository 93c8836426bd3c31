"""Growth: Megatron-Core's scheduler time from 64 to 16,384 samples and 8 to 1,024 DPxCP ranks.

    python -m bench.growth --out docs/bench                 # measure what fits, extrapolate the rest
    python -m bench.growth --out docs/bench --cap-seconds 90 --jobs 1

Each cell is one scheduler on one batch size (`lognormal_32k`, job CP 2, 8,192 tokens per rank),
timed in a timing process of its own with one torch thread, after a warm-up plan per scheduler (`batch_planner.schedulers.run_scheduler`:
Megatron-Core's call and nothing else; one core). Cells run smallest first; once three cells of a
scheduler are measured, a log-log fit `t = a * samples^b * ranks^c` over them predicts the next
cell, and a cell predicted above `--cap-seconds` is not run: it is reported as an extrapolation of
the fit, marked as such, never as a measurement (the number shown is the final fit over every
measured cell, so it can differ from the prediction that skipped the cell). Runs per cell: repeated until `--min-seconds` of
scheduler time or `--max-runs`, each on a new seed; the table shows the median and min..max.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.request import SchedulerKind
from bench.common import (
    Report,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    pyplot,
    save_figure,
    write_report,
    BatchSize,
)

DISTRIBUTION = "lognormal_32k"
SAMPLES = (64, 256, 1024, 4096, 16384)
RANKS = (8, 32, 128, 512, 1024)
SMOKE_SAMPLES, SMOKE_RANKS = (64, 128), (8, 16)
CAP_S, MIN_S, MAX_RUNS = 90.0, 3.0, 5


def schedulers() -> tuple[SchedulerKind, ...]:
    """Hybrid and dynamic CP, and `auto` where this checkout has it."""
    kinds = [SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP]
    auto = getattr(SchedulerKind, "AUTO", None)
    return tuple(kinds + ([auto] if auto is not None else []))


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


def timer_initializer(kinds: tuple[str, ...]) -> None:
    """The timing process: one torch thread, every scheduler imported and run once on a small
    batch (the first call imports Megatron-Core, seconds that are no part of planning)."""
    import torch

    torch.set_num_threads(1)
    for kind in kinds:
        scheduler_call(kind)(make_request(DISTRIBUTION, BatchSize(64, 8), seed=10_000, scheduler=SchedulerKind(kind)))


def time_cell(args: tuple[str, int, int, float, int]) -> tuple[list[float], str]:
    """In the timing process: the scheduler on new seeds until min_seconds or max_runs."""
    from batch_planner.errors import PlanningError

    scheduler, samples, ranks, min_seconds, max_runs = args
    plan = scheduler_call(scheduler)
    times: list[float] = []
    for seed in range(max_runs):
        request = make_request(DISTRIBUTION, BatchSize(samples, ranks), seed=seed, scheduler=SchedulerKind(scheduler))
        started = time.perf_counter()
        try:
            plan(request)
        except PlanningError as error:
            return times, error.message.split(":")[0][:80]
        times.append(time.perf_counter() - started)
        if sum(times) >= min_seconds:
            break
    return times, ""


def grid(samples: tuple[int, ...], ranks: tuple[int, ...]) -> list[BatchSize]:
    """Cells in order of growing work (samples x ranks), so the fit exists before the big ones."""
    return sorted((BatchSize(s, r) for s in samples for r in ranks), key=lambda b: (b.samples * b.ranks, b.ranks))


def measure_scheduler(
    pool, scheduler: str, sizes: list[BatchSize], cap: float, min_s: float, max_runs: int
) -> list[Cell]:
    cells: list[Cell] = []
    for size in sizes:
        current = fit(cells)
        predicted = current.predict(size) if current else None
        if predicted is not None and predicted > cap:
            cells.append(Cell(scheduler, size, None, predicted))
            continue
        times, error = pool.apply(time_cell, ((scheduler, size.samples, size.ranks, min_s, max_runs),))
        cells.append(Cell(scheduler, size, Spread.of(times) if times and not error else None, predicted, error))
        print(f"growth: {scheduler} {size.label}: {times or error}", flush=True)
    final = fit(cells)
    return [Cell(c.scheduler, c.size, c.seconds, final.predict(c.size) if final else None, c.error) for c in cells]


def cell_text(cell: Cell) -> str:
    if cell.error:
        return f"refused: {cell.error}"
    if cell.seconds is not None:
        s = cell.seconds
        return f"{s.p50:.3g} s ({s.min:.3g}..{s.max:.3g}, {s.runs} runs)"
    return f"*~{cell.predicted:.3g} s, extrapolated*" if cell.predicted else "not run"


def table(cells: list[Cell], samples: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    by = {(c.size.samples, c.size.ranks): c for c in cells}
    rows = [[f"{s:,}"] + [cell_text(by[(s, r)]) for r in ranks] for s in samples]
    return markdown_table(["samples \\ DPxCP ranks"] + [str(r) for r in ranks], rows)


def plot(results: dict[str, list[Cell]], fits: dict[str, Fit | None], ranks: tuple[int, ...], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (scheduler, cells) in zip(axes[0], results.items()):
        for color, r in zip(colors, ranks):
            row = sorted((c for c in cells if c.size.ranks == r), key=lambda c: c.size.samples)
            done = [(c.size.samples, c.seconds.p50) for c in row if c.seconds]
            guess = [(c.size.samples, c.predicted) for c in row if not c.seconds and not c.error and c.predicted]
            if done:
                ax.plot(*zip(*done), marker="o", color=color, label=f"{r} ranks")
            if guess:
                bridge = done[-1:] + guess
                ax.plot(*zip(*bridge), linestyle=":", color=color)
                ax.plot(*zip(*guess), marker="o", fillstyle="none", linestyle="none", color=color)
        f = fits[scheduler]
        exps = f" ~ samples^{f.samples_exp:.2f} x ranks^{f.ranks_exp:.2f}" if f else ""
        ax.set_title(f"{scheduler}{exps}", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples per global batch")
        ax.set_ylabel("scheduler seconds per plan (one core)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, title="filled: measured, hollow: extrapolated", title_fontsize=7)
    save_figure(fig, path)


def fit_text(scheduler: str, f: Fit | None) -> list[object]:
    if f is None:
        return [scheduler, "-", "-", "-", "fewer than 3 measured cells"]
    return [scheduler, f.cells, f"{f.samples_exp:.2f}", f"{f.ranks_exp:.2f}", f"{math.exp(f.log_a):.3g}"]


def run(
    out: Path, smoke: bool = False, cap: float = CAP_S, min_seconds: float = MIN_S, max_runs: int = MAX_RUNS,
    kinds: tuple[SchedulerKind, ...] | None = None,
) -> Report[Cell]:
    from batch_planner.schedulers import discover_schedulers

    samples, ranks = (SMOKE_SAMPLES, SMOKE_RANKS) if smoke else (SAMPLES, RANKS)
    if smoke:
        min_seconds, max_runs = 0.0, 1
    available = {k for k, a in discover_schedulers().items() if a.available} | set(schedulers()[2:])
    chosen = [k for k in (kinds or schedulers()) if k in available]
    sizes = grid(samples, ranks)
    names = tuple(k.value for k in chosen)
    # One spawned timing process (one torch thread), so this process's imports and threads are not
    # in the measurement.
    with multiprocessing.get_context("spawn").Pool(1, timer_initializer, (names,)) as pool:
        results = {name: measure_scheduler(pool, name, sizes, cap, min_seconds, max_runs) for name in names}
    fits = {name: fit(cells) for name, cells in results.items()}
    suffix = "_smoke" if smoke else ""
    plot(results, fits, ranks, out / f"growth{suffix}.png")
    sections = [(f"{name}: seconds per plan", table(cells, samples, ranks)) for name, cells in results.items()]
    sections.append((
        "Fitted exponents (measured cells only)",
        markdown_table(["scheduler", "cells fitted", "samples exponent", "ranks exponent", "a (s)"],
                       [fit_text(n, f) for n, f in fits.items()])
        + f"\n\n![growth](growth{suffix}.png)",
    ))
    return write_report(
        out, f"growth{suffix}", "Growth of Megatron-Core's scheduler time with samples and ranks",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nThis run: cap {cap:g} s per cell, at least {min_seconds:g} s or {max_runs} runs per cell. "
        "A cell in *italics* was not run: its time is the fit's extrapolation.",
        sections,
        rows=[c for cells in results.values() for c in cells],
    )


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
    unless --max-runs): for a machine with more cores than cells, to measure what the sequential
    run can only extrapolate."""
    names = tuple(sorted({name for name, _ in cells}))
    with multiprocessing.get_context("spawn").Pool(jobs, timer_initializer, (names,), maxtasksperchild=1) as pool:
        futures = [pool.apply_async(time_cell, ((n, b.samples, b.ranks, 0.0, max_runs),)) for n, b in cells]
        results = [f.get() for f in futures]
    rows = [Cell(n, b, Spread.of(t) if t and not e else None, None, e) for (n, b), (t, e) in zip(cells, results)]
    table_rows = [[c.scheduler, c.size.label, cell_text(c)] for c in rows]
    return write_report(
        out, "growth_cells", "Scheduler time of named cells, measured in parallel",
        f"Each cell in its own timing process with one torch thread, {jobs} cells at a time "
        "(`python -m bench.growth --cells ...`), on the same inputs as docs/bench/growth.md.",
        [("Results", markdown_table(["scheduler", "samples on ranks", "seconds per plan"], table_rows))],
        rows=rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--cap-seconds", type=float, default=CAP_S, help="skip cells the fit predicts above this")
    parser.add_argument("--min-seconds", type=float, default=MIN_S, help="scheduler time to collect per cell")
    parser.add_argument("--max-runs", type=int, default=MAX_RUNS, help="most runs per cell")
    parser.add_argument("--schedulers", default="", help="comma-separated subset (default: all available)")
    parser.add_argument("--cells", default="", help="measure only these, e.g. dynamic_cp:4096x512,hybrid_cp:64x8")
    parser.add_argument("--jobs", type=int, default=1, help="with --cells: cells measured at once")
    args = parser.parse_args(argv)
    if args.cells:
        print(run_cells(args.out, parse_cells(args.cells), args.jobs, args.max_runs).path.read_text())
        return
    kinds = tuple(SchedulerKind(s) for s in args.schedulers.split(",") if s) or None
    report = run(args.out, args.smoke, args.cap_seconds, args.min_seconds, args.max_runs, kinds)
    print(report.path.read_text())


if __name__ == "__main__":
    main()
