"""Our process pool beside pebble's ProcessPool, interleaved in one run: the per-task overhead and
what an abandoned task costs (docs/design.md, "Why our own process pool").

    python -m bench.pool_choice --out docs/bench

One worker in each pool, both forked from the same forkserver with Megatron-Core preloaded and the
planning workers' initializer, measured turn about:
- the round trip of a no-op, and of planning 64 samples on 8 ranks (`plan_request_bytes`);
- a task that runs until cancelled (`time.sleep`): from `cancel()` to (a) the pool reporting the
  task done - where admission would give its slot back - (b) the worker that ran it gone, and
  (c) a no-op submitted right after the cancel answered by the replacement worker.
"""

from __future__ import annotations

import time
from pathlib import Path

import pebble

from batch_planner.convert import request_to_proto
from batch_planner.cost import CostModel
from batch_planner.validation import RequestLimits
from bench.common import BatchSize, Spread, argument_parser, make_request, markdown_table, write_report
from planner_server import worker_pool
from planner_server.planning_worker import plan_request_bytes, worker_initializer
from planner_server.process_pool import ProcessPool

RUNS = {"noop": 300, "plan": 150, "abandon": 12}


def _noop() -> None:
    return None


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


class Ours:
    name = "own pool (planner_server/process_pool.py)"

    def __init__(self, initargs, context):
        self.pool = ProcessPool(1, worker_initializer, initargs, worker_pool._PRELOAD)
        self.pool.warm_up()

    def call(self, fn, *args):
        return self.pool.submit(fn, *args).result(60)

    def abandon(self) -> tuple[float, float, float]:
        settled = []
        task = self.pool.submit(time.sleep, 600, on_settled=lambda: settled.append(time.perf_counter()))
        while not self.pool.busy:
            time.sleep(0.001)
        pid = self.pool.pids()[0]
        started = time.perf_counter()
        task.cancel()
        after = self.pool.submit(_noop)
        while not _gone(pid):
            time.sleep(0.0005)
        gone = time.perf_counter()
        after.result(60)
        return settled[0] - started if settled else float("nan"), gone - started, time.perf_counter() - started

    def close(self):
        self.pool.shutdown()


class Pebble:
    name = f"pebble {pebble.__version__} ProcessPool"

    def __init__(self, initargs, context):
        self.pool = pebble.ProcessPool(1, initializer=worker_initializer, initargs=initargs, context=context)
        self.call(_noop)

    def call(self, fn, *args):
        return self.pool.schedule(fn, args).result(60)

    def abandon(self) -> tuple[float, float, float]:
        future = self.pool.schedule(time.sleep, (600,))
        while not future.running():
            time.sleep(0.001)
        pid = next(iter(self.pool._pool_manager.worker_manager.workers))  # private: the bench's only way to the pid
        started = time.perf_counter()
        future.cancel()
        done = time.perf_counter() if future.done() else float("nan")
        after = self.pool.schedule(_noop)
        while not _gone(pid):
            time.sleep(0.0005)
        gone = time.perf_counter()
        after.result(60)
        return done - started, gone - started, time.perf_counter() - started

    def close(self):
        self.pool.stop()
        self.pool.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    runs = {k: max(3, v // 20) for k, v in RUNS.items()} if args.smoke else RUNS
    limits, model = RequestLimits(), CostModel()
    initargs = ("WARNING", limits, model, "text", "exact")
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(worker_pool._PRELOAD)
    pools = [Ours(initargs, context), Pebble(initargs, context)]
    payloads = [request_to_proto(make_request("lognormal_32k", BatchSize(64, 8), seed=s)).SerializeToString()
                for s in range(runs["plan"])]
    times: dict[tuple[str, str], list] = {(p.name, k): [] for p in pools for k in ("noop", "plan", "abandon")}
    try:
        for pool in pools:
            pool.call(plan_request_bytes, payloads[0], time.time() + 60, limits, model)  # worker caches
        for i in range(max(runs.values())):
            for pool in pools if i % 2 == 0 else pools[::-1]:
                if i < runs["noop"]:
                    t = time.perf_counter()
                    pool.call(_noop)
                    times[pool.name, "noop"].append(time.perf_counter() - t)
                if i < runs["plan"]:
                    t = time.perf_counter()
                    pool.call(plan_request_bytes, payloads[i], time.time() + 60, limits, model)
                    times[pool.name, "plan"].append(time.perf_counter() - t)
                if i < runs["abandon"]:
                    times[pool.name, "abandon"].append(pool.abandon())
    finally:
        for pool in pools:
            pool.close()
    ms = 1e3
    rows = []
    for pool in pools:
        for what, label in (("noop", "no-op round trip"), ("plan", "64 samples on 8 ranks, round trip")):
            s = Spread.of(times[pool.name, what])
            rows.append([pool.name, label, s.runs, f"{s.p50 * ms:.3f}", f"{s.p99 * ms:.3f}"])
        abandon = times[pool.name, "abandon"]
        for k, label in enumerate(("cancel -> task reported done (slot given back)", "cancel -> the worker running it gone",
                                   "cancel -> a no-op answered by the replacement")):
            s = Spread.of([a[k] for a in abandon])
            rows.append([pool.name, label, s.runs, f"{s.p50 * ms:.1f}", f"{s.p99 * ms:.1f}"])
    table = markdown_table(["pool", "what", "runs", "p50 ms", "p99 ms"], rows)
    report = write_report(Path(args.out), "pool_choice", "Our process pool beside pebble's ProcessPool",
                          __doc__.split("\n\n")[2], [("Results", table)], rows)
    print(report.path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
