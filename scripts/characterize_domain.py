"""Which layouts each Megatron-Core scheduler plans: the sweep behind batch_planner/domain.py.

For every scheduler the installed build has, and every DPxCP size of the sweep, plans a few hundred
small seeded batches (few and many samples, long-tail lengths, with and without VPP grouping and a
minimum CP size) straight through the scheduler adapter, bypassing validation, and records every
failure: an exception of Megatron-Core's (IndexError, AssertionError ...), a loop (the exact
dynamic-CP path raises SchedulerWouldNotTerminate where upstream's code would loop for ever; a call
of upstream's own code that runs past --timeout is killed and counted as a loop) and a plan that
breaks a plan invariant (docs/design.md, Plan invariants). A scheduler plans every batch of a
layout only where no batch failed on it (`accepted_sizes`); of the others, those batch_planner/domain.py
plans batch by batch (dynamic CP: every even size) are listed as `substitute_sizes`: there the
planner serves upstream's plan where it is valid and the named substitute where it fails.

Each batch runs in a child process that streams one JSON line per case, so a looping upstream call
(which no thread can interrupt) costs one killed child, not the sweep.

    python scripts/characterize_domain.py --out docs/domain/dev.json            # the venv's build
    PYTHONPATH=<0.19.2 overlay> python scripts/characterize_domain.py --out docs/domain/0.19.2.json

The output lists, per scheduler and option class, the sizes swept, the sizes where some batch
failed (with one example and the reasons seen) and the counts; tests/batch_planner/test_scheduler_domain.py
checks batch_planner/domain.py against it. Deterministic: the same seed gives the same batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's batch_planner, not an installed one

# Option classes: what a layout is accepted for. VPP grouping (micro_batch_group_size > 1) runs
# another upstream function (align_sample_id_groups), so it is a class of its own.
NO_VPP, VPP = "no_vpp", "vpp"
# Upstream's own bounded refusal of a batch on a layout it plans (batch_planner.domain.BATCH_LIMITS):
# counted, but it does not make the layout fail.
BATCH_LIMIT = "batch limit"


def layout_failure(outcome: str) -> bool:
    return outcome != "ok" and not outcome.startswith(BATCH_LIMIT)


def sweep_sizes(kind: str, exhaustive_up_to: int, top: int, seed: int) -> list[int]:
    """Even DPxCP sizes: every one up to `exhaustive_up_to`, then powers of two, 3, 5 and 7 times a
    power of two, and seeded random even sizes, up to `top`."""
    sizes = set(range(2, min(exhaustive_up_to, top) + 1, 2))
    for odd in (1, 3, 5, 7):
        k = 1
        while odd * k <= top:
            if odd * k >= 2 and (odd * k) % 2 == 0:
                sizes.add(odd * k)
            k *= 2
    rng = random.Random(f"{seed}-{kind}-sizes")
    sizes.update(rng.randrange(exhaustive_up_to + 2, top + 1, 2) for _ in range(40) if exhaustive_up_to + 2 <= top)
    return sorted(sizes)


def make_cases(kind: str, size: int, per_class: int, seed: int) -> list[dict]:
    """`per_class` batches per option class on `size` DPxCP ranks, as plain dicts."""
    from batch_planner.cp_groups import is_power_of_two, largest_power_of_two_group, megatron_cp_group_sizes

    rng = random.Random(f"{seed}-{kind}-{size}")
    classes = [NO_VPP, VPP] if kind in ("dynamic_cp", "static_packing") else [NO_VPP]
    cases = []
    for option_class in classes:
        for index in range(per_class):
            per_rank = rng.choice([1024, 2048, 4096, 8192] * 3 + [7, 100, 32768])
            group_size = None
            if option_class == VPP:
                group_size = rng.choice([2, 2, 3, 4, 4, 5, 6, 7, 8, 8, 14, 54])
            elif rng.random() < 0.2:
                group_size = 1  # VPP of one group: no alignment, the no-VPP path
            band = rng.random()
            count = rng.randint(1, 4) if band < 0.25 else rng.randint(5, 32) if band < 0.65 else rng.randint(33, 256)
            case = dict(kind=kind, size=size, option_class=option_class, index=index, per_rank=per_rank,
                        micro_batch_group_size=group_size, min_cp_size=None, max_seqs=None, dp=size, cp=1)
            if kind == "dynamic_cp":
                capacity = per_rank * largest_power_of_two_group(size)
                if rng.random() < 0.25:
                    buildable = sorted(s for s in megatron_cp_group_sizes(size) if is_power_of_two(s))
                    case["min_cp_size"] = rng.choice(buildable)
                if group_size:
                    count = max(count, group_size)  # validation's bound: a micro-batch needs a sample
            elif kind == "hybrid_cp":
                capacity = per_rank * size
            else:  # static packing: a DP x CP split of the size, capacity per micro-batch is per_rank x CP
                cps = [c for c in (1, 2, 4, 8) if size % c == 0]
                case["cp"] = rng.choice(cps)
                case["dp"] = size // case["cp"]
                capacity = per_rank * case["cp"]
                if rng.random() < 0.3:
                    case["max_seqs"] = rng.choice([1, 1, 2, 3, 8])
                count = max(count, case["dp"] * (group_size or 1))  # validation's bound
                count = min(count, 4 * case["dp"] * (group_size or 1) + 64)
            median = per_rank * rng.choice([0.05, 0.2, 0.5, 1.0, 2.0])
            sigma = rng.choice([0.5, 1.0, 1.5, 2.0])
            case["lengths"] = [max(1, min(capacity, int(rng.lognormvariate(math.log(max(1.0, median)), sigma))))
                               for _ in range(count)]
            cases.append(case)
    return cases


def run_case(case: dict) -> dict:
    """Plans one case through the adapter (no validation); returns what happened."""
    from batch_planner.domain import batch_limit
    from batch_planner.errors import InvariantViolationError, SchedulerWouldNotTerminate
    from batch_planner.padding import PlanPadding
    from batch_planner.plan import MicroBatch, Plan, check_plan_invariants, groups_from_rank_assignment
    from batch_planner.request import PlanRequest, SchedulerKind
    from batch_planner.schedulers import _RUNNERS, SCHEDULER_SPECS, _load_class, valid_cp_sizes

    kind = SchedulerKind(case["kind"])
    request = PlanRequest.of(
        case["lengths"], case["dp"], case["cp"], case["per_rank"], scheduler=kind,
        micro_batch_group_size=case["micro_batch_group_size"], min_cp_size=case["min_cp_size"],
        max_seqs_per_micro_batch=case["max_seqs"],
    )
    seqlens = list(enumerate(request.sequence_lengths))
    started = time.perf_counter()
    try:
        assignment = _RUNNERS[kind](_load_class(kind), request, seqlens, None)  # None: this process's implementation
        padding = PlanPadding.for_request(request)
        micro_batches = tuple(MicroBatch(groups_from_rank_assignment(r, padding)) for r in assignment)
        spec = SCHEDULER_SPECS[kind]
        plan = Plan("", kind, spec.class_name, "", request.dp_cp_size, 1, request.cp_layout, spec.capacity_bound, micro_batches)
        check_plan_invariants(plan, request, valid_cp_sizes(kind, request.dp_cp_size, request.context_parallel_size, request.min_cp_size))
        outcome = "ok"
    except SchedulerWouldNotTerminate:
        outcome = "loops"
    except InvariantViolationError as exc:
        outcome = f"invariant {exc.invariant}"
    except Exception as exc:  # noqa: BLE001 - what upstream raises is what we record
        limit = batch_limit(kind, exc)
        if limit is not None:
            outcome = f"{BATCH_LIMIT}: {limit.upstream_message}"
        else:
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return {"outcome": outcome, "seconds": round(time.perf_counter() - started, 4)}


def child_main() -> None:
    """Reads cases (one JSON per line) on stdin, answers one JSON line each on stdout."""
    import warnings

    warnings.simplefilter("ignore")
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps(run_case(case)), flush=True)


def run_all(cases: list[dict], timeout: float, env: dict, enough_failures: int) -> list[dict | None]:
    """Runs `cases` in a child process; a case past `timeout` kills the child ("loops") and a new
    child carries on with the next case. Once a size and option class has `enough_failures`
    failures, its other cases are skipped (None): one failure already refuses the layout."""
    results: list[dict | None] = []
    failures: Counter = Counter()
    position = 0

    def skip_decided() -> None:
        nonlocal position
        while position < len(cases) and failures[(cases[position]["size"], cases[position]["option_class"])] >= enough_failures:
            results.append(None)
            position += 1

    def record(result: dict) -> None:
        results.append(result)
        if layout_failure(result["outcome"]):
            failures[(cases[position]["size"], cases[position]["option_class"])] += 1

    skip_decided()
    while position < len(cases):
        child = subprocess.Popen(
            [sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
        )
        assert child.stdin is not None and child.stdout is not None
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(child.stdout, selectors.EVENT_READ)
        first_case = True
        while position < len(cases):
            child.stdin.write(json.dumps(cases[position]) + "\n")
            child.stdin.flush()
            # The first case of a child pays Megatron-Core's import.
            if not selector.select(timeout + (120 if first_case else 0)):
                child.kill()
                child.wait()
                record({"outcome": "loops", "seconds": timeout})
                position += 1
                skip_decided()
                break
            line = child.stdout.readline()
            if not line:
                record({"outcome": "child died", "seconds": 0.0})
                position += 1
                skip_decided()
                break
            record(json.loads(line))
            position += 1
            skip_decided()
            first_case = False
        else:
            child.stdin.close()
            child.wait()
        selector.close()
    return results


def substitute_sizes(kind, failing: dict) -> list[int]:
    """The failing sizes planned batch by batch (batch_planner.domain, `per_batch`): there the
    planner serves upstream's plan of each batch where it is valid, the named substitute elsewhere."""
    from batch_planner.domain import per_batch

    return sorted(int(size) for size in failing if per_batch(kind, int(size)))


