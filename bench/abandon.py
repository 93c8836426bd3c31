"""Abandoned work: an honest client's latency with and without a client that sends
the largest requests with a 1 s deadline and walks away, side by side; then a SIGTERM drain under
that load, timed against --drain-seconds.

    python -m bench.abandon --out docs/bench/abandon.md

One real planner (2 workers, --drain-seconds 5) on loopback. The honest client sends 11 requests
of 2,048 samples on 128 ranks one after another (2 s deadline each); the abandoning client keeps
two requests of 16,384 samples on 1,024 ranks in flight, each with a 1 s deadline.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc

HONEST_CALLS = 11
DRAIN_SECONDS = 5.0


def request(samples: int, ranks: int, seed: int) -> pb.PlanRequest:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=seed),
        layout=pb.ParallelLayout(data_parallel_size=ranks, context_parallel_size=1),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )


def call(stub, message, timeout: float) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        stub.Plan(message, timeout=timeout)
        return "OK", time.perf_counter() - started
    except grpc.RpcError as error:
        return error.code().name, time.perf_counter() - started


def honest_run(stub) -> list[tuple[str, float]]:
    return [call(stub, request(2048, 128, seed), timeout=2.0) for seed in range(HONEST_CALLS)]


def abandon(stub, stop: threading.Event, codes: Counter) -> None:
    seed = 0
    while not stop.is_set():
        seed += 1
        codes[call(stub, request(16384, 1024, seed), timeout=1.0)[0]] += 1


def with_abandoners(stub, work):
    stop, codes = threading.Event(), Counter()
    threads = [threading.Thread(target=abandon, args=(stub, stop, codes)) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        return work(), codes
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def row(name: str, results: list[tuple[str, float]]) -> str:
    seconds = [s for _, s in results]
    codes = ", ".join(f"{c} {n}" for c, n in sorted(Counter(c for c, _ in results).items()))
    return (f"| {name} | {statistics.median(seconds) * 1e3:.0f} ms | {max(seconds) * 1e3:.0f} ms | {codes} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.abandon", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/abandon.md"))
    args = parser.parse_args(argv)
    from tests.planner_process import start_planner

    server = start_planner("--drain-seconds", str(DRAIN_SECONDS), workers=2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            alone = honest_run(stub)
            beside, abandoned = with_abandoners(stub, lambda: honest_run(stub))

            def drain() -> float:
                started = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                server.proc.wait(120)
                return time.monotonic() - started

            took, _ = with_abandoners(stub, drain)
    finally:
        server.stop(signal.SIGKILL)
    lines = [
        "# Abandoned work: an honest client beside one that gives up",
        "",
        __doc__.split("\n\n")[2].replace("\n", " "),
        "",
        "| honest client | p50 | max | status codes |",
        "|---|---|---|---|",
        row("alone", alone),
        row("beside the abandoning client", beside),
        "",
        f"Abandoning client: {sum(abandoned.values())} requests "
        f"({', '.join(f'{c} {n}' for c, n in sorted(abandoned.items()))}).",
        f"SIGTERM drain under that load: {took:.1f} s with --drain-seconds {DRAIN_SECONDS:.0f}.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
