"""Fair admission per job: a quiet job's plan latency alone and beside a bursting job, side by side.

    python -m bench.fairness --out docs/bench

One real planner (2 workers unless `--workers` says otherwise, --max-queued-requests 6: a bound of
8 slots with 2 workers, --max-job-share 0.5: half of it per job) on loopback and two simulated training jobs. The quiet job ("quiet") plans 64 samples on 8
ranks (hybrid_cp) one request after another and records each latency. The bursting job ("burst",
a separate client process, as another job's trainers would be) keeps 32 concurrent requests of 4,096 samples on 256 ranks (hybrid_cp: tens of ms each on the
exact path, the server's default; about 2 s with Megatron-Core's own code, which the results before
the exact path ran) going, retrying RESOURCE_EXHAUSTED with exponential backoff (0.1 s doubling to 1 s, as a
client should). Phases alternate (alone, with the burst, alone, with the burst) so that both arms
see the same machine; a burst phase measures only once the burst holds its whole share, and the
next phase starts once its work has drained. A last arm restarts the server with --max-job-share
1.0 (no per-job bound) to show what the share prevents: the burst fills the bound and the quiet
job's plans are refused. Both jobs send their job name in the request metadata (`batch-planner-job`)
as well as in the message.

With `--baseline PATH` (a checkout of another commit of this repository) that checkout's servers
run too, with the same flags, and the report sets the two side by side with new / baseline, over 4
rounds instead of 2: alone, the quiet job's requests alternate between the servers call by call
(each phase twice as long); the burst phases take turns, one server at a time, the first server
alternating round by round.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from bench.common import Bar, Report, Spread, argument_parser, job_metadata, markdown_table, percentile, verdict, write_report
from bench.side_by_side import alternating, running, spread_ratios
from bench.side_by_side import intro as side_by_side_intro
from bench.side_by_side import trees as side_by_side_trees

WORKERS = 2
MAX_QUEUED = 6
SHARE = 0.5
BURST_CONCURRENCY = 32
BURST_SHAPE = (4096, 256)
QUIET_SHAPE = (64, 8)
BAR_RATIO = 1.5
# Rounds (alone, then each server beside the burst) in a side-by-side run: with 2, new / baseline of
# the quiet job's p50 and p99 beside the burst moved 0.89..1.19 between two identical trees.
SIDE_BY_SIDE_ROUNDS = 4


def request(job: str, samples: int, ranks: int, seed: int) -> pb.PlanRequest:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=seed),
        layout=pb.ParallelLayout(data_parallel_size=ranks, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
        job=job,
    )


def metric(url: str, name: str) -> float:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == name)


def wait_for(check, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _burst_client(address: str, concurrency: int, stop, results) -> None:
    """The bursting job, in its own process (its own GIL, as another job's trainers would be):
    `concurrency` client threads, each one request at a time."""
    codes, lock = Counter(), threading.Lock()
    messages = [request("burst", *BURST_SHAPE, seed) for seed in range(8)]

    def client(k: int) -> None:
        rng, backoff = random.Random(k), 0.1
        while not stop.is_set():
            try:
                stub.Plan(messages[k % len(messages)], timeout=60, metadata=job_metadata("burst"))
                code, backoff = "OK", 0.1
            except grpc.RpcError as error:
                code = error.code().name
            with lock:
                codes[code] += 1
            if code != "OK":
                stop.wait(backoff * rng.uniform(0.5, 1.0))
                backoff = min(1.0, backoff * 2)

    with grpc.insecure_channel(address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    results.put(dict(codes))


class Burst:
    """The bursting job's process, running while the `with` block runs; `codes` after it."""

    def __init__(self, address: str, concurrency: int):
        context = multiprocessing.get_context("spawn")
        self.stop, self._results, self.codes = context.Event(), context.Queue(), Counter()
        self._process = context.Process(target=_burst_client, args=(address, concurrency, self.stop, self._results))

    def __enter__(self):
        self._process.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.codes = Counter(self._results.get(timeout=120))
        self._process.join(30)


def quiet_phase(stubs: list, seconds: float) -> tuple[list[list[float]], list[Counter]]:
    """The quiet job's requests one after another for `seconds`; with several servers each request
    (a fresh seed) goes to every one of them in turn, the first alternating. Latencies and status
    codes per server."""
    latencies: list[list[float]] = [[] for _ in stubs]
    codes = [Counter() for _ in stubs]
    seed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seed += 1
        message = request("quiet", *QUIET_SHAPE, seed)
        for k in alternating(range(len(stubs)), seed):
            started = time.perf_counter()
            try:
                stubs[k].Plan(message, timeout=10, metadata=job_metadata("quiet"))
                codes[k]["OK"] += 1
                latencies[k].append(time.perf_counter() - started)
            except grpc.RpcError as error:
                codes[k][error.code().name] += 1
    return latencies, codes


@dataclass(frozen=True)
class FairnessRow:
    arm: str
    latency: Spread | None
    quiet_codes: str
    burst_codes: str
    tree: str = "new"  # "baseline" for the baseline checkout's rows in a side-by-side run

    def cells(self) -> list[str]:
        s = self.latency
        if s is None:
            return [self.arm, "0", "-", "-", "-", self.quiet_codes, self.burst_codes]
        return [self.arm, str(s.runs), f"{s.p50 * 1e3:.1f}", f"{s.p99 * 1e3:.1f}", f"{s.max * 1e3:.1f}",
                self.quiet_codes, self.burst_codes]


def codes_text(codes: Counter) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(codes.items())) or "-"