def render(report: dict) -> str:
    """The report as JSON, lists of numbers on one line each (diffs stay readable)."""
    import re

    text = json.dumps(report, indent=1, sort_keys=True)
    return re.sub(r"\[\s*([-0-9.,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--schedulers", default="dynamic_cp,hybrid_cp,static_packing")
    parser.add_argument("--top", type=int, default=1024, help="largest DPxCP size swept")
    parser.add_argument("--exhaustive-up-to", type=int, default=1024, help="every even size up to this one")
    parser.add_argument("--per-class", type=int, default=150, help="batches per size and option class")
    parser.add_argument("--per-class-large", type=int, default=60, help="... on sizes past --large")
    parser.add_argument("--large", type=int, default=256)
    parser.add_argument("--enough-failures", type=int, default=10, help="failures after which a size's class is decided")
    parser.add_argument("--jobs", type=int, default=2, help="child processes at once")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before one call counts as a loop")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--sizes", default="", help="comma-separated DPxCP sizes instead of the sweep's")
    args = parser.parse_args()
    if args.child:
        child_main()
        return
    from batch_planner.schedulers import discover_schedulers, megatron_core_version
    from batch_planner.exact.verified import exact_path_status
    from batch_planner.request import SchedulerKind

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    report: dict = {"megatron_core": megatron_core_version(), "seed": args.seed, "per_class": args.per_class,
                    "timeout_seconds": args.timeout, "schedulers": {}}
    for name in args.schedulers.split(","):
        kind = SchedulerKind(name)
        if not discover_schedulers()[kind].available:
            report["schedulers"][name] = {"available": False}
            continue
        exhaustive = args.exhaustive_up_to if kind is not SchedulerKind.HYBRID_CP else min(args.exhaustive_up_to, 64)
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else sweep_sizes(name, exhaustive, args.top, args.seed)
        started = time.monotonic()
        by_class: dict[str, dict] = defaultdict(lambda: {"sizes": [], "failing": {}, "outcomes": Counter(),
                                                          "slowest_seconds": 0.0})
        cases = [case for size in sizes for case in make_cases(
            name, size, args.per_class if size <= args.large else args.per_class_large, args.seed)]
        # Sizes dealt round-robin to the children; each child's cases stay grouped by size.
        shares = [[c for c in cases if sizes.index(c["size"]) % args.jobs == j] for j in range(args.jobs)]
        answers: list = [None] * args.jobs

        def drive(j: int, shares=shares, answers=answers) -> None:
            answers[j] = run_all(shares[j], args.timeout, env, args.enough_failures)

        threads = [threading.Thread(target=drive, args=(j,)) for j in range(args.jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pairs = [(case, result) for j in range(args.jobs) for case, result in zip(shares[j], answers[j])]
        pairs.sort(key=lambda pair: (pair[0]["size"], pair[0]["option_class"], pair[0]["index"]))
        for case, result in pairs:
            entry = by_class[case["option_class"]]
            size = case["size"]
            if not entry["sizes"] or entry["sizes"][-1] != size:
                entry["sizes"].append(size)
            if result is None:
                entry["outcomes"]["skipped (size decided)"] += 1
                continue
            outcome = result["outcome"]
            entry["outcomes"][outcome.split(":")[0]] += 1
            entry["slowest_seconds"] = max(entry["slowest_seconds"], result["seconds"])
            if layout_failure(outcome):
                failing = entry["failing"].setdefault(str(size), {"failures": 0, "reasons": Counter(), "example": None})
                failing["failures"] += 1
                failing["reasons"][outcome] += 1
                if failing["example"] is None:
                    failing["example"] = {k: case[k] for k in ("dp", "cp", "per_rank", "micro_batch_group_size",
                                                               "min_cp_size", "max_seqs", "lengths")}
        report["schedulers"][name] = {
            "available": True,
            "implementation": exact_path_status(kind).implementation.value,
            "sweep_seconds": round(time.monotonic() - started, 1),
            "classes": {
                option_class: {
                    "sizes": entry["sizes"],
                    "accepted_sizes": [s for s in entry["sizes"] if str(s) not in entry["failing"]],
                    "substitute_sizes": substitute_sizes(kind, entry["failing"]),
                    "outcomes": dict(sorted(entry["outcomes"].items())),
                    "slowest_seconds": entry["slowest_seconds"],
                    "failing": {s: {"failures": f["failures"], "reasons": dict(f["reasons"]), "example": f["example"]}
                                for s, f in entry["failing"].items()},
                }
                for option_class, entry in by_class.items()
            },
        }
        ran = sum(r is not None for a in answers for r in a)
        print(f"{name}: {ran} of {len(cases)} batches on {len(sizes)} sizes in {time.monotonic() - started:.0f} s", file=sys.stderr)
    text = render(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
