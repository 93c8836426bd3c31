"""What assembling `auto` in the core costs the server (docs/design.md, "The auto policy").

The server runs the core's `plan_batch` for an auto request in its handler thread, its
candidates planned on the workers and sent back as `Outcome`s (their plans without micro-batches,
which stay pickled until the served plan gets its own). Two measurements:

- `handler`: in this process, the handler's own work for one auto request (parse, validate, skip
  bounds, loading the candidates' outcomes, serving, serializing), from outcomes pickled as the
  workers send them: with every candidate's whole plan loaded vs with only the served plan's
  micro-batches loaded (what the server does), interleaved run by run;
- `rpc` (with `--baseline PATH`): an auto Plan RPC to this tree's server and to the baseline's
  (bench/side_by_side.py), interleaved run by run on the same requests, the same workers; the two
  responses must be byte-identical.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, replace
from pathlib import Path

from batch_planner.auto import Candidate, Outcome, PlanOne, plan_candidate
from batch_planner.convert import request_to_proto
from batch_planner.cost_spec import CostModel
from batch_planner.plan import Plan
from batch_planner.request import SchedulerKind
from batch_planner.validation import RequestLimits
from bench.common import BatchSize, Report, Spread, argument_parser, job_metadata, make_request, markdown_table, planner_stub, write_report
from bench.side_by_side import alternating, running, spread_ratios
from bench.side_by_side import intro as side_by_side_intro
from bench.side_by_side import trees as side_by_side_trees
from planner_server.planning_worker import parse, plan_parsed

DISTRIBUTION = "lognormal_32k"
SIZES, SMOKE_SIZES = (BatchSize(4096, 256), BatchSize(16384, 1024)), (BatchSize(64, 8),)
RUNS, SMOKE_RUNS = 7, 2
SERVER_ARGS = ("--max-job-share", "1.0")  # one client sends every candidate of a request
LIMITS = RequestLimits()


@dataclass(frozen=True)
class Row:
    what: str
    size: BatchSize
    first: Spread  # every plan loaded (handler) or the new tree (rpc)
    second: Spread  # the served plan's micro-batches only (handler) or the baseline (rpc)


def _pickled_outcomes(message: bytes) -> tuple[dict[str, bytes], dict[str, tuple[bytes, bytes]]]:
    """Every candidate planned once, pickled as a whole and as the workers send it (plan apart from
    its micro-batches)."""
    whole: dict[str, bytes] = {}
    apart: dict[str, tuple[bytes, bytes]] = {}

    def record(found: list[Candidate], plan_one: PlanOne) -> list[Outcome]:
        outcomes = [plan_candidate(c, plan_one) for c in found]
        for o in outcomes:
            whole[o.candidate.name] = pickle.dumps(o, protocol=5)
            light = o if o.plan is None else replace(o, plan=replace(o.plan, micro_batches=()))
            apart[o.candidate.name] = (pickle.dumps(light, protocol=5), pickle.dumps(o.plan.micro_batches if o.plan else (), protocol=5))
        return outcomes

    plan_parsed(parse(message, time.time() + 3600), LIMITS, CostModel(), record)
    return whole, apart


def handler_rows(sizes: tuple[BatchSize, ...], runs: int) -> list[Row]:
    return [_handler_row(size, runs) for size in sizes]


def _handler_row(size: BatchSize, runs: int) -> Row:
    message = request_to_proto(make_request(DISTRIBUTION, size, scheduler=SchedulerKind.AUTO)).SerializeToString()
    whole, apart = _pickled_outcomes(message)
    held: dict[str, bytes] = {}

    def every_plan(found: list[Candidate], _plan_one: PlanOne) -> list[Outcome]:
        return [pickle.loads(whole[c.name]) for c in found]

    def served_only(found: list[Candidate], _plan_one: PlanOne) -> list[Outcome]:
        held.update((c.name, apart[c.name][1]) for c in found)
        return [pickle.loads(apart[c.name][0]) for c in found]

    def finish(plan: Plan) -> Plan:
        return replace(plan, micro_batches=pickle.loads(held[next(c.name for c in plan.candidates if c.served)]))

    times: dict[str, list[float]] = {"every": [], "served": []}
    for k in range(runs):
        answers = {}
        for arm in alternating(("every", "served"), k):
            started = time.perf_counter()
            parsed = parse(message, time.time() + 3600)
            if arm == "every":
                answers[arm] = plan_parsed(parsed, LIMITS, CostModel(), every_plan)
            else:
                answers[arm] = plan_parsed(parsed, LIMITS, CostModel(), served_only, finish=finish)
            times[arm].append(time.perf_counter() - started)
        assert answers["every"].response == answers["served"].response, "the two arms answered differently"
    return Row("handler", size, Spread.of(times["every"]), Spread.of(times["served"]))


def rpc_rows(baseline: Path, sizes: tuple[BatchSize, ...], runs: int, trees) -> list[Row]:
    rows = []
    with running(trees, *SERVER_ARGS, workers=2) as servers:
        stubs = [planner_stub(server.address) for server in servers]
        try:
            for size in sizes:
                times: list[list[float]] = [[] for _ in stubs]
                for k in range(runs + 1):  # the first run warms both servers up, not reported
                    message = request_to_proto(make_request(DISTRIBUTION, size, seed=k, scheduler=SchedulerKind.AUTO))
                    answers = {}
                    for i in alternating(range(len(stubs)), k):
                        started = time.perf_counter()
                        answers[i] = stubs[i][1].Plan(message, timeout=1800, metadata=job_metadata("bench"))
                        if k:
                            times[i].append(time.perf_counter() - started)
                    assert answers[0].SerializeToString(deterministic=True) == answers[1].SerializeToString(deterministic=True), (
                        f"the servers answered {size.label} seed {k} differently")
                    print(f"auto_transfer: rpc {size.label} seed {k}: " + ", ".join(f"{t[-1]:.3f} s" for t in times if t), flush=True)
                rows.append(Row("rpc", size, Spread.of(times[0]), Spread.of(times[1])))
        finally:
            for channel, _ in stubs:
                channel.close()
    return rows


def run(out: Path, smoke: bool = False, baseline: Path | None = None, runs: int = RUNS) -> Report[Row]:
    sizes, runs = (SMOKE_SIZES, SMOKE_RUNS) if smoke else (SIZES, runs)
    rows = handler_rows(sizes, runs)
    sections = [("The handler's work per auto request, in this process", markdown_table(
        ["samples on ranks", "runs", "every candidate's plan loaded, ms p50 (min..max)", "served plan's micro-batches only, ms p50 (min..max)",
         "served-only / every p50"],
        [[r.size.label, r.first.runs, r.first.fmt(1e3), r.second.fmt(1e3), spread_ratios(r.second, r.first)[0]] for r in rows],
    ))]
    intro = __doc__.split("\n\n", 1)[1].strip()
    if baseline is not None:
        trees = side_by_side_trees(baseline)
        rpc = rpc_rows(baseline, sizes, runs, trees)
        rows += rpc
        sections.append(("auto Plan RPC, this tree vs the baseline (2 workers each)", markdown_table(
            ["samples on ranks", "runs", "new s p50 (min..max)", "baseline s p50 (min..max)", "new / baseline p50", "new / baseline p99"],
            [[r.size.label, r.first.runs, r.first.fmt(), r.second.fmt(), *spread_ratios(r.first, r.second)] for r in rpc],
        )))
        intro += "\n\n" + side_by_side_intro(trees)
    name = "auto_transfer" + ("_smoke" if smoke else "")
    return write_report(out, name, "auto assembled in the core: what it costs the server", intro, sections, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: its server's auto RPC side by side")
    parser.add_argument("--runs", type=int, default=RUNS)
    args = parser.parse_args(argv)
    print(run(args.out, args.smoke, args.baseline, args.runs).path.read_text())


if __name__ == "__main__":
    main()