@dataclass
class TreeRun:
    """What one tree's servers gave in a run."""

    alone: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    alone_codes: Counter = field(default_factory=Counter)
    beside_codes: Counter = field(default_factory=Counter)
    burst_codes: Counter = field(default_factory=Counter)
    off_codes: Counter = field(default_factory=Counter)
    off_burst: Counter = field(default_factory=Counter)
    share_rejections: float = 0.0

    def rows(self, tree: str) -> tuple[FairnessRow, ...]:
        return (
            FairnessRow("quiet job alone", Spread.of(self.alone), codes_text(self.alone_codes), "-", tree),
            FairnessRow(f"quiet job beside the burst (--max-job-share {SHARE})", Spread.of(self.beside),
                        codes_text(self.beside_codes), codes_text(self.burst_codes), tree),
            FairnessRow("quiet job beside the burst (--max-job-share 1.0, no per-job bound)",
                        Spread.of(self.off) if self.off else None, codes_text(self.off_codes),
                        codes_text(self.off_burst), tree),
        )

    @property
    def ratio(self) -> float:
        return percentile(self.beside, 99) / percentile(self.alone, 99)

    @property
    def met(self) -> bool:
        return self.ratio <= BAR_RATIO and self.beside_codes.get("RESOURCE_EXHAUSTED", 0) == 0


def burst_phase(server, stub, concurrency: int, until, what: str, seconds: float) -> tuple[list[float], Counter, Counter]:
    """The quiet job on `server` while the burst runs against it, measured once `until(server)`:
    the quiet job's latencies and codes, then the burst's codes."""
    with Burst(server.address, concurrency) as burst:
        wait_for(lambda: until(server), 60, what)
        latencies, codes = quiet_phase([stub], seconds)
    return latencies[0], codes[0], burst.codes


