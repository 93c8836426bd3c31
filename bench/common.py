"""What every benchmark shares: the batch sizes, request construction, spread statistics and the
markdown/plot writers. Benchmarks report ratios measured side by side in one run, with the spread."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Generic, Iterable, Sequence, TypeVar

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.request import PlanRequest, SchedulerKind
from bench.bare_grpc import CHANNEL_OPTIONS

DISTRIBUTION_NAMES: tuple[str, ...] = tuple(DISTRIBUTIONS)


@dataclass(frozen=True)
class BatchSize:
    samples: int
    ranks: int  # DPxCP ranks

    @property
    def label(self) -> str:
        return f"{self.samples:,} on {self.ranks}"


# The batch sizes every size-dependent benchmark covers: 64 samples on 8 ranks ... 4,096 on 256.
SIZES: tuple[BatchSize, ...] = (BatchSize(64, 8), BatchSize(256, 32), BatchSize(1024, 64), BatchSize(4096, 256))
SMOKE_SIZES: tuple[BatchSize, ...] = (BatchSize(64, 8),)

# Per-rank token budget of every benchmark request: the longest sample of any distribution
# (bimodal, ~40K) fits on 8 ranks, and samples above it get a CP group.
MAX_SEQLEN_PER_DP_CP_RANK = 8192
JOB_CP_SIZE = 2  # the job's configured (static) CP size; hybrid CP only looks at DPxCP


def make_request(
    distribution: str,
    size: BatchSize,
    seed: int = 0,
    cp: int = JOB_CP_SIZE,
    scheduler: SchedulerKind = SchedulerKind.HYBRID_CP,
) -> PlanRequest:
    return PlanRequest.of(
        sequence_lengths=tuple(sample_lengths(distribution, size.samples, seed)),
        data_parallel_size=size.ranks // cp,
        context_parallel_size=cp,
        max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_DP_CP_RANK,
        scheduler=scheduler,
        job="bench",
    )


def job_metadata(job: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata a Plan call carries for its job (the server admits by it), as the trainer
    client sends it."""
    return ((JOB_METADATA_KEY, job),) if job else None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); with few runs p99 is the maximum, as it should be."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class Spread:
    runs: int
    min: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(len(values), min(values), statistics.median(values), percentile(values, 99), max(values))

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        """'p50 (min..max)', scaled (e.g. 1e3 for ms)."""
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.p50 * scale)} ({f.format(self.min * scale)}..{f.format(self.max * scale)})"


def verdict(ok: bool) -> str:
    return "met" if ok else "**NOT MET**"


@dataclass(frozen=True)
class Bar:
    """A benchmark's target for one case, and whether the run met it."""

    case: str
    target: str
    met: bool


RowT = TypeVar("RowT")


@dataclass(frozen=True)
class Report(Generic[RowT]):
    """What a benchmark run returns: the markdown it wrote, its typed rows and its bars."""

    path: Path
    title: str
    rows: tuple[RowT, ...]
    bars: tuple[Bar, ...] = ()


def bars_path(report_path: Path) -> Path:
    """Where a report's bars are stored as data, next to its markdown (the summary reads them)."""
    return report_path.with_suffix(".bars.json")


def read_bars(report_path: Path) -> tuple[str, tuple[Bar, ...]]:
    data = json.loads(bars_path(report_path).read_text())
    return data["title"], tuple(Bar(**bar) for bar in data["bars"])


def machine_note() -> str:
    load = os.getloadavg()
    return (
        f"Measured {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.machine()} Linux, "
        f"{os.cpu_count()} CPU cores, Python {platform.python_version()}; load average at start "
        f"{load[0]:.2f}. The machine is shared with other engineers' builds and tests while these run, "
        "so absolute times are noisy: the figures that matter are ratios of runs measured side by side "
        "(interleaved) in the same process."
    )


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(h.replace("|", "\\|") for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [str(c).replace("|", "\\|").replace("\n", " ") for c in row]
        if len(cells) != len(header):
            raise ValueError(f"row has {len(cells)} cells, header has {len(header)}: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(
    out: Path, name: str, title: str, intro: str, sections: Sequence[tuple[str, str]],
    rows: Sequence[RowT], bars: Sequence[Bar] = (),
) -> Report[RowT]:
    """Writes `out/name.md` (a title, what was measured and how, then (heading, body) sections) and,
    for a benchmark with bars, `out/name.bars.json`: the bars as data, for the summary."""
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", "", intro, "", machine_note(), ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    path = out / f"{name}.md"
    path.write_text("\n".join(parts))
    if bars:
        bars_path(path).write_text(json.dumps({"title": title, "bars": [asdict(b) for b in bars]}, indent=1) + "\n")
    else:
        bars_path(path).unlink(missing_ok=True)
    return Report(path, title, tuple(rows), tuple(bars))


def argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("docs/bench"), help="where the table and plots go")
    parser.add_argument("--smoke", action="store_true", help="a tiny run that only checks the benchmark works")
    return parser


def pyplot():
    """matplotlib without a display (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["savefig.dpi"] = 110
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def planner_server(address: str | None, workers: int, args: Sequence[str] = ()):
    """Yields the address of a real planner server: `address` if given, else a fresh subprocess
    (tests.support.planner_process, `--workers workers` and `args`) stopped on exit."""
    if address:
        yield address
        return
    from tests.support.planner_process import start_planner

    server = start_planner(*args, workers=workers)
    try:
        yield server.address
    finally:
        server.stop()


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


def planner_stub(address: str):
    import grpc

    from batch_planner.v1 import planner_pb2_grpc

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return channel, planner_pb2_grpc.BatchPlannerStub(channel)
