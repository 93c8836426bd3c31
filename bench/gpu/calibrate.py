"""Fits the cost model's coefficients to the GPU benchmark's per-micro-batch timings.

    python -m bench.gpu.calibrate --run RESULTS_JSON PLANS_JSON [--run ...] \
        --json docs/gpu-benchmark-data/calibration.json --plot docs/img/gpu-benchmark.png

Each row is one rank's busy time in one micro-batch (median over the timed steps), with the cost
model's features of the CP group it ran (batch_planner.cost.unit_features: padded tokens per rank,
L^2 / c, CP communication tokens P (c - 1) / c, CP passes, and the number of forward+backward
passes, one per sample under hybrid CP, one per pack under static CP). The fit is the trainer's
calibration fit (batch_planner.cost_fit.fit_cost_model: non-negative, relative, robust).

One difference from unit_features, this engine's: the fixed CP term is counted per *sequence* on a
CP group, also inside a packed pass: PyTorch's ring attention has no variable-length (THD) mode, so
a packed pass makes one ring call per sequence and layer, and that is where the fixed cost lies.
The pass term is counted per pass.
A step is predicted the way the engine runs it: with a barrier between micro-batches (hybrid CP)
the sum over micro-batches of the slowest rank; without one (static CP) the slowest rank's sum.
The planner's own statistics (`step_cost`, `static_cp_step_cost`: fixed CP term once per pass, as
with Megatron-Core + Transformer Engine's THD ring attention) are reported beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

import numpy as np

from batch_planner.cost import static_cp_step_cost, unit_features
from batch_planner.cost_spec import COEFFICIENT_NAMES, TOY_ENGINE_COEFFICIENTS, CostModel
from batch_planner.plan import CpGroup
from batch_planner.padding import padded_length
from batch_planner.request import CpLayout, PlanRequest
from bench.gpu.plans import BenchPlan, plan_from_json
from batch_planner.cost_fit import fit_cost_model

PLAN_ORDER = ("hybrid_cp", "static_cp2", "static_cp1")


def group_features(lengths: list[int], cp_size: int, passes: int) -> list[float]:
    padded = sum(padded_length(n, cp_size, 1, CpLayout.ZIGZAG) for n in lengths)
    features = unit_features(padded, sum(n * n for n in lengths), cp_size, passes)
    if cp_size > 1:  # one ring call per sequence: this engine's fixed CP cost (module doc)
        features["cp_seconds_per_micro_batch"] = float(len(lengths))
    return [features[name] for name in COEFFICIENT_NAMES]


def plan_group_features(plan: BenchPlan, lengths: list[int], group: CpGroup) -> list[float]:
    group_lengths = [lengths[i] for i in group.sample_ids]
    passes = len(group_lengths) if plan.pass_per_sample else 1
    return group_features(group_lengths, group.size, passes)


def coefficients(model: CostModel) -> np.ndarray:
    return np.array([getattr(model, name) for name in COEFFICIENT_NAMES])


def load_run(results_path: str, plans_path: str) -> tuple[dict, list[dict]]:
    with open(results_path) as f:
        results = json.load(f)
    with open(plans_path) as f:
        batches = json.load(f)
    for batch in batches:
        batch["key"] = f"{batch['name']} (max {batch['max_seqlen_per_dp_cp_rank'] // 1024}K/rank)"
        batch["plans"] = [plan_from_json(p) for p in batch["plans"]]
    return results, batches


def micro_batch_rows(results: dict, batches: list[dict]) -> list[dict]:
    by_name = {b["name"]: b for b in batches}
    samples: dict[tuple, list[float]] = {}
    meta: dict[tuple, dict] = {}
    for run in results["runs"]:
        batch = by_name[run["batch"]]
        plan = next(p for p in batch["plans"] if p.name == run["plan"])
        for mb in run["micro_batches"]:
            key = (batch["key"], run["plan"], run["rank"], mb["index"])
            samples.setdefault(key, []).append(mb["busy_seconds"])
            lengths = [batch["lengths"][i] for i in mb["sample_ids"]]
            passes = len(lengths) if plan.pass_per_sample else 1
            meta[key] = {"features": group_features(lengths, mb["cp_size"], passes), "cp_size": mb["cp_size"]}
    return [
        {"batch": k[0], "plan": k[1], "rank": k[2], "micro_batch": k[3], **meta[k], "seconds": statistics.median(v)}
        for k, v in samples.items()
    ]


def fit(rows: list[dict]) -> CostModel:
    result = fit_cost_model(np.array([r["features"] for r in rows]), np.array([r["seconds"] for r in rows]), TOY_ENGINE_COEFFICIENTS, len(COEFFICIENT_NAMES))
    if result.model is None:
        raise SystemExit(f"the fit refused these timings: {result.result} ({result.reason})")
    return result.model


def plan_table(results: dict, batches: list[dict], model: CostModel) -> list[dict]:
    table = []
    for batch in batches:
        tokens = sum(batch["lengths"])
        rows = {}
        for plan in batch["plans"]:
            steps: dict[int, float] = {}
            for run in results["runs"]:
                if run["batch"] == batch["name"] and run["plan"] == plan.name:
                    steps[run["repeat"]] = max(steps.get(run["repeat"], 0.0), run["step_seconds"])
            times = sorted(steps.values())
            rows[plan.name] = {
                "batch": batch["key"],
                "plan": plan.name,
                "tokens": tokens,
                "measured_seconds": statistics.median(times),
                "min_seconds": times[0],
                "max_seconds": times[-1],
                "tokens_per_second": tokens / statistics.median(times),
                "predicted_seconds": engine_prediction(plan, batch["lengths"], model),
                "planner_step_cost": plan.predicted_seconds(model),
                "micro_batches": len(plan.micro_batches),
            }
        static = rows["static_cp2"]
        planner_static = static_cp_step_cost(
            PlanRequest.of(tuple(batch["lengths"]), 1, 2, batch["max_seqlen_per_dp_cp_rank"]), model
        )
        measured_order = sorted(rows, key=lambda n: rows[n]["measured_seconds"])
        predicted_order = sorted(rows, key=lambda n: rows[n]["predicted_seconds"])
        for name in PLAN_ORDER:
            row = rows[name]
            row["measured_speedup_vs_static_cp2"] = static["measured_seconds"] / row["measured_seconds"]
            row["predicted_speedup_vs_static_cp2"] = static["predicted_seconds"] / row["predicted_seconds"]
            # What the planner's own statistic predicted_speedup_over_static_cp would say.
            row["planner_statistic_speedup_vs_static_cp2"] = planner_static / row["planner_step_cost"]
            row["measured_order"] = measured_order
            row["predicted_order"] = predicted_order
            row["ranking_agrees"] = measured_order == predicted_order
            table.append(row)
    return table


def engine_prediction(plan: BenchPlan, lengths: list[int], model: CostModel) -> float:
    """The step as bench/gpu/execute.py runs it on PyTorch's ring attention (module doc)."""
    coeffs = coefficients(model)
    per_rank = [
        [float(np.dot(plan_group_features(plan, lengths, g), coeffs)) if g is not None else 0.0
         for g in plan.rank_schedule(rank)]
        for rank in range(plan.dp_cp_size)
    ]
    if plan.barrier_between_micro_batches:
        return sum(max(column) for column in zip(*per_rank))
    return max(sum(row) for row in per_rank)


