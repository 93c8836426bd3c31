"""Start-up: time from process start to health SERVING, and memory per planning worker.

    python -m bench.startup --out docs/bench
    python -m bench.startup --out docs/bench --beside ../main-checkout   # beside another tree's server

Starts `python -m planner_server --workers N` (tests.support.planner_process) several times, N = 1 and 2
in turn, and times from `Popen` to the `SERVING on port` log line, which the server prints after
the health service says SERVING (checked here with a gRPC health Check). The server warms every
worker (imports Megatron-Core, compiles the compiled exact path's kernels in the workers'
forkserver, plans once) before it reports SERVING. Each start runs twice in a row per run: with a
cold compile cache (`NUMBA_CACHE_DIR` a new empty folder: a pod's first start) and with the cache
the cold start wrote (a restart); with `--beside TREE`, a server of that checkout's code (e.g.
the previous main) starts right after them, so the three are measured side by side. Memory per process from
/proc: RSS, and PSS (RSS with shared pages divided among the processes sharing them: workers fork
from a forkserver that has Megatron-Core imported, so much of their RSS is shared).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import Report, Spread, argument_parser, markdown_table, pyplot, save_figure, write_report

RUNS = 2


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            values[key] = int(rest.split()[0]) / 1024
    return values["Rss"], values["Pss"]


@dataclass(frozen=True)
class Startup:
    workers: int
    seconds: float
    server: tuple[float, float]
    worker_memory: list[tuple[float, float]]
    arm: str = "this tree"  # which code and compile cache started


def start_once(workers: int, arm: str = "this tree", root: Path | None = None, cache_dir: str | None = None) -> Startup:
    from tests.support.planner_process import ROOT, start_planner

    started = time.perf_counter()
    server = start_planner(workers=workers, root=root or ROOT, extra_env={"NUMBA_CACHE_DIR": cache_dir} if cache_dir else None)
    seconds = time.perf_counter() - started
    try:
        with grpc.insecure_channel(server.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"server logged SERVING but health says {status}")
        # Workers are children of the forkserver, itself a child of the server; the server's
        # other child is multiprocessing's resource tracker, which has no children.
        worker_pids = [w for child in _children(server.proc.pid) for w in _children(child)]
        memory = [_memory_mib(pid) for pid in worker_pids]
        return Startup(workers, seconds, _memory_mib(server.proc.pid), memory, arm)
    finally:
        server.stop()


@dataclass(frozen=True)
class StartupRow:
    """The start-ups of one `--workers` setting."""

    workers: int
    arm: str
    runs: int
    seconds: Spread
    worker_counts: tuple[int, ...]  # worker processes found, per distinct count
    worker_rss_mib: Spread
    worker_pss_mib: Spread
    server_rss_mib: Spread

    @classmethod
    def of(cls, workers: int, arm: str, mine: list[Startup]) -> StartupRow:
        return cls(
            workers, arm, len(mine), Spread.of([r.seconds for r in mine]),
            tuple(sorted({len(r.worker_memory) for r in mine})),
            Spread.of([m[0] for r in mine for m in r.worker_memory]),
            Spread.of([m[1] for r in mine for m in r.worker_memory]),
            Spread.of([r.server[0] for r in mine]),
        )

    def cells(self) -> list[object]:
        return [self.workers, self.arm, self.runs, self.seconds.fmt(digits=1), ", ".join(map(str, self.worker_counts)),
                self.worker_rss_mib.fmt(digits=0), self.worker_pss_mib.fmt(digits=0), self.server_rss_mib.fmt(digits=0)]


COLD, WARM = "this tree, cold compile cache", "this tree, warm compile cache"


def start_arms(workers: int, beside: Path | None, warm: bool = True) -> list[Startup]:
    """One start of each arm, one after the other: cold cache, warm cache, the other tree."""
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        found = [start_once(workers, COLD, cache_dir=cache)]
        if warm:
            found.append(start_once(workers, WARM, cache_dir=cache))
    if beside is not None:
        found.append(start_once(workers, f"beside: {beside.name}", root=beside.resolve()))
    return found


def run(out: Path, smoke: bool = False, beside: Path | None = None) -> Report[StartupRow]:
    plan = [1] if smoke else [w for _ in range(RUNS) for w in (1, 2)]
    results = [r for w in plan for r in start_arms(w, beside, warm=not smoke)]
    arms = list(dict.fromkeys(r.arm for r in results))
    rows = [
        StartupRow.of(w, arm, mine)
        for w in sorted({r.workers for r in results}) for arm in arms
        if (mine := [r for r in results if r.workers == w and r.arm == arm])
    ]
    table = markdown_table(
        ["--workers", "code", "runs", "start to SERVING s p50 (min..max)", "worker processes found",
         "RSS per worker MiB p50 (min..max)", "PSS per worker MiB p50 (min..max)",
         "gRPC process RSS MiB p50 (min..max)"],
        [r.cells() for r in rows],
    )
    suffix = "_smoke" if smoke else ""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for workers in sorted({r.workers for r in results}):
        for arm in arms:
            ax.plot([r.seconds for r in results if r.workers == workers and r.arm == arm], marker="o", label=f"--workers {workers}, {arm}")
    ax.set_xlabel("start-up run")
    ax.set_ylabel("seconds to SERVING")
    ax.set_ylim(bottom=0)
    ax.legend()
    save_figure(fig, out / f"startup{suffix}.png")
    return write_report(
        out, f"startup{suffix}", "Start-up time and memory",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        [("Results", table + f"\n\n![start-up](startup{suffix}.png)")],
        rows=rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--beside", type=Path, default=None, help="another checkout whose server starts beside this tree's (e.g. main)")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.beside).path.read_text())


if __name__ == "__main__":
    main()
