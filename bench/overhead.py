"""Overhead of the service: what a Plan RPC and the planning core add to dynamic CP's scheduler.

    python -m bench.overhead --out docs/bench

Dynamic CP (`SCHEDULER_DYNAMIC_CP`) on a long-tail batch, on the exact path where it is verified
for the installed Megatron-Core (the default, in this process and on the server). For each batch
size, on the same input and interleaved run by run (the arms in a rotating order):
- `run_scheduler`: `batch_planner.schedulers.run_scheduler` in this process: the scheduler call
  and nothing else, the denominator of every ratio;
- `plan_batch`: the whole planning core in this process (validation, the scheduler, CP groups,
  invariants, statistics); then, on the plan it returned, `encode` (`plan_to_proto` in the columns
  form and `SerializeToString(deterministic=True)`: what the server does to answer a trainer) and
  `decode` (`PlanResponse.FromString` and `plan_from_proto`: what the trainer client does with the
  answer);
- `rpc`: `request_to_proto` -> `Plan` RPC on a real server with the default workers (one per
  core; tests.support.planner_process) -> `plan_from_proto`: what a trainer waits for. The request asks
  for the columns form (PLAN_FORM_COLUMNS), as the trainer client's does; a baseline server that
  predates it answers with micro_batches, which `plan_from_proto` reads as well;
- `GetCapabilities`: a round trip on the same channel that never reaches the planning pool, right
  after the Plan RPC;
- `bare gRPC`: the same request bytes to a synchronous gRPC server in another process with no
  handler of ours (bench/bare_grpc.py), which answers with as many bytes as this tree's columns
  response to that request: an arm of its own in the rotation, so its server has idled as long as
  the planner's has. It is what moving these bytes costs here with no planning at all: the
  transport's share of a Plan RPC. `added beyond bare gRPC` (rpc - bare gRPC - run_scheduler,
  paired) is what our server and client add on top of it; at the large sizes the scheduler's own
  run-to-run spread is larger than the transport, so that difference can come out negative. A
  baseline server that answers with micro_batches sends more bytes than the bare arm does.
Ratios are medians of the per-run ratios (each run's arms on the same request). Each run uses a
fresh seed, so a server-side cache could not help.
With `--baseline PATH` (a checkout of another commit of this repository) that checkout's server
runs too, started the same way, and every run also sends the request to it: the report adds its
rpc and added time and new / baseline of p50 and p99 for each size, over more runs
(SIDE_BY_SIDE_RUNS).
Bars: `plan_batch` / `run_scheduler` p50 <= 1.05 and rpc / `run_scheduler` p50 <= 1.15 at 4,096
samples on 256 ranks and at 16,384 on 1,024; at 64 samples on 8 ranks the added time
(rpc - `run_scheduler`) p50 <= 1 ms.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from batch_planner.convert import plan_from_proto, plan_to_proto, request_to_proto
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import run_scheduler
from batch_planner.v1 import planner_pb2 as pb
from bench.bare_grpc import BareGrpc
from bench.common import (
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

DISTRIBUTION = "lognormal_32k"  # long-tail: CP groups of several sizes
SCHEDULER = SchedulerKind.DYNAMIC_CP
SMALL, MEDIUM, LARGE = BatchSize(64, 8), BatchSize(4096, 256), BatchSize(16384, 1024)
SIZES, SMOKE_SIZES = (SMALL, MEDIUM, LARGE), (SMALL,)
WORKERS = 0  # the server's default: one planning worker per available core
# Enough runs at each size that the median of the per-run ratios, which decides a bar, is stable:
# one 4,096-sample run's ratio ranged from 0.66 to 1.98 on this VM, and with 25 runs five reports
# of the same tree gave medians from 1.09 to 1.20.
RUNS = {SMALL.samples: 300, MEDIUM.samples: 120, LARGE.samples: 36}
# A regression check compares p99s too: at least 100 runs where a run costs milliseconds or tens
# of them; at 16,384 samples a run costs over a second (four arms of hundreds of ms), so fewer.
SIDE_BY_SIDE_RUNS = {SMALL.samples: 1000, MEDIUM.samples: 120, LARGE.samples: 36}
RPC_TIMEOUT_S = 300.0
CORE_RATIO_BAR, RPC_RATIO_BAR, ADDED_P50_BAR = 1.05, 1.15, 1e-3
# The job name travels in the request metadata as well as in the body (make_request's job), as the
# trainer client sends it; a server that does not read the metadata ignores it.
METADATA = job_metadata("bench")
PLAN_FORM = pb.PLAN_FORM_COLUMNS  # what the trainer client asks for (trainer_client/service/plan_source.py)


@dataclass(frozen=True)
class ServerArm:
    """One server's Plan RPC over the same runs: latency, paired ratio and added time over the
    in-process scheduler, and the GetCapabilities round trip."""

    rpc: Spread
    ratio: Spread  # paired rpc / run_scheduler
    added: Spread  # paired rpc - run_scheduler, seconds
    transport: Spread  # GetCapabilities round trip: gRPC on loopback without the planning pool
    beyond_floor: Spread  # paired rpc - bare gRPC - run_scheduler, seconds


def rpc_bars(size: BatchSize, arm: ServerArm) -> list[tuple[str, bool]]:
    """The RPC's bars at this size (none at sizes without one)."""
    if size == SMALL:
        return [(f"added (rpc - run_scheduler) p50 <= {ADDED_P50_BAR * 1e3:g} ms", arm.added.p50 <= ADDED_P50_BAR)]
    if size in (MEDIUM, LARGE):
        return [(f"rpc/run_scheduler p50 <= {RPC_RATIO_BAR:.2f}", arm.ratio.p50 <= RPC_RATIO_BAR)]
    return []