def ranking_agreement(table: list[dict]) -> tuple[int, int]:
    """(batches whose full measured order of the plans the model reproduces, batches)."""
    verdicts = {r["batch"]: r["ranking_agrees"] for r in table}
    return sum(verdicts.values()), len(verdicts)


def bar_summary(table: list[dict]) -> dict:
    hybrid = [r for r in table if r["plan"] == "hybrid_cp"]
    errors = [r["predicted_speedup_vs_static_cp2"] / r["measured_speedup_vs_static_cp2"] - 1 for r in hybrid]
    agree, total = ranking_agreement(table)
    return {
        "hybrid_speedup_vs_static_cp2_min": min(r["measured_speedup_vs_static_cp2"] for r in hybrid),
        "hybrid_speedup_vs_static_cp2_max": max(r["measured_speedup_vs_static_cp2"] for r in hybrid),
        "hybrid_prediction_error_min": min(errors),
        "hybrid_prediction_error_max": max(errors),
        "hybrid_predictions_within_15_percent": sum(abs(e) <= 0.15 for e in errors),
        "batches": total,
        "full_ranking_agrees": agree,
    }


def markdown(table: list[dict]) -> str:
    lines = [
        "| batch | plan | tokens/s | step ms (median, min-max) | predicted ms | vs static CP2 measured "
        "| predicted | error | order right |",
        "|---|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in table:
        error = r["predicted_speedup_vs_static_cp2"] / r["measured_speedup_vs_static_cp2"] - 1
        order = ("yes" if r["ranking_agrees"] else "no") if r["plan"] == PLAN_ORDER[0] else ""
        lines.append(
            f"| {r['batch']} | {r['plan']} | {r['tokens_per_second']:,.0f} | {r['measured_seconds'] * 1e3:.0f} "
            f"({r['min_seconds'] * 1e3:.0f}-{r['max_seconds'] * 1e3:.0f}) | {r['predicted_seconds'] * 1e3:.0f} "
            f"| {r['measured_speedup_vs_static_cp2']:.2f}x "
            f"| {r['predicted_speedup_vs_static_cp2']:.2f}x | {error:+.0%} | {order} |"
        )
    agree, total = ranking_agreement(table)
    lines.append(f"\nfull order of the three plans right on {agree} of {total} batches")
    return "\n".join(lines)


def plot(table: list[dict], rows: list[dict], model: CostModel, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2.2, 1]})
    batches = list(dict.fromkeys(r["batch"] for r in table))
    plans = list(dict.fromkeys(r["plan"] for r in table))
    width = 0.8 / len(plans)
    for i, plan in enumerate(plans):
        sel = [next(r for r in table if r["batch"] == b and r["plan"] == plan) for b in batches]
        xs = np.arange(len(batches)) + i * width
        tps = np.array([r["tokens_per_second"] for r in sel]) / 1e3
        low = tps - np.array([r["tokens"] / r["max_seconds"] for r in sel]) / 1e3
        high = np.array([r["tokens"] / r["min_seconds"] for r in sel]) / 1e3 - tps
        ax1.bar(xs, tps, width, yerr=[low, high], capsize=2, label=plan)
        pred = np.array([r["tokens"] / r["predicted_seconds"] for r in sel]) / 1e3
        ax1.scatter(xs, pred, marker="_", s=200, color="black", zorder=3, label="predicted" if i == 0 else None)
    ax1.set_xticks(np.arange(len(batches)) + 0.4 - width / 2)
    ax1.set_xticklabels([b.replace(" (", "\n(") for b in batches], fontsize=7, rotation=30, ha="right")
    ax1.set_ylabel("thousand tokens / s (2x H200, median of timed steps; bars: min-max)")
    ax1.set_title("Throughput per plan; black marks: calibrated cost model")
    ax1.legend(fontsize=8)
    measured = np.array([r["seconds"] for r in rows]) * 1e3
    features = np.array([r["features"] for r in rows])
    coeffs = coefficients(model)
    predicted = features @ coeffs * 1e3
    for plan in plans:
        sel = [i for i, r in enumerate(rows) if r["plan"] == plan]
        ax2.scatter(measured[sel], predicted[sel], s=10, label=plan)
    top = max(measured.max(), predicted.max()) * 1.05
    ax2.plot([0, top], [0, top], color="grey", lw=1)
    ax2.set_xlabel("measured busy ms per rank and micro-batch")
    ax2.set_ylabel("cost model ms")
    ax2.set_title("Per-micro-batch fit")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs=2, action="append", required=True, metavar=("RESULTS", "PLANS"))
    parser.add_argument("--json", help="write coefficients, per-plan table and fit rows here")
    parser.add_argument("--plot", help="write the PNG here")
    args = parser.parse_args(argv)
    runs = [load_run(r, p) for r, p in args.run]
    rows = [row for results, batches in runs for row in micro_batch_rows(results, batches)]
    model = fit(rows)
    table = [row for results, batches in runs for row in plan_table(results, batches, model)]
    # Each run on its own, and each run predicted by coefficients fitted on the other runs only:
    # how much of the fit carries from one machine to another of the same kind.
    per_run, holdout = [], []
    for i, (results, batches) in enumerate(runs):
        own = fit(micro_batch_rows(results, batches))
        per_run.append({"run": i + 1, "environment": results["environment"], "cost_model": asdict(own),
                        "bar": bar_summary(plan_table(results, batches, own))})
        if len(runs) > 1:
            others = fit([r for j, run in enumerate(runs) if j != i for r in micro_batch_rows(*run)])
            held = plan_table(results, batches, others)
            holdout.append({"run": i + 1, "cost_model": asdict(others), "plans": held, "bar": bar_summary(held)})
    print("calibrated:", json.dumps(asdict(model)))
    print(markdown(table))
    print("bar:", json.dumps(bar_summary(table)))
    for entry in per_run:
        print(f"run {entry['run']} fitted alone:", json.dumps(entry["cost_model"]), json.dumps(entry["bar"]))
    for entry in holdout:
        print(f"\nrun {entry['run']} held out (fitted on the other runs only):")
        print(markdown(entry["plans"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost_model": asdict(model), "bar": bar_summary(table), "plans": table,
                       "per_run": per_run, "holdout": holdout,
                       "environment": runs[0][0]["environment"], "config": runs[0][0]["config"],
                       "checks": runs[0][0]["checks"]}, f, indent=1)
    if args.plot:
        plot(table, rows, model, args.plot)


if __name__ == "__main__":
    main()
