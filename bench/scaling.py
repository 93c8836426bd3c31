"""Scaling: plans per second with concurrent clients, server with 1 planning worker vs 2.

    python -m bench.scaling --out docs/bench

Two real servers run side by side (`--workers 1` and `--workers 2`; nothing is pinned) and
take turns: in each window, `clients` threads of this process send Plan requests back to back
(no client-side decoding) to one server for `window` seconds; windows alternate between the
servers, so both see the same background load. The ratio of each pair of adjacent windows is one
sample of the scaling. Bar: 2 workers / 1 worker >= 1.8x.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.convert import request_to_proto
from bench.common import (
    Bar,
    BatchSize,
    Report,
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

DISTRIBUTION, SIZE, SMOKE_SIZE = "lognormal_32k", BatchSize(1024, 64), BatchSize(64, 8)
CLIENTS, WINDOWS, WINDOW_S = 4, 4, 5.0


def plans_per_second(stub, requests, clients: int, seconds: float) -> float:
    counts = [0] * clients
    end = time.perf_counter() + seconds

    def client(index: int) -> None:
        i = index
        while time.perf_counter() < end:
            stub.Plan(requests[i % len(requests)], timeout=300)
            counts[index] += 1
            i += clients

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


BAR_RATIO, BAR = 1.8, ">= 1.8x"


@dataclass(frozen=True)
class Result:
    one: list[float]  # plans per second of each window, --workers 1
    two: list[float]  # the same, --workers 2

    @property
    def ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.one, self.two)]


@dataclass(frozen=True)
class ScalingRow:
    size: BatchSize
    clients: int
    windows: int
    seconds: float
    result: Result

    @property
    def met(self) -> bool:
        return Spread.of(self.result.ratios).p50 >= BAR_RATIO


def measure(address_1: str, address_2: str, size: BatchSize, clients: int, windows: int, seconds: float) -> Result:
    requests = [request_to_proto(make_request(DISTRIBUTION, size, seed=s)) for s in range(16)]
    ch1, stub1 = planner_stub(address_1)
    ch2, stub2 = planner_stub(address_2)
    with ch1, ch2:
        for stub in (stub1, stub2):  # warm every worker
            plans_per_second(stub, requests, clients, min(seconds, 1.0))
        one, two = [], []
        for w in range(windows):
            order = [(stub1, one), (stub2, two)] if w % 2 == 0 else [(stub2, two), (stub1, one)]
            for stub, sink in order:
                sink.append(plans_per_second(stub, requests, clients, seconds))
    return Result(one, two)


@dataclass(frozen=True)
class SweepRow:
    """Plans per second of one server with `workers` planning workers, `clients` = 2 x workers."""

    workers: int
    size: BatchSize
    windows: list[float]  # plans per second of each window

    @property
    def per_worker(self) -> float:
        return Spread.of(self.windows).p50 / self.workers


def worker_counts(cores: int) -> tuple[int, ...]:
    """1, 2 and N (this machine's cores), and the powers of two between."""
    counts = {1, 2, cores}
    counts.update(c for c in (4, 8, 16, 32, 64) if c < cores)
    return tuple(sorted(counts))


def sweep(size: BatchSize, counts: tuple[int, ...], windows: int, seconds: float) -> list[SweepRow]:
    """One server at a time (nothing else planning), each with its own worker count."""
    requests = [request_to_proto(make_request(DISTRIBUTION, size, seed=s)) for s in range(16)]
    rows = []
    for workers in counts:
        with planner_server(None, workers=workers) as address:
            channel, stub = planner_stub(address)
            with channel:
                plans_per_second(stub, requests, 2 * workers, min(seconds, 2.0))  # warm every worker
                values = [plans_per_second(stub, requests, 2 * workers, seconds) for _ in range(windows)]
        rows.append(SweepRow(workers, size, values))
    return rows


def sweep_table(rows: list[SweepRow]) -> str:
    base = Spread.of(rows[0].windows).p50 if rows else 1.0
    return markdown_table(
        ["batch", "workers", "clients", "plans/s p50 (min..max)", "per worker", "vs 1 worker"],
        [[r.size.label, r.workers, 2 * r.workers, Spread.of(r.windows).fmt(), f"{r.per_worker:.2f}",
          f"{Spread.of(r.windows).p50 / base:.2f}x"] for r in rows],
    )


def plot(result: Result, path: Path, size: BatchSize) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for values, label in ((result.one, "--workers 1"), (result.two, "--workers 2")):
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel("window (alternating, same background load)")
    ax.set_ylabel("plans per second")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Scaling: {size.label}, {DISTRIBUTION}; ratio p50 {Spread.of(result.ratios).p50:.2f}x")
    ax.legend()
    save_figure(fig, path)


def run(out: Path, smoke: bool = False, address_1: str | None = None, address_2: str | None = None) -> Report[ScalingRow]:
    size = SMOKE_SIZE if smoke else SIZE
    clients, windows, seconds = (2, 1, 0.5) if smoke else (CLIENTS, WINDOWS, WINDOW_S)
    with planner_server(address_1, workers=1) as a1, planner_server(address_2, workers=2) as a2:
        result = measure(a1, a2, size, clients, windows, seconds)
    row = ScalingRow(size, clients, windows, seconds, result)
    one, two, ratio = Spread.of(result.one), Spread.of(result.two), Spread.of(result.ratios)
    suffix = "_smoke" if smoke else ""
    table = markdown_table(
        ["batch", "clients", "windows x seconds", "--workers 1 plans/s p50 (min..max)",
         "--workers 2 plans/s p50 (min..max)", "ratio p50 (min..max)", "bar", "verdict"],
        [[size.label, clients, f"{windows} x {seconds:g}", one.fmt(), two.fmt(), ratio.fmt() + "x",
          BAR, verdict(row.met)]],
    )
    plot(result, out / f"scaling{suffix}.png", size)
    return write_report(
        out, f"scaling{suffix}", "Scaling with planning workers",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nBatch: {size.label} ranks, `{DISTRIBUTION}`, hybrid CP, 16 different seeds in turn.",
        [("Results", table + f"\n\n![scaling](scaling{suffix}.png)")],
        rows=[row],
        bars=[Bar(size.label, BAR, row.met)],
    )


def run_sweep(out: Path, counts: tuple[int, ...], samples: int, ranks: int, windows: int, seconds: float) -> Report[SweepRow]:
    """Plans per second with 1, 2 ... N workers, one server at a time (`--sweep`)."""
    rows = sweep(BatchSize(samples, ranks), counts, windows, seconds)
    return write_report(
        out, "scaling_sweep", "Plans per second by planning workers",
        "One server at a time with 1, 2 ... N planning workers (N: this machine's cores); 2 x workers "
        "client threads of this process send Plan requests back to back (hybrid CP, "
        f"`{DISTRIBUTION}`, 16 seeds in turn) for {windows} windows of {seconds:g} s each.",
        [("Results", sweep_table(rows))],
        rows=rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--sweep", default="", help="worker counts to sweep one server at a time, e.g. 1,2,4 or 'auto'")
    parser.add_argument("--sweep-size", default="1024x64", help="samples x ranks of the sweep's batches")
    parser.add_argument("--address-1", help="a running planner with --workers 1 (else one is started)")
    parser.add_argument("--address-2", help="a running planner with --workers 2 (else one is started)")
    args = parser.parse_args(argv)
    if args.sweep:
        import os

        counts = worker_counts(os.cpu_count() or 1) if args.sweep == "auto" else tuple(int(c) for c in args.sweep.split(","))
        samples, ranks = (int(v) for v in args.sweep_size.split("x"))
        windows, seconds = (1, 0.5) if args.smoke else (WINDOWS, WINDOW_S)
        print(run_sweep(args.out, counts, samples, ranks, windows, seconds).path.read_text())
        return
    print(run(args.out, args.smoke, args.address_1, args.address_2).path.read_text())


if __name__ == "__main__":
    main()