def run(
    out: Path, smoke: bool = False, max_queued: int = MAX_QUEUED, workers: int = WORKERS, baseline: Path | None = None,
) -> Report[FairnessRow]:
    trees = side_by_side_trees(baseline)
    seconds, rounds = (1.5, 1) if smoke else (8.0, 2 if len(trees) == 1 else SIDE_BY_SIDE_ROUNDS)
    concurrency = 8 if smoke else BURST_CONCURRENCY
    share_slots = max(1, int((workers + max_queued) * SHARE))
    arms = range(len(trees))
    runs = [TreeRun() for _ in trees]

    def in_flight(server) -> float:
        return metric(server.metrics_url, "batch_planner_in_flight_requests")

    flags = ("--max-queued-requests", str(max_queued))
    with running(trees, *flags, "--max-job-share", str(SHARE), workers=workers, stop_signal=signal.SIGKILL) as servers:
        with contextlib.ExitStack() as channels:
            stubs = [planner_pb2_grpc.BatchPlannerStub(channels.enter_context(grpc.insecure_channel(server.address)))
                     for server in servers]
            quiet_phase(stubs, 0.5)  # the channels and the inline path warm
            for r in range(rounds):
                latencies, codes = quiet_phase(stubs, seconds * len(stubs))
                for k in arms:
                    runs[k].alone += latencies[k]
                    runs[k].alone_codes += codes[k]
                for k in alternating(arms, r):
                    beside, codes_k, burst = burst_phase(servers[k], stubs[k], concurrency,
                                                         lambda server: in_flight(server) >= share_slots,
                                                         "the burst to hold its share", seconds)
                    runs[k].beside += beside
                    runs[k].beside_codes += codes_k
                    runs[k].burst_codes += burst
                    wait_for(lambda server=servers[k]: in_flight(server) == 0, 60, "the burst to drain")
        for k in arms:
            runs[k].share_rejections = metric(servers[k].metrics_url, "batch_planner_job_share_rejections_total")
    # The same burst with no per-job bound: it fills the server's bound, the quiet job is refused.
    with running(trees, *flags, "--max-job-share", "1.0", workers=workers, stop_signal=signal.SIGKILL) as servers:
        for k in alternating(arms, rounds):
            with grpc.insecure_channel(servers[k].address) as channel:
                off, runs[k].off_codes, runs[k].off_burst = burst_phase(
                    servers[k], planner_pb2_grpc.BatchPlannerStub(channel), concurrency,
                    lambda server: in_flight(server) >= workers + max_queued, "the burst to fill the bound",
                    min(seconds, 3.0))
                runs[k].off = off

    new = runs[0]
    rows = tuple(row for tree, tree_run in zip(trees, runs) for row in tree_run.rows(tree.label))
    bars = (Bar("quiet job's p99 beside the bursting job / alone", f"<= {BAR_RATIO}x, no quiet request refused", new.met),)
    suffix = (("_smoke" if smoke else "") + ("" if max_queued == MAX_QUEUED else f"_q{max_queued}")
              + ("" if workers == WORKERS else f"_w{workers}"))
    heading = (f"(--workers {workers}, --max-queued-requests {max_queued}: a bound of {workers + max_queued}, "
               f"{share_slots} per job)")
    intro = (__doc__ or "").split("\n\n", 2)[2].strip()
    if len(trees) == 1:
        table = markdown_table(
            ["arm", "quiet plans", "p50 ms", "p99 ms", "max ms", "quiet job's status codes", "bursting job's status codes"],
            [r.cells() for r in rows],
        )
        result = (
            f"Quiet job's p99 beside the burst / alone: **{new.ratio:.2f}x** (bar <= {BAR_RATIO}x: {verdict(new.met)}). "
            f"The bursting job's requests refused for its share "
            f"(batch_planner_job_share_rejections_total{{training_job=\"burst\"}}): {new.share_rejections:.0f}."
        )
        name, sections = f"fairness{suffix}", [(f"Results {heading}", table + "\n\n" + result)]
    else:
        table = side_by_side_table(rows[:3], rows[3:])
        base = runs[1]
        result = (
            f"Quiet job's p99 beside the burst / alone (bar <= {BAR_RATIO}x, no quiet request refused): "
            f"new **{new.ratio:.2f}x** ({verdict(new.met)}), baseline **{base.ratio:.2f}x** ({verdict(base.met)}). "
            f"The bursting job's requests refused for its share "
            f"(batch_planner_job_share_rejections_total{{training_job=\"burst\"}}): new {new.share_rejections:.0f}, "
            f"baseline {base.share_rejections:.0f}."
        )
        intro += "\n\n" + side_by_side_intro(trees)
        name, sections = f"fairness_vs_{trees[1].commit}{suffix}", [(f"New and baseline side by side {heading}",
                                                                     table + "\n\n" + result)]
    return write_report(out, name, "Fair admission per job: a quiet job beside a bursting one", intro, sections,
                        rows=rows, bars=bars)


def side_by_side_table(new: tuple[FairnessRow, ...], base: tuple[FairnessRow, ...]) -> str:
    def pair(n: Spread | None, b: Spread | None, stat: str) -> str:
        return " / ".join("-" if s is None else f"{getattr(s, stat) * 1e3:.1f}" for s in (n, b))

    rows = []
    for n, b in zip(new, base):
        p50, p99 = spread_ratios(n.latency, b.latency) if n.latency and b.latency else ("-", "-")
        rows.append([
            n.arm, " / ".join(str(0 if r.latency is None else r.latency.runs) for r in (n, b)),
            pair(n.latency, b.latency, "p50"), p50, pair(n.latency, b.latency, "p99"), p99,
            pair(n.latency, b.latency, "max"), f"{n.quiet_codes} / {b.quiet_codes}", f"{n.burst_codes} / {b.burst_codes}",
        ])
    return markdown_table(
        ["arm", "quiet plans new / baseline", "p50 ms new / baseline", "new/baseline p50", "p99 ms new / baseline",
         "new/baseline p99", "max ms new / baseline", "quiet job's status codes new / baseline",
         "bursting job's status codes new / baseline"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-queued", type=int, default=MAX_QUEUED, help="the server's --max-queued-requests")
    parser.add_argument("--workers", type=int, default=WORKERS, help="the server's planning workers")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit of this repository: its servers "
                        "are measured side by side with this tree's")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.max_queued, args.workers, args.baseline).path.read_text())


if __name__ == "__main__":
    main()