@dataclass(frozen=True)
class SizeResult:
    size: BatchSize
    scheduler: Spread  # run_scheduler in process
    plan_batch: Spread
    core_ratio: Spread  # paired plan_batch / run_scheduler
    encode: Spread  # plan_to_proto + SerializeToString(deterministic=True) of plan_batch's plan
    decode: Spread  # PlanResponse.FromString + plan_from_proto of those bytes
    floor: Spread  # bare gRPC: the request's bytes in, as many bytes out as its response, no handler of ours
    server: ServerArm  # this tree's server
    baseline: ServerArm | None = None  # the same runs against the baseline checkout's server

    def bars(self) -> list[tuple[str, bool]]:
        core = [(f"plan_batch/run_scheduler p50 <= {CORE_RATIO_BAR:.2f}", self.core_ratio.p50 <= CORE_RATIO_BAR)]
        return (core if self.size in (MEDIUM, LARGE) else []) + rpc_bars(self.size, self.server)


def measure(stubs: list, bare: BareGrpc, size: BatchSize, runs: int) -> SizeResult:
    """`stubs[0]` is this tree's server, `stubs[1]` (if any) the baseline's; `bare`: the bare gRPC server."""
    requests = [make_request(DISTRIBUTION, size, seed=seed, scheduler=SCHEDULER) for seed in range(runs + 1)]
    # Warm every path (imports, channel, worker caches) on a request outside the measured ones.
    run_scheduler(requests[-1])
    for stub in stubs:
        plan_from_proto(stub.Plan(request_to_proto(requests[-1], PLAN_FORM), timeout=RPC_TIMEOUT_S, metadata=METADATA))
    # The bare gRPC arm answers with as many bytes as the server's response: the in-process plan's
    # columns form, byte for byte what the server sends for the request.
    response_bytes = {id(r): len(plan_to_proto(plan_batch(r), columns=True).SerializeToString(deterministic=True)) for r in requests}
    bare.call(request_to_proto(requests[-1], PLAN_FORM).SerializeToString(), response_bytes[id(requests[-1])])
    t: dict[str, list[float]] = {name: [] for name in ("scheduler", "plan_batch", "encode", "decode", "floor")}
    rpc: list[list[float]] = [[] for _ in stubs]
    transport: list[list[float]] = [[] for _ in stubs]

    def timed(name: str, fn, *args):
        started = time.perf_counter()
        value = fn(*args)
        t[name].append(time.perf_counter() - started)
        return value

    def in_process(request: PlanRequest) -> None:
        timed("scheduler", run_scheduler, request)
        plan = timed("plan_batch", plan_batch, request)
        data = timed("encode", lambda: plan_to_proto(plan, columns=True).SerializeToString(deterministic=True))
        timed("decode", lambda: plan_from_proto(pb.PlanResponse.FromString(data)))

    def over_rpc(k: int):
        def step(request: PlanRequest) -> None:
            started = time.perf_counter()
            plan_from_proto(stubs[k].Plan(request_to_proto(request, PLAN_FORM), timeout=RPC_TIMEOUT_S, metadata=METADATA))
            rpc[k].append(time.perf_counter() - started)
            started = time.perf_counter()
            stubs[k].GetCapabilities(pb.GetCapabilitiesRequest(), timeout=RPC_TIMEOUT_S)
            transport[k].append(time.perf_counter() - started)

        return step

    def over_bare_grpc(request: PlanRequest) -> None:
        timed("floor", bare.call, request_to_proto(request, PLAN_FORM).SerializeToString(), response_bytes[id(request)])

    # Rotate through every order of the arms so that none always runs first or on a warmer cache.
    orders = list(itertools.permutations([in_process, over_bare_grpc, *(over_rpc(k) for k in range(len(stubs)))]))
    for i, request in enumerate(requests[:runs]):
        for step in orders[i % len(orders)]:
            step(request)
    sched, floor = t["scheduler"], t["floor"]
    arms = [
        ServerArm(Spread.of(r), Spread.of([a / s for a, s in zip(r, sched)]),
                  Spread.of([a - s for a, s in zip(r, sched)]), Spread.of(g),
                  Spread.of([a - f - s for a, f, s in zip(r, floor, sched)]))
        for r, g in zip(rpc, transport)
    ]
    core = Spread.of([p / s for p, s in zip(t["plan_batch"], sched)])
    return SizeResult(size, Spread.of(sched), Spread.of(t["plan_batch"]), core, Spread.of(t["encode"]), Spread.of(t["decode"]),
                      Spread.of(floor), arms[0], arms[1] if len(arms) > 1 else None)


