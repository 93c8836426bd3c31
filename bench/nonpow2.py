"""Dynamic CP on DPxCP sizes that are not a power of two, next to their power-of-two neighbours, in process.

    python -m bench.nonpow2 --out docs/bench

For DPxCP 12, 24, 48 and 96 (and 8, 16, 32, 64, 128 beside them), the four distributions of
batch_planner/distributions.py, 1, 2 and 4 samples per rank, a per-rank budget of 8,192 tokens and
the job's CP 2, a few seeded batches each:

- how often dynamic CP serves upstream's own plan, and how often the substitute (by reason) or a
  refusal (a sample longer than the largest power-of-two CP group can hold);
- auto's predicted step cost with and without dynamic CP among its candidates (`auto_schedulers`
  of hybrid CP and static packing only): the ratio without / with, geometric mean and largest;
- the median time of one dynamic-CP plan (the exact path, the whole pipeline), as a ratio to the
  power-of-two neighbour below;
- hybrid CP, measured only (it is still refused on these sizes): on how many of the same batches
  Megatron-Core's BalancedCPScheduler returns a plan that keeps every invariant, with the layout
  refusal bypassed for the measurement.

The cost model is deterministic; the latencies are medians of the same batches planned one after
another in one process, on a shared machine: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from batch_planner import validation
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.errors import PlanningError
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from bench.common import Bar, argument_parser, markdown_table, write_report

NON_POWERS_OF_TWO = (12, 24, 48, 96)
NEIGHBOURS = {12: (8, 16), 24: (16, 32), 48: (32, 64), 96: (64, 128)}
SAMPLES_PER_RANK = (1, 2, 4)
PER_RANK = 8192
JOB_CP = 2
SEEDS = 5
WITHOUT_DYNAMIC = (SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING)


@dataclass(frozen=True)
class SizeRow:
    dp_cp: int
    batches: int
    upstream: int  # dynamic CP served upstream's own plan
    substitutes: dict[str, int]  # by reason
    refused: int
    auto_ratio_geomean: float  # auto's predicted cost without dynamic CP / with it
    auto_ratio_max: float
    auto_dynamic_wins: int  # batches where auto served a dynamic-CP plan
    plan_ms: float  # median of one dynamic-CP plan
    hybrid_valid: int  # hybrid CP's plan keeps every invariant (layout refusal bypassed)


def _request(distribution: str, dp_cp: int, per_rank_samples: int, seed: int, **options) -> PlanRequest:
    lengths = tuple(sample_lengths(distribution, dp_cp * per_rank_samples, seed=1000 * dp_cp + seed))
    return PlanRequest.of(lengths, dp_cp // JOB_CP, JOB_CP, PER_RANK, **options)


def hybrid_plan_is_valid(request: PlanRequest) -> bool:
    """Whether hybrid CP's own plan of the batch keeps every invariant, measured with the layout
    refusal bypassed (validation's other rules still apply)."""
    original = validation.layout_refusal
    validation.layout_refusal = lambda *args, **kwargs: None
    try:
        plan_batch(request.replace(scheduler=SchedulerKind.HYBRID_CP, min_cp_size=None))
        return True
    except PlanningError:
        return False
    finally:
        validation.layout_refusal = original


def measure(dp_cp: int, seeds: int) -> SizeRow:
    outcomes: Counter[str] = Counter()
    ratios: list[float] = []
    seconds: list[float] = []
    dynamic_wins = hybrid_valid = 0
    for distribution in DISTRIBUTIONS:
        for per_rank_samples in SAMPLES_PER_RANK:
            for seed in range(seeds):
                request = _request(distribution, dp_cp, per_rank_samples, seed, scheduler=SchedulerKind.DYNAMIC_CP)
                started = time.perf_counter()
                try:
                    plan = plan_batch(request)
                except PlanningError as refused:
                    outcomes[f"refused {refused.code.value}"] += 1
                    continue
                seconds.append(time.perf_counter() - started)
                outcomes[plan.substitution.reason.value if plan.substitution else "upstream"] += 1
                with_dynamic = plan_batch(request.replace(scheduler=SchedulerKind.AUTO))
                without = plan_batch(request.replace(scheduler=SchedulerKind.AUTO, auto_schedulers=WITHOUT_DYNAMIC))
                ratios.append(without.statistics.predicted_step_cost / with_dynamic.statistics.predicted_step_cost)
                dynamic_wins += with_dynamic.scheduler is SchedulerKind.DYNAMIC_CP
                hybrid_valid += hybrid_plan_is_valid(request)
    refused = sum(n for key, n in outcomes.items() if key.startswith("refused"))
    return SizeRow(
        dp_cp, sum(outcomes.values()), outcomes["upstream"],
        {key: n for key, n in sorted(outcomes.items()) if key not in ("upstream",) and not key.startswith("refused")},
        refused,
        math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else float("nan"),
        max(ratios, default=float("nan")), dynamic_wins,
        1e3 * statistics.median(seconds) if seconds else float("nan"), hybrid_valid,
    )


def run(out: Path, smoke: bool = False):
    sizes = (12, 8, 16) if smoke else sorted({*NON_POWERS_OF_TWO, *(n for pair in NEIGHBOURS.values() for n in pair)})
    seeds = 1 if smoke else SEEDS
    plan_batch(_request("megatron_dcp", 8, 2, 0, scheduler=SchedulerKind.AUTO))  # imports paid before any timing
    started = time.perf_counter()
    rows = {size: measure(size, seeds) for size in sizes}
    took = time.perf_counter() - started
    table_rows = []
    for size in sorted(rows):
        r = rows[size]
        below = max((n for n in rows if n < size and n & (n - 1) == 0), default=None)
        latency = f"{r.plan_ms:.1f}" + (f" ({r.plan_ms / rows[below].plan_ms:.2f}x DPxCP {below}'s)" if below and size & (size - 1) else "")
        substitutes = sum(r.substitutes.values())
        table_rows.append([
            f"**{size}**" if size & (size - 1) else size, r.batches, r.upstream,
            f"{substitutes} ({', '.join(f'{k} {n}' for k, n in r.substitutes.items()) or '-'})", r.refused,
            f"{r.auto_ratio_geomean:.3f}", f"{r.auto_ratio_max:.3f}", f"{r.auto_dynamic_wins} of {r.batches - r.refused}", latency,
            f"{r.hybrid_valid} of {r.batches - r.refused}",
        ])
    table = markdown_table(
        ["DPxCP", "batches", "dynamic CP: upstream's plan", "dynamic CP: substitute (by reason)", "refused",
         "auto without / with dynamic CP (geomean)", "(largest)", "auto served dynamic CP", "one dynamic-CP plan, median ms",
         "hybrid CP's plan valid (measured, not served)"],
        table_rows,
    )
    non_pow2 = [rows[s] for s in rows if s & (s - 1)]
    planned = sum(r.batches - r.refused for r in non_pow2)
    substituted = sum(sum(r.substitutes.values()) for r in non_pow2)
    bars = (
        Bar("substitute share on 12-96 ranks", "at most 10 % of the planned batches", substituted <= 0.10 * max(planned, 1)),
        Bar("auto gains from dynamic CP on 12-96 ranks", "geomean ratio above 1.0 on every size",
            all(r.auto_ratio_geomean > 1.0 for r in non_pow2)),
    )
    intro = (
        __doc__.split("\n\n", 2)[2].strip()
        + f"\n\n{seeds} seed(s) x {len(DISTRIBUTIONS)} distributions x {len(SAMPLES_PER_RANK)} densities per size; "
        f"the run took {took:.0f} s. Sizes in bold are not powers of two."
    )
    return write_report(
        out, "nonpow2" + ("_smoke" if smoke else ""), "Dynamic CP on DPxCP that is not a power of two", intro,
        [("Results", table)], rows=[rows[s] for s in sorted(rows)], bars=bars,
    )


if __name__ == "__main__":
    args = argument_parser(__doc__.splitlines()[0]).parse_args()
    print(run(args.out, args.smoke).path.read_text())
