"""Abandoned work: an honest client's latency with and without a client that sends
the largest requests with a 1 s deadline and walks away, side by side; then a SIGTERM drain under
that load, timed against --drain-seconds.

    python -m bench.abandon --out docs/bench/abandon.md
    python -m bench.abandon --baseline ../planner-base --out docs/bench   # abandon_vs_<commit>.md

One real planner (2 workers, --drain-seconds 5, --scheduler-implementation upstream) on loopback.
The honest client sends 11 requests of 2,048 samples on 128 ranks one after another (2 s deadline
each); the abandoning client keeps two requests of 16,384 samples on 1,024 ranks in flight, each
with a 1 s deadline. The server runs Megatron-Core's own code (hybrid CP: about 0.4 s for the
honest request, tens of seconds for the abandoned one), so that the abandoned plans are still running
at their deadline; with the exact path (the server's default) the large request is planned in well
under its 1 s and nothing is abandoned.

With `--baseline PATH` (a checkout of another commit of this repository) that checkout's server runs
too, with the same flags, and the report sets the two side by side with new / baseline, over 33
honest calls per server and row: alone, the calls alternate between the servers call by call;
beside the abandoning client, the two servers take 6 turns each (the abandoning client moves with
the honest one); the drains come last, one server after the other (one drain each).
"""

from __future__ import annotations

import argparse
import functools
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
from bench.common import machine_note
from bench.side_by_side import alternating, ratio, running
from bench.side_by_side import intro as side_by_side_intro
from bench.side_by_side import trees as side_by_side_trees

HONEST_CALLS = 11
DRAIN_SECONDS = 5.0
# A side-by-side run: the honest client's calls per server and row (11 calls leave new / baseline
# of p50 to within +-25% between two identical trees), and the turns each server takes beside the
# abandoning client.
SIDE_BY_SIDE_CALLS = 33
ROUNDS = 6
# Megatron-Core's own code: plans slow enough that the abandoning client's outlast its deadline.
SERVER_FLAGS = ("--drain-seconds", str(DRAIN_SECONDS), "--scheduler-implementation", "upstream")


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


def honest_calls(stub, seeds) -> list[tuple[str, float]]:
    return [call(stub, request(2048, 128, seed), timeout=2.0) for seed in seeds]


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


def codes_text(results: list[tuple[str, float]]) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(Counter(c for c, _ in results).items()))


def row(name: str, results: list[tuple[str, float]]) -> str:
    seconds = [s for _, s in results]
    return f"| {name} | {statistics.median(seconds) * 1e3:.0f} ms | {max(seconds) * 1e3:.0f} ms | {codes_text(results)} |"


def side_by_side_row(name: str, new: list[tuple[str, float]], base: list[tuple[str, float]]) -> str:
    n, b = ([s for _, s in results] for results in (new, base))
    p50s, maxes = (statistics.median(n), statistics.median(b)), (max(n), max(b))
    return (f"| {name} | {p50s[0] * 1e3:.0f} / {p50s[1] * 1e3:.0f} ms | {ratio(*p50s)} | "
            f"{maxes[0] * 1e3:.0f} / {maxes[1] * 1e3:.0f} ms | {ratio(*maxes)} | {codes_text(new)} | {codes_text(base)} |")


def drain(server) -> float:
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(120)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.abandon", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/abandon.md"),
                        help="the report's file, or a folder for abandon.md (abandon_vs_<commit>.md with --baseline)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit of this repository: its server "
                        "is measured side by side with this tree's")
    args = parser.parse_args(argv)
    trees = side_by_side_trees(args.baseline)
    arms = range(len(trees))
    seeds = list(range(HONEST_CALLS if len(trees) == 1 else SIDE_BY_SIDE_CALLS))
    alone: list[list[tuple[str, float]]] = [[] for _ in arms]
    beside: list[list[tuple[str, float]]] = [[] for _ in arms]
    abandoned = [Counter() for _ in arms]
    took = [0.0 for _ in arms]
    with running(trees, *SERVER_FLAGS, workers=2, stop_signal=signal.SIGKILL) as servers:
        channels = [grpc.insecure_channel(server.address) for server in servers]
        stubs = [planner_pb2_grpc.BatchPlannerStub(channel) for channel in channels]
        try:
            for seed in seeds:  # alone: call by call, alternating which server goes first
                for k in alternating(arms, seed):
                    alone[k] += honest_calls(stubs[k], [seed])
            # Beside the abandoning client: one round with one server; with two, each takes ROUNDS
            # turns of a few calls, the abandoning client on the same server as the honest one.
            rounds = 1 if len(trees) == 1 else ROUNDS
            for r in range(rounds):
                for k in alternating(arms, r):
                    results, codes = with_abandoners(stubs[k], functools.partial(honest_calls, stubs[k], seeds[r::rounds]))
                    beside[k] += results
                    abandoned[k] += codes
            for k in alternating(arms, rounds):
                took[k], _ = with_abandoners(stubs[k], functools.partial(drain, servers[k]))
        finally:
            for channel in channels:
                channel.close()
    if len(trees) == 1:
        lines = [
            "# Abandoned work: an honest client beside one that gives up",
            "",
            __doc__.split("\n\n")[2].replace("\n", " "),
            "",
            "| honest client | p50 | max | status codes |",
            "|---|---|---|---|",
            row("alone", alone[0]),
            row("beside the abandoning client", beside[0]),
            "",
            f"Abandoning client: {sum(abandoned[0].values())} requests "
            f"({', '.join(f'{c} {n}' for c, n in sorted(abandoned[0].items()))}).",
            f"SIGTERM drain under that load: {took[0]:.1f} s with --drain-seconds {DRAIN_SECONDS:.0f}.",
        ]
    else:
        lines = [
            f"# Abandoned work, side by side with {trees[1].commit}: an honest client beside one that gives up",
            "",
            __doc__.split("\n\n")[2].replace("\n", " "),
            "",
            __doc__.split("\n\n")[3].replace("\n", " "),
            "",
            side_by_side_intro(trees),
            "",
            machine_note(),
            "",
            "| honest client | p50 new / baseline | new/baseline p50 | max new / baseline | new/baseline max "
            "| status codes new | status codes baseline |",
            "|---|---|---|---|---|---|---|",
            side_by_side_row("alone", alone[0], alone[1]),
            side_by_side_row("beside the abandoning client", beside[0], beside[1]),
            "",
            f"{len(seeds)} calls per server and row (with fewer than 100, max is p99). Abandoning client: "
            + "; ".join(f"{tree.label} {sum(codes.values())} requests "
                        f"({', '.join(f'{c} {n}' for c, n in sorted(codes.items()))})"
                        for tree, codes in zip(trees, abandoned)) + ".",
            f"SIGTERM drain under that load, --drain-seconds {DRAIN_SECONDS:.0f}: new {took[0]:.1f} s, "
            f"baseline {took[1]:.1f} s (new/baseline {ratio(took[0], took[1])}).",
        ]
    out = args.out
    if out.suffix != ".md":
        out = out / ("abandon.md" if len(trees) == 1 else f"abandon_vs_{trees[1].commit}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