class _Context:
    """What PlannerServicer.plan reads of a grpc.ServicerContext, for calling it in this process."""

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return METADATA

    def add_callback(self, callback) -> bool:
        return True


def decompose_small(runs: int, bare: BareGrpc) -> list[list[str]]:
    """Where the added time goes at 64 samples, interleaved in this process on the same requests:
    the client's conversions, the servicer (a default server plans this size inline in its handler
    thread) and its parts, a worker's function called here and through the planning pool, and a
    bare gRPC echo (a server process with no handler of ours) of the request's bytes."""
    from batch_planner.cost_spec import CostModel
    from batch_planner.validation import RequestLimits
    from planner_server.config import ServerConfig
    from planner_server.metrics import PlannerMetrics
    from planner_server.planning_worker import plan_request_bytes
    from planner_server.servicer import PlannerServicer
    from planner_server.worker_pool import InlineBound, PlanningPool

    requests = [make_request(DISTRIBUTION, SMALL, seed=s, scheduler=SCHEDULER) for s in range(runs)]
    payloads = [request_to_proto(r, PLAN_FORM).SerializeToString() for r in requests]
    limits, model, config = RequestLimits(), CostModel(), ServerConfig()
    inline = InlineBound(config.inline_max_samples, config.inline_max_ranks)
    pool = PlanningPool(1, 4, limits, model)  # inline off: every request on the worker
    inline_pool = PlanningPool(0, 4, limits, model, inline=inline)  # no worker: only inline requests
    servicer = PlannerServicer(config, inline_pool, PlannerMetrics())
    rows: dict[str, list[float]] = {name: [] for name in _DECOMPOSITION}
    try:
        pool.warm_up()
        plan_request_bytes(payloads[0], time.time() + 60, limits, model)  # imports, caches
        with _request_log_to_devnull():
            for request, payload in zip(requests, payloads):
                for name, call in _decomposition_calls(request, payload, limits, model, pool, inline_pool, servicer):
                    started = time.perf_counter()
                    call()
                    rows[name].append(time.perf_counter() - started)
    finally:
        pool.shutdown()
    rows["bare gRPC echo of the request's bytes, back to back (synchronous server in another process, no handler of ours)"] = \
        bare.echo_seconds(payloads)
    ms = 1e3
    return [[what, len(v), Spread.of(v).fmt(ms, 3), f"{Spread.of(v).p99 * ms:.3f}"] for what, v in rows.items() if v]


_DECOMPOSITION = (
    "run_scheduler alone",
    "client: request_to_proto + SerializeToString",
    "PlannerServicer.plan in this process (inline, as a default server plans this size: parse, plan_batch, "
    "serialize, metrics, the request's log line)",
    "worker function in this process (parse, plan_batch, serialize)",
    "PlanningPool.plan on its one worker (inline off: the process-pool hop)",
    "PlanningPool round trip of a no-op",
)


