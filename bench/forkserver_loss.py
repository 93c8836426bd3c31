"""A forkserver lost under load: plan latency after each kill, and what the requests were answered.

    python -m bench.forkserver_loss --out docs/bench

One planner (tests.support.planner_process) with 2 workers and nothing planned inline, so that every plan
runs on a worker; as many client threads as workers send plans back to back (dynamic CP, 512
samples on 64 ranks: milliseconds each). `--kills` times, the forkserver is SIGKILLed and so is
one worker, whose replacement needs the new forkserver; the next kill waits until the server's
batch_planner_worker_restarts_total{reason="died"} and batch_planner_live_workers say that
replacement, forked from the new forkserver once it has imported Megatron-Core, is planning (an
event, not a guessed pause). The latency of every plan sent from a kill until then is "after a
kill"; the others are "steady". The workers outlive their forkserver: they plan on, a new
forkserver is started at once beside them, and while one worker is being replaced the other plans,
so no plan waits for the new forkserver.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.common import Bar, Report, Spread, argument_parser, markdown_table, write_report
from batch_planner.convert import request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.request import PlanRequest, SchedulerKind

WORKERS = 2
BAR_SECONDS = 1.0  # p99 plan latency after a kill


@dataclass(frozen=True)
class Sample:
    sent: float  # monotonic
    seconds: float
    code: str


def _request(seed: int) -> bytes:
    lengths = tuple(sample_lengths("long_tail_16k", 512, seed))
    request = PlanRequest.of(lengths, 32, 2, 8192, scheduler=SchedulerKind.DYNAMIC_CP, job="bench")
    return request_to_proto(request).SerializeToString()


def _load(address: str, stop: threading.Event, samples: list[Sample], seed: int) -> None:
    from tests.support.reliability_support import raw_plan_method

    channel = grpc.insecure_channel(address)
    plan = raw_plan_method(channel)
    payloads = [_request(seed * 100 + i) for i in range(8)]
    i = 0
    while not stop.is_set():
        sent = time.monotonic()
        try:
            plan(payloads[i % len(payloads)], timeout=60)
            code = "OK"
        except grpc.RpcError as error:
            code = error.code().name
        samples.append(Sample(sent, time.monotonic() - sent, code))
        i += 1
    channel.close()


def _workers(server_pid: int) -> list[int]:
    """The server's planning workers, those of a forkserver that died included: the processes of
    its session (tests.support.planner_process starts it in its own) run from the forkserver's command
    line, less the forkserver itself."""
    from tests.support.reliability_support import _cmdline, _stat_fields, forkserver_pid

    forkserver = forkserver_pid(server_pid)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == forkserver:
            continue
        try:
            if int(_stat_fields(int(entry.name))[3]) == server_pid and "forkserver" in _cmdline(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def measure(kills: int) -> tuple[list[Sample], list[tuple[float, float]]]:
    """The samples, and each kill's window: (killed at, a worker forked from the new forkserver
    planning at)."""
    from tests.support.planner_process import start_planner
    from tests.support.reliability_support import forkserver_pid, metric, wait_until

    server = start_planner("--inline-max-samples", "0", workers=WORKERS)
    stop = threading.Event()
    samples: list[Sample] = []
    windows: list[tuple[float, float]] = []
    threads = [threading.Thread(target=_load, args=(server.address, stop, samples, s)) for s in range(WORKERS)]

    def live() -> float:
        return metric(server, "batch_planner_live_workers")

    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(samples) >= 20, 120, "the load running")
        for kill in range(kills):
            died = metric(server, "batch_planner_worker_restarts_total", reason="died")
            before = len(samples)
            worker = _workers(server.proc.pid)[0]
            killed = time.monotonic()
            os.kill(forkserver_pid(server.proc.pid), signal.SIGKILL)
            # A worker dies too while the new forkserver imports Megatron-Core: its replacement
            # needs that forkserver, and the other worker's plans must not wait for it.
            os.kill(worker, signal.SIGKILL)
            wait_until(lambda died=died: metric(server, "batch_planner_worker_restarts_total", reason="died") > died
                       and live() == WORKERS, 120, f"a worker forked from the new forkserver after kill {kill + 1}")
            windows.append((killed, time.monotonic()))
            wait_until(lambda before=before: len(samples) >= before + 20, 120, "steady plans after the new forkserver")
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        server.stop(signal.SIGKILL)
    return samples, windows


def run(out: Path, smoke: bool = False, kills: int = 10) -> Report:
    """Measures and writes out/forkserver_loss.md; a smoke run kills once."""
    kills = 1 if smoke else kills
    samples, windows = measure(kills)
    after = [s for s in samples if any(start <= s.sent <= end for start, end in windows)]
    steady = [s for s in samples if s not in after]
    rows = []
    for name, group in (("after a kill", after), ("steady", steady)):
        spread = Spread.of([s.seconds for s in group])
        codes = {c: sum(1 for s in group if s.code == c) for c in sorted({s.code for s in group})}
        rows.append([name, spread.runs, f"{spread.p50 * 1e3:.1f}", f"{spread.p99 * 1e3:.1f}", f"{spread.max * 1e3:.1f}",
                     ", ".join(f"{c} {n}" for c, n in codes.items())])
    windows_s = Spread.of([end - start for start, end in windows])
    p99_after = Spread.of([s.seconds for s in after]).p99
    bar = Bar("forkserver killed under load", f"p99 plan latency after a kill < {BAR_SECONDS:.0f} s, every answer OK",
              p99_after < BAR_SECONDS and all(s.code == "OK" for s in after))
    table = markdown_table(["plans", "count", "p50 ms", "p99 ms", "max ms", "answers"], rows)
    body = (f"{table}\n\n{kills} kills; a worker forked from the new forkserver planned {windows_s.fmt(1.0, 1)} s "
            "after a kill (p50 (min..max)): the window whose plans count as after a kill.")
    return write_report(out, "forkserver_loss", "A forkserver lost under load", __doc__.split("\n\n", 2)[2],
                        [("Plan latency", body), ("Bar", f"{bar.target}: {'met' if bar.met else 'NOT MET'}")],
                        rows=rows, bars=[bar])


def main(argv: list[str] | None = None) -> Report:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    args = parser.parse_args(argv)
    return run(args.out, args.smoke, args.kills)


if __name__ == "__main__":
    print(main().path.read_text())
