"""Overhead of the service: end-to-end Plan latency over loopback vs Megatron-Core in-process.

    python -m bench.overhead --out docs/bench

For each batch size, on the same input and interleaved run by run:
- `scheduler`: `batch_planner.schedulers.run_scheduler` in this process: the hybrid-CP scheduler
  call and nothing else (the denominator of the ratio): the exact path where it is verified for the
  installed Megatron-Core (the default, as on the server), else Megatron-Core's BalancedCPScheduler;
- `plan_batch`: the whole planning core in this process (validation, scheduler, invariants,
  statistics), to show where added time goes;
- `rpc`: PlanRequest -> proto -> `Plan` RPC on a real server (tests.planner_process, 2 workers) ->
  `plan_from_proto`: what a trainer waits for;
- `GetCapabilities`: a round trip on the same channel that never reaches a planning worker: the
  cost of gRPC on loopback alone.
Each run uses a fresh seed, so a server-side cache could not help.
With `--baseline PATH` (a checkout of another commit of this repository) that checkout's server
runs too, started the same way, and every run also sends the request to it (the arms in a rotating
order): the report adds its rpc and added time and new / baseline of p50 and p99 for each size,
over more runs (SIDE_BY_SIDE_RUNS: at least 100, so that p99 is not just the slowest run).
Bars: rpc/scheduler p50 <= 1.03 from 1,024 samples up;
at 64 samples the added time (rpc - scheduler) <= 0.5 ms p50 and <= 3 ms p99.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.convert import plan_from_proto, request_to_proto
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from batch_planner.schedulers import run_scheduler
from batch_planner.v1 import planner_pb2 as pb
from bench.common import (
    SIZES,
    SMOKE_SIZES,
    Bar,
    BatchSize,
    Report,
    Spread,
    argument_parser,
    job_metadata,
    make_request,
    markdown_table,
    planner_server,
    planner_stub,
    pyplot,
    save_figure,
    verdict,
    write_report,
)
from bench.side_by_side import Tree, running, spread_ratios
from bench.side_by_side import intro as side_by_side_intro
from bench.side_by_side import trees as side_by_side_trees

DISTRIBUTION = "lognormal_32k"  # the mix with CP groups of several sizes
RUNS = {64: 200, 256: 50, 1024: 15, 4096: 3}
# A regression check compares p99s too: with the exact path a run costs milliseconds even at 4,096
# samples (a few hundred ms for all four arms), so every size gets at least 100 runs (~1 min).
SIDE_BY_SIDE_RUNS = {64: 1000, 256: 500, 1024: 200, 4096: 100}
RPC_TIMEOUT_S = 300.0
RATIO_BAR, ADDED_P50_BAR, ADDED_P99_BAR = 1.03, 0.5e-3, 3e-3
# The job name travels in the request metadata as well as in the body (make_request's job), as the
# trainer client sends it; a server that does not read the metadata ignores it.
METADATA = job_metadata("bench")


@dataclass(frozen=True)
class ServerArm:
    """One server's Plan RPC over the same runs: latency, paired ratio and added time over the
    in-process scheduler, and the GetCapabilities round trip."""

    rpc: Spread
    ratio: Spread  # paired rpc / scheduler
    added: Spread  # paired rpc - scheduler, seconds
    transport: Spread


def size_bar(size: BatchSize, ratio: Spread, added: Spread) -> tuple[str, bool | None]:
    if size.samples >= 1024:
        return f"rpc/scheduler p50 <= {RATIO_BAR:.2f}", ratio.p50 <= RATIO_BAR
    if size.samples == 64:
        return (f"added p50 <= {ADDED_P50_BAR * 1e3:g} ms, p99 <= {ADDED_P99_BAR * 1e3:g} ms",
                added.p50 <= ADDED_P50_BAR and added.p99 <= ADDED_P99_BAR)
    return "none", None


@dataclass(frozen=True)
class SizeResult:
    size: BatchSize
    scheduler: Spread
    plan_batch: Spread
    rpc: Spread
    ratio: Spread  # paired rpc / scheduler
    added: Spread  # paired rpc - scheduler, seconds
    transport: Spread  # GetCapabilities round trip: gRPC on loopback without the planning pool
    baseline: ServerArm | None = None  # the same runs against the baseline checkout's server

    def bar(self) -> tuple[str, bool | None]:
        return size_bar(self.size, self.ratio, self.added)


def measure(stubs: list, size: BatchSize, runs: int) -> SizeResult:
    """`stubs[0]` is this tree's server, `stubs[1]` (if any) the baseline's."""
    requests = [make_request(DISTRIBUTION, size, seed=seed) for seed in range(runs + 1)]
    # Warm every path (imports, channel, worker caches) on a request outside the measured ones.
    run_scheduler(requests[-1])
    for stub in stubs:
        plan_from_proto(stub.Plan(request_to_proto(requests[-1]), timeout=RPC_TIMEOUT_S, metadata=METADATA))
    sched, full = [], []
    rpc: list[list[float]] = [[] for _ in stubs]
    transport: list[list[float]] = [[] for _ in stubs]

    def in_process(request: PlanRequest) -> None:
        t = time.perf_counter()
        run_scheduler(request)
        sched.append(time.perf_counter() - t)
        t = time.perf_counter()
        plan_batch(request)
        full.append(time.perf_counter() - t)

    def over_rpc(k: int):
        def step(request: PlanRequest) -> None:
            t = time.perf_counter()
            plan_from_proto(stubs[k].Plan(request_to_proto(request), timeout=RPC_TIMEOUT_S, metadata=METADATA))
            rpc[k].append(time.perf_counter() - t)
            t = time.perf_counter()
            stubs[k].GetCapabilities(pb.GetCapabilitiesRequest(), timeout=RPC_TIMEOUT_S)
            transport[k].append(time.perf_counter() - t)

        return step

    # Rotate through every order of the arms so that none always runs first or on a warmer cache
    # (with one server: in process then RPC, RPC then in process).
    orders = list(itertools.permutations([in_process, *(over_rpc(k) for k in range(len(stubs)))]))
    for i, request in enumerate(requests[:runs]):
        for step in orders[i % len(orders)]:
            step(request)
    arms = [
        ServerArm(Spread.of(r), Spread.of([a / s for a, s in zip(r, sched)]),
                  Spread.of([a - s for a, s in zip(r, sched)]), Spread.of(t))
        for r, t in zip(rpc, transport)
    ]
    new = arms[0]
    return SizeResult(size, Spread.of(sched), Spread.of(full), new.rpc, new.ratio, new.added, new.transport,
                      arms[1] if len(arms) > 1 else None)


def decompose_small(runs: int) -> list[list[str]]:
    """Where the added time goes at 64 samples: the worker's function called in this process vs
    through the server's PlanningPool (process-pool IPC), the pool's round trip of a no-op, and a
    bare gRPC echo (a server process with no handler of ours) of a 64-sample request's bytes."""
    from batch_planner.cost_spec import CostModel
    from batch_planner.validation import RequestLimits
    from planner_server.planning_worker import plan_request_bytes
    from planner_server.worker_pool import PlanningPool

    size = BatchSize(64, 8)
    payloads = [request_to_proto(make_request(DISTRIBUTION, size, seed=s)).SerializeToString() for s in range(runs)]
    limits, model = RequestLimits(), CostModel()
    pool = PlanningPool(1, 4, limits, model)
    try:
        pool.warm_up()
        plan_request_bytes(payloads[0], time.time() + 60, limits, model)  # imports, caches
        direct, pooled, noop = [], [], []
        for payload in payloads:
            t = time.perf_counter()
            plan_request_bytes(payload, time.time() + 60, limits, model)
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.plan(payload, time.time() + 60, timeout=60)
            pooled.append(time.perf_counter() - t)
            t = time.perf_counter()
            work = pool.admit(1)
            try:
                work.submit(_noop).result(timeout=60)
            finally:
                work.close()
            noop.append(time.perf_counter() - t)
    finally:
        pool.shutdown()
    echo = _bare_grpc_echo(payloads)
    ms = 1e3
    rows = [
        ("worker function in this process (parse, plan_batch, serialize)", direct),
        ("the same through PlanningPool (1 worker)", pooled),
        ("PlanningPool round trip of a no-op", noop),
        ("bare gRPC echo of the request's bytes (synchronous server in another process, no handler of ours)", echo),
    ]
    return [[what, len(v), Spread.of(v).fmt(ms), f"{Spread.of(v).p99 * ms:.2f}"] for what, v in rows if v]