def _decomposition_calls(request, payload, limits, model, pool, inline_pool, servicer):
    from planner_server.planning_worker import plan_request_bytes

    def noop_round_trip():
        work = pool.admit(1)
        try:
            work.submit(_noop).result(timeout=60)
        finally:
            work.close()

    calls = (
        lambda: run_scheduler(request),
        lambda: request_to_proto(request, PLAN_FORM).SerializeToString(),
        lambda: servicer.plan(payload, _Context()),
        lambda: plan_request_bytes(payload, time.time() + 60, limits, model),
        lambda: pool.plan(payload, time.time() + 60, timeout=60),
        noop_round_trip,
    )
    return zip(_DECOMPOSITION, calls)


@contextlib.contextmanager
def _request_log_to_devnull():
    """The servicer's request log line written as a server writes it (INFO, to a stream), to
    os.devnull, so that its cost is measured without filling the benchmark's output."""
    logger = logging.getLogger("planner_server.requests")
    with open(os.devnull, "w") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        level, propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def _noop() -> None:
    return None


def plot(results: list[SizeResult], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [r.size.label for r in results]
    x = range(len(results))
    for offset, (name, spreads, color) in enumerate((
        ("Plan RPC / run_scheduler", [r.server.ratio for r in results], "#4c72b0"),
        ("plan_batch / run_scheduler", [r.core_ratio for r in results], "#55a868"),
    )):
        ax.bar([i + (offset - 0.5) * 0.4 for i in x], [s.p50 for s in spreads], width=0.4, color=color, label=f"{name}, p50 (bars: min..p99)",
               yerr=[[s.p50 - s.min for s in spreads], [s.p99 - s.p50 for s in spreads]], capsize=5)
    ax.axhline(RPC_RATIO_BAR, color="#c44e52", linestyle="--", label=f"RPC bar from 4,096: {RPC_RATIO_BAR:.2f}")
    ax.axhline(CORE_RATIO_BAR, color="#8172b2", linestyle=":", label=f"plan_batch bar from 4,096: {CORE_RATIO_BAR:.2f}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("latency / run_scheduler in process")
    ax.set_xlabel("samples on DPxCP ranks")
    ax.set_title(f"Service overhead, dynamic CP, {DISTRIBUTION}")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _verdicts(bars: list[tuple[str, bool]]) -> str:
    return "; ".join(verdict(ok) for _, ok in bars) or "-"


def results_table(results: list[SizeResult]) -> str:
    ms, rows = 1e3, []
    for r in results:
        bars, s = r.bars(), r.server
        rows.append([
            r.size.label, r.scheduler.runs, r.scheduler.fmt(ms), r.plan_batch.fmt(ms), f"{r.core_ratio.p50:.3f}",
            s.rpc.fmt(ms), f"{s.rpc.p99 * ms:.2f}", f"{s.ratio.p50:.3f} ({s.ratio.min:.3f}..{s.ratio.p99:.3f})",
            f"{s.added.p50 * ms:.2f} / {s.added.p99 * ms:.2f}", f"{r.encode.p50 * ms:.2f}", f"{r.decode.p50 * ms:.2f}",
            s.transport.fmt(ms), r.floor.fmt(ms), f"{s.beyond_floor.p50 * ms:.2f} / {s.beyond_floor.p99 * ms:.2f}",
            "; ".join(bar for bar, _ in bars) or "none", _verdicts(bars),
        ])
    return markdown_table(
        ["samples on ranks", "runs", "run_scheduler ms p50 (min..max)", "plan_batch ms p50 (min..max)",
         "plan_batch/run_scheduler p50", "rpc ms p50 (min..max)", "rpc ms p99", "rpc/run_scheduler p50 (min..p99)",
         "added ms p50 / p99", "encode ms p50", "decode ms p50", "GetCapabilities ms p50 (min..max)",
         "bare gRPC ms p50 (min..max)", "added beyond bare gRPC ms p50 / p99", "bars", "verdict"],
        rows,
    )


def side_by_side_table(results: list[SizeResult]) -> str:
    ms, rows = 1e3, []
    for r in results:
        new, base = r.server, r.baseline
        assert base is not None
        p50, p99 = spread_ratios(new.rpc, base.rpc)
        rows.append([
            r.size.label, new.rpc.runs, f"{new.rpc.p50 * ms:.2f} / {new.rpc.p99 * ms:.2f}",
            f"{base.rpc.p50 * ms:.2f} / {base.rpc.p99 * ms:.2f}", p50, p99,
            f"{new.added.p50 * ms:.2f} / {new.added.p99 * ms:.2f}", f"{base.added.p50 * ms:.2f} / {base.added.p99 * ms:.2f}",
            f"{new.ratio.p50:.3f} / {base.ratio.p50:.3f}",
            f"{new.transport.p50 * ms:.2f} / {base.transport.p50 * ms:.2f}",
            f"{new.beyond_floor.p50 * ms:.2f} / {base.beyond_floor.p50 * ms:.2f}",
            " / ".join(_verdicts(rpc_bars(r.size, arm)) for arm in (new, base)),
        ])
    return markdown_table(
        ["samples on ranks", "runs", "new rpc ms p50 / p99", "baseline rpc ms p50 / p99", "new/baseline rpc p50",
         "new/baseline rpc p99", "new added ms p50 / p99", "baseline added ms p50 / p99",
         "rpc/run_scheduler p50 new / baseline", "GetCapabilities ms p50 new / baseline",
         "added beyond bare gRPC ms p50 new / baseline", "RPC bar verdict new / baseline"],
        rows,
    )


def run(out: Path, smoke: bool = False, address: str | None = None, baseline: Path | None = None) -> Report[SizeResult]:
    """`address`: this tree's server is that running planner instead of a fresh one. `baseline`: a
    checkout of another commit, whose server is started and measured side by side."""
    sizes = SMOKE_SIZES if smoke else SIZES
    trees: tuple[Tree, ...] = side_by_side_trees(baseline)
    results = []
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(planner_server(address, workers=WORKERS))] if address or len(trees) == 1 else []
        if len(addresses) < len(trees):
            addresses += [server.address for server in stack.enter_context(running(trees[len(addresses):], workers=WORKERS))]
        channels_stubs = [planner_stub(a) for a in addresses]
        for channel, _ in channels_stubs:
            stack.enter_context(channel)
        bare = BareGrpc()
        stack.callback(bare.close)
        for size in sizes:
            runs = 5 if smoke else (RUNS if len(trees) == 1 else SIDE_BY_SIDE_RUNS)[size.samples]
            results.append(measure([stub for _, stub in channels_stubs], bare, size, runs))
        small_parts = decompose_small(RUNS[SMALL.samples], bare) if not smoke and len(trees) == 1 else None
    name = ("overhead" if len(trees) == 1 else f"overhead_vs_{trees[1].commit}") + ("_smoke" if smoke else "")
    plot(results, out / f"{name}.png")
    intro = (__doc__ or "").split("\n\n", 2)[2].strip() + f"\n\nDistribution: `{DISTRIBUTION}`. `runs` says how many " \
        "interleaved runs each row has; with few runs p99 is the maximum. `encode` and `decode` are measured in this " \
        "process on `plan_batch`'s plan of each run."
    table = results_table(results) + f"\n\n![overhead ratio]({name}.png)"
    if len(trees) == 1:
        sections = [("Results", table)]
    else:
        intro += "\n\n" + side_by_side_intro(trees)
        sections = [("New and baseline side by side", side_by_side_table(results)),
                    ("New tree: Plan RPC and plan_batch vs run_scheduler in process", table)]
    if small_parts is not None:  # starts a process pool of its own: worth it only in the full run
        sections.append((
            "Where the added time goes at 64 samples",
            "Interleaved, in this process, on the same 64-sample requests (compare with the "
            "`GetCapabilities` column above for gRPC on loopback alone):\n\n"
            + markdown_table(["path", "runs", "ms p50 (min..max)", "ms p99"], small_parts),
        ))
    elif not smoke:
        sections.append((
            "Where the added time goes at 64 samples",
            "Not measured in a side-by-side run: that section calls the server's planning pool in this "
            "process, so it would measure only this tree's; `python -m bench.overhead` without "
            "`--baseline` measures it.",
        ))
    return write_report(
        out, name, "Service overhead: Plan RPC and plan_batch vs run_scheduler in process", intro, sections,
        rows=results, bars=[Bar(r.size.label, bar, ok) for r in results for bar, ok in r.bars()],
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
