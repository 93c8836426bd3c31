"""Load benchmark: many concurrent clients against one real planner for a bounded time.

    python -m bench.load --duration 60 --clients 32 --workers 2 --out bench/results/load.md

Starts a planner on loopback (or uses --address), then each client thread sends Plan requests
from a fixed mix (long-tail batches from 64 samples on 8 ranks to 2048 samples on 128 ranks, and
one entry in eleven deliberately invalid) until the time is up. Reports requests, status codes,
throughput, latency percentiles and the resident memory of the server with its forkserver and
workers, sampled every second: after warm-up and at the end, so a leak shows as growth.

Expected answers: OK for the valid requests, INVALID_ARGUMENT for the invalid ones, and
RESOURCE_EXHAUSTED only when more clients than workers + --max-queued-requests are configured.
Anything else is an unexpected error.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from bench.common import job_metadata

# (samples, DPxCP ranks): from a small job's step to a large one's.
VALID_SHAPES = [(64, 8), (256, 16), (512, 32), (1024, 64), (2048, 128)]


@dataclass(frozen=True)
class MixEntry:
    request: pb.PlanRequest
    expected: str  # the status code name this request must get


def request_mix(seed: int = 0, max_samples: int = 2048) -> list[MixEntry]:
    """A fixed list of requests; clients draw from it (two valid per shape, one invalid)."""
    entries: list[MixEntry] = []
    shapes = [(samples, ranks) for samples, ranks in VALID_SHAPES if samples <= max_samples]
    for i, (samples, ranks) in enumerate(shapes * 2):
        lengths = sample_lengths("long_tail_16k" if i % 2 == 0 else "megatron_dcp", samples, seed + i)
        request = pb.PlanRequest(
            sequence_lengths=lengths,
            layout=pb.ParallelLayout(data_parallel_size=ranks // 2, context_parallel_size=2),
            max_seqlen_per_dp_cp_rank=8192,
            scheduler=pb.SCHEDULER_HYBRID_CP,
            job=f"load-{i % 3}",
        )
        entries.append(MixEntry(request, "OK"))
    invalid = pb.PlanRequest(
        sequence_lengths=[4096, 0, 1024],  # a zero-length sample
        layout=pb.ParallelLayout(data_parallel_size=4, context_parallel_size=2),
        max_seqlen_per_dp_cp_rank=4096,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )
    return entries + [MixEntry(invalid, "INVALID_ARGUMENT")]


@dataclass
class LoadResult:
    duration_s: float
    clients: int
    latencies_s: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    warm_up_s: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def rss_after_warm_up(self) -> int:
        after = [rss for t, rss in self.rss_samples if t >= self.warm_up_s]
        return after[0] if after else 0

    def rss_at_end(self) -> int:
        return self.rss_samples[-1][1] if self.rss_samples else 0

    def rss_max(self) -> int:
        return max((rss for _, rss in self.rss_samples), default=0)

    def table(self) -> str:
        mib = 1024 * 1024
        ok = self.codes.get("OK", 0)
        rows = [
            ("duration", f"{self.duration_s:.1f} s"),
            ("concurrent clients", str(self.clients)),
            ("requests", str(self.requests)),
            ("status codes", ", ".join(f"{k} {v}" for k, v in sorted(self.codes.items()))),
            ("unexpected errors", str(len(self.unexpected))),
            ("plans per second", f"{ok / self.duration_s:.1f}"),
            ("latency p50 / p90 / p99 / max", " / ".join(
                f"{self.percentile(q) * 1000:.0f} ms" for q in (50, 90, 99, 100))),
            ("mean latency", f"{statistics.fmean(self.latencies_s) * 1000:.0f} ms" if self.latencies_s else "-"),
            ("server RSS after warm-up / end / max", " / ".join(
                f"{v / mib:.0f} MiB" for v in (self.rss_after_warm_up(), self.rss_at_end(), self.rss_max()))),
        ]
        lines = ["| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines)


def run_load(
    address: str,
    server_pid: int | None,
    duration_s: float,
    clients: int,
    warm_up_s: float | None = None,
    deadline_s: float = 60.0,
    seed: int = 0,
    max_samples: int = 2048,
) -> LoadResult:
    """Runs `clients` threads for `duration_s` against `address`; each waits for its answer."""
    from tests.support.reliability_support import tree_rss_bytes  # /proc reading shared with the tests

    mix = request_mix(seed, max_samples)
    result = LoadResult(duration_s, clients, warm_up_s=duration_s / 6 if warm_up_s is None else warm_up_s)
    lock = threading.Lock()
    started = time.monotonic()
    stop_at = started + duration_s

    def client(index: int) -> None:
        rng = random.Random(f"{seed}:{index}")
        with grpc.insecure_channel(address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            while time.monotonic() < stop_at:
                entry = rng.choice(mix)
                begin = time.perf_counter()
                try:
                    stub.Plan(entry.request, timeout=deadline_s, metadata=job_metadata(entry.request.job))
                    code, details = "OK", ""
                except grpc.RpcError as error:
                    code, details = error.code().name, error.details() or ""
                seconds = time.perf_counter() - begin
                with lock:
                    result.codes[code] = result.codes.get(code, 0) + 1
                    if code == entry.expected:
                        result.latencies_s.append(seconds)
                    elif code != "RESOURCE_EXHAUSTED":
                        result.unexpected.append(f"{code}: {details[:200]} (expected {entry.expected})")

    def sample_memory() -> None:
        while time.monotonic() < stop_at:
            if server_pid is not None:
                result.rss_samples.append((time.monotonic() - started, tree_rss_bytes(server_pid)))
            time.sleep(1.0)
        if server_pid is not None:
            result.rss_samples.append((time.monotonic() - started, tree_rss_bytes(server_pid)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    threads.append(threading.Thread(target=sample_memory, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + deadline_s + 30)
    result.duration_s = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="planning workers of the started server")
    parser.add_argument("--max-queued-requests", type=int, default=64)
    parser.add_argument("--address", help="use a running planner (host:port) instead of starting one")
    parser.add_argument("--out", type=Path, help="also write the results table (markdown) here")
    args = parser.parse_args(argv)

    server = None
    if args.address:
        address, pid = args.address, None
    else:
        from tests.support.planner_process import start_planner

        server = start_planner("--max-queued-requests", str(args.max_queued_requests), workers=args.workers)
        address, pid = server.address, server.proc.pid
    try:
        result = run_load(address, pid, args.duration, args.clients)
    finally:
        if server is not None:
            server.stop()
    table = result.table()
    header = (f"Load: {args.clients} clients, {args.duration:.0f} s, "
              f"{args.workers if server else '?'} planning workers, on this machine ({_cores()} cores).")
    print(header + "\n\n" + table)
    for line in result.unexpected[:20]:
        print("unexpected:", line, file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header + "\n\n" + table + "\n")
    return 1 if result.unexpected else 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