def _noop() -> None:
    return None


def _echo_server(port_out) -> None:
    """A synchronous gRPC server whose one method returns its request's bytes: the transport's floor."""
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler,))
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _bare_grpc_echo(payloads: list[bytes]) -> list[float]:
    import multiprocessing

    import grpc

    receive, send = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(send,), daemon=True)
    process.start()
    try:
        if not receive.poll(60):
            return []
        with grpc.insecure_channel(f"127.0.0.1:{receive.recv()}") as channel:
            echo = channel.unary_unary("/bench.Echo/Echo")
            echo(payloads[0], timeout=60)  # the connection
            seconds = []
            for payload in payloads:
                t = time.perf_counter()
                echo(payload, timeout=60)
                seconds.append(time.perf_counter() - t)
        return seconds
    finally:
        process.kill()
        process.join(10)


def plot(results: list[SizeResult], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [r.size.label for r in results]
    p50 = [r.ratio.p50 for r in results]
    low = [r.ratio.p50 - r.ratio.min for r in results]
    high = [r.ratio.p99 - r.ratio.p50 for r in results]
    ax.bar(labels, p50, yerr=[low, high], capsize=6, color="#4c72b0", label="p50 (bars: min..p99)")
    ax.axhline(RATIO_BAR, color="#c44e52", linestyle="--", label=f"bar from 1,024 samples: {RATIO_BAR:.2f}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("Plan RPC latency / Megatron-Core in-process")
    ax.set_xlabel("samples on DPxCP ranks")
    ax.set_title(f"Service overhead, hybrid CP, {DISTRIBUTION}")
    ax.legend()
    save_figure(fig, path)


def side_by_side_table(results: list[SizeResult]) -> str:
    ms, rows = 1e3, []
    for r in results:
        base = r.baseline
        assert base is not None
        p50, p99 = spread_ratios(r.rpc, base.rpc)
        verdicts = [size_bar(r.size, arm.ratio, arm.added)[1] for arm in (r, base)]
        rows.append([
            r.size.label, r.rpc.runs, f"{r.rpc.p50 * ms:.2f} / {r.rpc.p99 * ms:.2f}",
            f"{base.rpc.p50 * ms:.2f} / {base.rpc.p99 * ms:.2f}", p50, p99,
            f"{r.added.p50 * ms:.2f} / {r.added.p99 * ms:.2f}", f"{base.added.p50 * ms:.2f} / {base.added.p99 * ms:.2f}",
            f"{r.ratio.p50:.3f} / {base.ratio.p50:.3f}",
            f"{r.transport.p50 * ms:.2f} / {base.transport.p50 * ms:.2f}",
            " / ".join("-" if ok is None else verdict(ok) for ok in verdicts),
        ])
    return markdown_table(
        ["samples on ranks", "runs", "new rpc ms p50 / p99", "baseline rpc ms p50 / p99", "new/baseline rpc p50",
         "new/baseline rpc p99", "new added ms p50 / p99", "baseline added ms p50 / p99",
         "rpc/scheduler p50 new / baseline", "GetCapabilities ms p50 new / baseline", "bar verdict new / baseline"],
        rows,
    )


def run(out: Path, smoke: bool = False, address: str | None = None, baseline: Path | None = None) -> Report[SizeResult]:
    """`address`: this tree's server is that running planner instead of a fresh one. `baseline`: a
    checkout of another commit, whose server is started and measured side by side."""
    sizes = SMOKE_SIZES if smoke else SIZES
    trees: tuple[Tree, ...] = side_by_side_trees(baseline)
    results = []
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(planner_server(address, workers=2))] if address or len(trees) == 1 else []
        if len(addresses) < len(trees):
            addresses += [server.address for server in stack.enter_context(running(trees[len(addresses):], workers=2))]
        channels_stubs = [planner_stub(a) for a in addresses]
        for channel, _ in channels_stubs:
            stack.enter_context(channel)
        for size in sizes:
            runs = 5 if smoke else (RUNS if len(trees) == 1 else SIDE_BY_SIDE_RUNS)[size.samples]
            results.append(measure([stub for _, stub in channels_stubs], size, runs))
    ms = 1e3
    rows = []
    for r in results:
        bar, ok = r.bar()
        rows.append([
            r.size.label, r.scheduler.runs, r.scheduler.fmt(ms), r.plan_batch.fmt(ms), r.rpc.fmt(ms),
            f"{r.rpc.p99 * ms:.2f}", f"{r.ratio.p50:.3f} ({r.ratio.min:.3f}..{r.ratio.p99:.3f})",
            f"{r.added.p50 * ms:.2f} / {r.added.p99 * ms:.2f}", r.transport.fmt(ms), bar, "-" if ok is None else verdict(ok),
        ])
    table = markdown_table(
        ["samples on ranks", "runs", "scheduler ms p50 (min..max)", "plan_batch ms p50 (min..max)",
         "rpc ms p50 (min..max)", "rpc ms p99", "rpc/scheduler p50 (min..p99)", "added ms p50 / p99",
         "GetCapabilities ms p50 (min..max)", "bar", "verdict"],
        rows,
    )
    name = ("overhead" if len(trees) == 1 else f"overhead_vs_{trees[1].commit}") + ("_smoke" if smoke else "")
    plot(results, out / f"{name}.png")
    intro = (__doc__ or "").split("\n\n", 2)[2].strip() + f"\n\nDistribution: `{DISTRIBUTION}`, hybrid CP " \
        "(Megatron-Core's `BalancedCPScheduler`, in every build; the fastest scheduler, so the one where the " \
        "service's share shows most). `runs` says how many interleaved runs each row has; with few runs p99 is the maximum."
    if len(trees) == 1:
        sections = [("Results", table + f"\n\n![overhead ratio]({name}.png)")]
    else:
        intro += "\n\n" + side_by_side_intro(trees)
        sections = [
            ("New and baseline side by side", side_by_side_table(results)),
            ("New tree: Plan RPC vs Megatron-Core in-process", table + f"\n\n![overhead ratio]({name}.png)"),
        ]
    if not smoke and len(trees) == 1:  # starts a process pool of its own: worth it only in the full run
        sections.append((
            "Where the added time goes at 64 samples",
            "Interleaved, in this process, on the same 64-sample requests (compare with the "
            "`GetCapabilities` column above for gRPC on loopback alone):\n\n"
            + markdown_table(["path", "runs", "ms p50 (min..max)", "ms p99"], decompose_small(RUNS[64])),
        ))
    elif not smoke:
        sections.append((
            "Where the added time goes at 64 samples",
            "Not measured in a side-by-side run: that section calls the server's planning pool in this "
            "process, so it would measure only this tree's; `python -m bench.overhead` without "
            "`--baseline` measures it.",
        ))
    return write_report(
        out, name, "Service overhead: Plan RPC vs Megatron-Core in-process", intro, sections,
        rows=results,
        bars=[Bar(r.size.label, bar, ok) for r in results for bar, ok in [r.bar()] if ok is not None],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--address", help="use this running planner instead of starting one")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit of this repository: its server "
                        "is measured side by side with this tree's, interleaved run by run")
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.address, args.baseline).path.read_text())


if __name__ == "__main__":
    main()
