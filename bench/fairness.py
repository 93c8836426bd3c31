"""Fair admission per job: a quiet job's plan latency alone and beside a bursting job, side by side.

    python -m bench.fairness --out docs/bench

One real planner (2 workers unless `--workers` says otherwise, --max-queued-requests 6: a bound of
8 slots with 2 workers, --max-job-share 0.5: half of it per job) on loopback and two simulated training jobs. The quiet job ("quiet") plans 64 samples on 8
ranks (hybrid_cp) one request after another and records each latency. The bursting job ("burst",
a separate client process, as another job's trainers would be) keeps 32 concurrent requests of 4,096 samples on 256 ranks (hybrid_cp, about 2 s of scheduling
each) going, retrying RESOURCE_EXHAUSTED with exponential backoff (0.1 s doubling to 1 s, as a
client should). Phases alternate (alone, with the burst, alone, with the burst) so that both arms
see the same machine; a burst phase measures only once the burst holds its whole share, and the
next phase starts once its work has drained. A last arm restarts the server with --max-job-share
1.0 (no per-job bound) to show what the share prevents: the burst fills the bound and the quiet
job's plans are refused.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from bench.common import Bar, Report, Spread, argument_parser, job_metadata, markdown_table, percentile, verdict, write_report

WORKERS = 2
MAX_QUEUED = 6
SHARE = 0.5
BURST_CONCURRENCY = 32
BURST_SHAPE = (4096, 256)
QUIET_SHAPE = (64, 8)
BAR_RATIO = 1.5


def request(job: str, samples: int, ranks: int, seed: int) -> pb.PlanRequest:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=seed),
        layout=pb.ParallelLayout(data_parallel_size=ranks, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
        job=job,
    )


def job_metadata(job: str) -> tuple[tuple[str, str]]:
    """The job name as admission reads it (the trainer client sends it with every Plan call)."""
    return ((JOB_METADATA_KEY, job),)


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


def quiet_phase(stub, seconds: float) -> tuple[list[float], Counter]:
    latencies, codes, seed = [], Counter(), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seed += 1
        started = time.perf_counter()
        try:
            stub.Plan(request("quiet", *QUIET_SHAPE, seed), timeout=10, metadata=job_metadata("quiet"))
            codes["OK"] += 1
            latencies.append(time.perf_counter() - started)
        except grpc.RpcError as error:
            codes[error.code().name] += 1
    return latencies, codes


@dataclass(frozen=True)
class FairnessRow:
    arm: str
    latency: Spread | None
    quiet_codes: str
    burst_codes: str

    def cells(self) -> list[str]:
        s = self.latency
        if s is None:
            return [self.arm, "0", "-", "-", "-", self.quiet_codes, self.burst_codes]
        return [self.arm, str(s.runs), f"{s.p50 * 1e3:.1f}", f"{s.p99 * 1e3:.1f}", f"{s.max * 1e3:.1f}",
                self.quiet_codes, self.burst_codes]


def codes_text(codes: Counter) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(codes.items())) or "-"


def run(out: Path, smoke: bool = False, max_queued: int = MAX_QUEUED, workers: int = WORKERS) -> Report[FairnessRow]:
    from tests.planner_process import start_planner

    seconds, rounds = (1.5, 1) if smoke else (8.0, 2)
    concurrency = 8 if smoke else BURST_CONCURRENCY
    share_slots = max(1, int((workers + max_queued) * SHARE))
    alone, beside = [], []
    alone_codes, beside_codes, burst_codes = Counter(), Counter(), Counter()
    server = start_planner("--max-queued-requests", str(max_queued), "--max-job-share", str(SHARE), workers=workers)
    try:
        url = server.metrics_url
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            quiet_phase(stub, 0.5)  # the channel and the inline path warm
            for _ in range(rounds):
                latencies, codes = quiet_phase(stub, seconds)
                alone += latencies
                alone_codes += codes
                with Burst(server.address, concurrency) as burst:
                    wait_for(lambda: metric(url, "batch_planner_in_flight_requests") >= share_slots, 60,
                             "the burst to hold its share")
                    latencies, codes = quiet_phase(stub, seconds)
                    beside += latencies
                    beside_codes += codes
                burst_codes += burst.codes
                wait_for(lambda: metric(url, "batch_planner_in_flight_requests") == 0, 60, "the burst to drain")
            share_rejections = metric(url, "batch_planner_job_share_rejections_total")
    finally:
        server.stop(signal.SIGKILL)
    # The same burst with no per-job bound: it fills the server's bound, the quiet job is refused.
    off_codes, off_burst = Counter(), Counter()
    off_latencies: list[float] = []
    server = start_planner("--max-queued-requests", str(max_queued), "--max-job-share", "1.0", workers=workers)
    try:
        url = server.metrics_url
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            with Burst(server.address, concurrency) as burst:
                wait_for(lambda: metric(url, "batch_planner_in_flight_requests") >= workers + max_queued, 60,
                         "the burst to fill the bound")
                off_latencies, off_codes = quiet_phase(stub, min(seconds, 3.0))
            off_burst = burst.codes
    finally:
        server.stop(signal.SIGKILL)

    rows = (
        FairnessRow("quiet job alone", Spread.of(alone), codes_text(alone_codes), "-"),
        FairnessRow(f"quiet job beside the burst (--max-job-share {SHARE})", Spread.of(beside),
                    codes_text(beside_codes), codes_text(burst_codes)),
        FairnessRow("quiet job beside the burst (--max-job-share 1.0, no per-job bound)",
                    Spread.of(off_latencies) if off_latencies else None, codes_text(off_codes), codes_text(off_burst)),
    )
    ratio = percentile(beside, 99) / percentile(alone, 99)
    met = ratio <= BAR_RATIO and beside_codes.get("RESOURCE_EXHAUSTED", 0) == 0
    bars = (Bar("quiet job's p99 beside the bursting job / alone", f"<= {BAR_RATIO}x, no quiet request refused", met),)
    table = markdown_table(
        ["arm", "quiet plans", "p50 ms", "p99 ms", "max ms", "quiet job's status codes", "bursting job's status codes"],
        [r.cells() for r in rows],
    )
    result = (
        f"Quiet job's p99 beside the burst / alone: **{ratio:.2f}x** (bar <= {BAR_RATIO}x: {verdict(met)}). "
        f"The bursting job's requests refused for its share "
        f"(batch_planner_job_share_rejections_total{{training_job=\"burst\"}}): {share_rejections:.0f}."
    )
    suffix = (("_smoke" if smoke else "") + ("" if max_queued == MAX_QUEUED else f"_q{max_queued}")
              + ("" if workers == WORKERS else f"_w{workers}"))
    return write_report(
        out, f"fairness{suffix}", "Fair admission per job: a quiet job beside a bursting one",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        [(f"Results (--workers {workers}, --max-queued-requests {max_queued}: a bound of {workers + max_queued}, "
          f"{share_slots} per job)", table + "\n\n" + result)],
        rows=rows, bars=bars,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-queued", type=int, default=MAX_QUEUED, help="the server's --max-queued-requests")
    parser.add_argument("--workers", type=int, default=WORKERS, help="the server's planning workers")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.max_queued, args.workers).path.read_text())


if __name__ == "__main__":
    main()
