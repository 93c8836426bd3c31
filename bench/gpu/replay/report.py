"""Replays plans on measured kernels, fits the cost model to the replay, and writes what a user reads
(docs/gpu-replay.md, docs/gpu-benchmark-data/replay/). CPU only.

    python -m bench.gpu.replay.report --measurements docs/gpu-benchmark-data/replay/kernels-h100.json \\
        --out docs/gpu-benchmark-data/replay [--models llama3-8b,llama3-70b] [--ranks 32,128,512] [link flags]

For each model with measurements (`measure.py`), distribution and DPxCP size: a batch of about
TOKENS_PER_RANK tokens a rank, planned by each of auto's candidates (Megatron-Core's dynamic CP,
hybrid CP and static CP at every size the layout allows, at auto's knobs) and by auto itself; each
plan replayed (`simulate.replay_step`: the fitted kernel clock of `clock.py`, the links of
`links.py`, the event simulation of every rank's timeline).

The cost model: the five coefficients fitted (batch_planner.cost_fit, the trainer's own fit) to the
replayed CP groups of the batches of seed FIT_SEED; the rows reported are of seed EVAL_SEED, which
the fit never saw. auto serves under the fitted coefficients. Writes:

- `summary.json`: one row per (model, distribution, ranks, scheduler) of the evaluated batches:
  `replayed_ms`, `predicted_ms_default` (the toy engine's coefficients, what a request got before),
  `predicted_ms_fitted`, `best_static_ms`, and more;
- `results.json`: everything, with the links, the clock's checks and the fits;
- `fitted.json`: the fitted coefficients per (model, GPU);
- `tables.md`: the tables docs/gpu-replay.md shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from batch_planner.auto import candidates
from batch_planner.cost import step_cost, unit_features
from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.cost_fit import fit_cost_model
from batch_planner.cost_spec import CALIBRATED_PRESET, COEFFICIENT_NAMES, CostModel
from batch_planner.distributions import sample_lengths
from batch_planner.errors import PlanningError
from batch_planner.planner import plan_batch
from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
from bench.gpu.replay.clock import FittedKernelClock
from bench.gpu.replay.links import LinkSpec, add_link_arguments, links_from_arguments
from bench.gpu.replay.passes import plan_passes
from bench.gpu.replay.shapes import RankShape
from bench.gpu.replay.simulate import group_seconds, replay_step

DISTRIBUTIONS = ("long_tail_16k", "lognormal_32k", "megatron_dcp", "rl_rollout_16k")
RANKS = (32, 128, 512)
JOB_CP = 4  # the job's own static CP size (what it runs without the planner)
MAX_SEQLEN = 8192  # max_seqlen_per_dp_cp_rank
TOKENS_PER_RANK = 3 * MAX_SEQLEN  # a global batch of about three micro-batches' worth a rank
EVAL_SEED, FIT_SEED = 0, 1
MIN_FIT_GROUPS = 50


def batch_lengths(distribution: str, ranks: int, seed: int) -> list[int]:
    """The first samples of the distribution's seeded draw whose lengths add up to
    TOKENS_PER_RANK x ranks tokens."""
    target = TOKENS_PER_RANK * ranks
    pool = sample_lengths(distribution, max(64, target // 64), seed)
    totals = np.cumsum(pool)
    return pool[: int(np.searchsorted(totals, target)) + 1]


def base_request(lengths: list[int], ranks: int, shape: RankShape) -> PlanRequest:
    return PlanRequest.of(lengths, ranks // JOB_CP, JOB_CP, MAX_SEQLEN, tensor_parallel_size=shape.tensor_parallel_size,
                          scheduler=SchedulerKind.AUTO)


def row_name(candidate_name: str) -> str:
    """The summary's scheduler name of an auto candidate: dynamic_cp and hybrid_cp at the request's
    own knobs, static_cpN; other knobs keep their candidate names."""
    name = candidate_name.replace(f" max_seqlen={MAX_SEQLEN}", "")
    return name


def plan_candidates(request: PlanRequest, toy: CostModel) -> dict[str, tuple]:
    """Each of auto's candidates: (its request, its plan) or (its request, why it has none)."""
    out = {}
    for candidate in candidates(request):
        try:
            out[candidate.name] = (candidate.request, plan_batch(candidate.request, cost_model=toy))
        except PlanningError as error:
            out[candidate.name] = (candidate.request, str(error).splitlines()[0])
    return out


def group_rows(plan, request: PlanRequest, lengths: list[int], clock, shape, links) -> tuple[list[list[float]], list[float]]:
    """Each CP group's cost-model features (batch_planner.cost.unit_features) and replayed seconds."""
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    features, seconds = [], []
    for micro_batch in plan_passes(plan, lengths):
        for work in micro_batch:
            padded = sum(sum(p.padded) for p in work.passes)
            squares = sum(n * n for p in work.passes for n in p.real)
            f = unit_features(padded, squares, work.cp_size, 1 if packed else len(work.passes))
            features.append([float(f[name]) for name in COEFFICIENT_NAMES])
            seconds.append(group_seconds(clock, shape, links, work))
    return features, seconds


def evaluate_batch(model: str, distribution: str, ranks: int, seed: int, clock, shape, links, toy: CostModel,
                   fitted: CostModel | None, log) -> dict:
    lengths = batch_lengths(distribution, ranks, seed)
    request = base_request(lengths, ranks, shape)
    started = time.monotonic()
    rows = {}
    for name, (concrete, plan) in plan_candidates(request, toy).items():
        if isinstance(plan, str):
            rows[name] = {"planned": False, "reason": plan}
            continue
        step = replay_step(clock, shape, links, plan_passes(plan, lengths), ranks)
        packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
        rows[name] = {
            "planned": True, "replayed_ms": step.event_seconds * 1e3, "barrier_ms": step.barrier_seconds * 1e3,
            "utilization": step.utilization, "micro_batches": len(plan.micro_batches),
            "predicted_ms_default": step_cost(plan.micro_batches, concrete, toy, packed) * 1e3,
            "predicted_ms_fitted": step_cost(plan.micro_batches, concrete, fitted, packed) * 1e3 if fitted else None,
        }
    out = {"model": model, "distribution": distribution, "ranks": ranks, "seed": seed, "samples": len(lengths), "tokens": sum(lengths),
           "candidates": rows}
    if fitted is not None:
        auto = plan_batch(request, cost_model=fitted)
        served = next(c.name for c in auto.candidates if c.served)
        step = replay_step(clock, shape, links, plan_passes(auto, lengths), ranks)
        out["auto"] = {"served": served, "replayed_ms": step.event_seconds * 1e3, "barrier_ms": step.barrier_seconds * 1e3,
                       "predicted_ms_fitted": auto.statistics.predicted_step_cost * 1e3}
        toy_auto = plan_batch(request, cost_model=toy)
        out["auto_default"] = {"served": next(c.name for c in toy_auto.candidates if c.served)}
    log(f"{model} {distribution} {ranks} seed {seed}: {len(lengths)} samples, {time.monotonic() - started:.1f} s")
    return out


def fit_model(model: str, clock, shape, links, toy: CostModel, ranks_list, log) -> tuple[CostModel, dict]:
    features, seconds = [], []
    for distribution in DISTRIBUTIONS:
        for ranks in ranks_list:
            lengths = batch_lengths(distribution, ranks, FIT_SEED)
            for concrete, plan in plan_candidates(base_request(lengths, ranks, shape), toy).values():
                if isinstance(plan, str):
                    continue
                f, s = group_rows(plan, concrete, lengths, clock, shape, links)
                features += f
                seconds += s
    result = fit_cost_model(np.array(features), np.array(seconds), toy, MIN_FIT_GROUPS, max_iterations=400)
    if result.model is None:
        raise RuntimeError(f"{model}: the cost model's fit failed: {result.result} ({result.reason})")
    log(f"{model}: fitted on {result.observations} distinct groups: {result.model}")
    return result.model, {"groups": len(seconds), "distinct": result.observations, "fitted_terms": list(result.fitted_terms),
                          "relative_error_scale": result.relative_error_scale}


def message_check(entry: dict, shape: RankShape) -> dict:
    """What the in-process stand-in recorded Transformer Engine's ring sending, against what the link
    model prices (`simulate.ring_transfers` x `simulate.kv_bytes`), per measured attention pass."""
    from bench.gpu.replay.simulate import kv_bytes, ring_transfers

    checked = mismatched = 0
    for a in entry["attention"]:
        if a["cp_size"] == 1 or not a.get("messages"):
            continue
        unit = kv_bytes(shape, sum(a["padded"]) // a["cp_size"])
        forward, backward = ring_transfers(a["cp_size"])
        want = {"forward": [n * unit for n in forward if n], "backward": [n * unit for n in backward if n]}
        got = {phase: [float(m[3]) for m in a["messages"] if m[0] == phase and m[1] == "send"] for phase in ("forward", "backward")}
        checked += 1
        mismatched += got != want
    return {"passes": checked, "mismatched": mismatched}


def calibrated_hardware(fitted_models: dict[str, CostModel], gpu: str) -> dict:
    """The GPU's hardware profile calibrated from the first model's fit (cost_derivation.hardware_from_fit),
    and every fitted model's derived coefficients under it against its fit."""
    from batch_planner.cost_derivation import derive_cost_model, hardware_from_fit
    from batch_planner.cost_spec import HARDWARE_PROFILES, MODEL_PROFILES

    if not fitted_models:
        return {}
    first = next(iter(fitted_models))
    shape = RankShape.of(first)
    hardware = hardware_from_fit(MODEL_PROFILES[first], fitted_models[first], shape.tensor_parallel_size, HARDWARE_PROFILES[gpu].peak_bf16_flops)
    agreement = {}
    for model, fitted in fitted_models.items():
        derived = derive_cost_model(MODEL_PROFILES[model], hardware, RankShape.of(model).tensor_parallel_size)
        agreement[model] = {name: (getattr(derived, name) / getattr(fitted, name) - 1) if getattr(fitted, name) else None
                            for name in COEFFICIENT_NAMES}
    return {"calibrated_from": first, "profile": {k: getattr(hardware, k) for k in hardware.__pydantic_fields__},
            "derived_over_fitted_minus_one": agreement}


def summary_rows(evaluated: list[dict]) -> list[dict]:
    rows = []
    for batch in evaluated:
        planned = {name: r for name, r in batch["candidates"].items() if r["planned"]}
        statics = {name: r for name, r in planned.items() if name.startswith("static_cp")}
        best_static = min(r["replayed_ms"] for r in statics.values()) if statics else None
        fastest = min([r["replayed_ms"] for r in planned.values()] + [batch["auto"]["replayed_ms"]])
        for name, r in planned.items():
            scheduler = row_name(name)
            if " " in scheduler:
                continue  # auto's other knobs: in results.json, not rows of their own
            rows.append(_row(batch, scheduler, r, best_static, fastest))
        auto = dict(batch["auto"])
        served = batch["candidates"][auto["served"]]
        auto["predicted_ms_default"] = served["predicted_ms_default"]
        rows.append(_row(batch, "auto", auto, best_static, fastest))
    return rows


def _row(batch: dict, scheduler: str, r: dict, best_static: float | None, fastest: float) -> dict:
    row = {"model": batch["model"], "distribution": batch["distribution"], "ranks": batch["ranks"], "scheduler": scheduler,
           "replayed_ms": round(r["replayed_ms"], 3), "predicted_ms_default": round(r["predicted_ms_default"], 3),
           "predicted_ms_fitted": round(r["predicted_ms_fitted"], 3), "best_static_ms": round(best_static, 3) if best_static else None,
           "barrier_ms": round(r["barrier_ms"], 3)}
    row["speedup_over_best_static"] = round(best_static / r["replayed_ms"], 4) if best_static else None
    row["error_fitted"] = round(r["predicted_ms_fitted"] / r["replayed_ms"] - 1, 4)
    row["error_default"] = round(r["predicted_ms_default"] / r["replayed_ms"] - 1, 4)
    if scheduler == "auto":
        row["served"] = r["served"]
        row["regret"] = round(r["replayed_ms"] / fastest - 1, 4)
        row["is_fastest"] = r["replayed_ms"] <= fastest * (1 + 1e-9)
    return row


def tables(rows: list[dict], checks: dict, fits: dict, links: LinkSpec) -> str:
    lines = [f"Links: {links.describe()}", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        lines += [f"### {model}", "",
                  "| distribution | DPxCP | best static CP | dynamic CP | hybrid CP | auto serves | auto | auto's regret | fitted error (auto) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for distribution in DISTRIBUTIONS:
            for ranks in RANKS:
                here = {r["scheduler"]: r for r in mine if r["distribution"] == distribution and r["ranks"] == ranks}
                if "auto" not in here:
                    continue
                statics = {k: v for k, v in here.items() if k.startswith("static_cp")}
                best = min(statics, key=lambda k: statics[k]["replayed_ms"])

                def cell(name: str, here: dict = here) -> str:
                    r = here.get(name)
                    return "-" if r is None else f"{r['replayed_ms']:.0f} ms ({r['speedup_over_best_static']:.2f}x)"

                auto = here["auto"]
                lines.append(f"| {distribution} | {ranks} | {best}: {statics[best]['replayed_ms']:.0f} ms | {cell('dynamic_cp')} | "
                             f"{cell('hybrid_cp')} | {auto['served']} | {cell('auto')} | {auto['regret'] * 100:.1f}% | "
                             f"{auto['error_fitted'] * 100:+.1f}% |")
        errors = [abs(r["error_fitted"]) for r in mine]
        toy_errors = [abs(r["error_default"]) for r in mine]
        lines += ["", f"Fitted cost model against the replay, {len(errors)} rows of batches it was not fitted on: median error "
                  f"{statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}%; the toy engine's defaults: median "
                  f"{statistics.median(toy_errors) * 100:.0f}%, worst {max(toy_errors) * 100:.0f}%. auto's worst regret "
                  f"{max(r['regret'] for r in mine if r['scheduler'] == 'auto') * 100:.1f}%.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measurements", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--models", default="")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--gpu", default="h100", help="the GPU the measurements ran on, as the presets name it")
    add_link_arguments(parser)
    args = parser.parse_args(argv)
    links = links_from_arguments(args)
    measurements = json.loads(args.measurements.read_text())
    ranks_list = [int(r) for r in args.ranks.split(",")]
    toy = cost_model_for_preset(CALIBRATED_PRESET)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log(links.describe())
    models = [m for m in (args.models.split(",") if args.models else [k.rsplit("-tp", 1)[0] for k in measurements if not k.startswith("_")])]
    evaluated, checks, fits, fitted_models = [], {}, {}, {}
    for model in models:
        shape = RankShape.of(model)
        clock = FittedKernelClock(measurements[shape.key])
        checks[model] = {**clock.check(), "ring_messages": message_check(measurements[shape.key], shape)}
        fitted, fits[model] = fit_model(model, clock, shape, links, toy, ranks_list, log)
        fitted_models[model] = fitted
        for distribution in DISTRIBUTIONS:
            for ranks in ranks_list:
                evaluated.append(evaluate_batch(model, distribution, ranks, EVAL_SEED, clock, shape, links, toy, fitted, log))
    rows = summary_rows(evaluated)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    fitted_json = {f"{model}-{args.gpu}": {"tensor_parallel_size": RankShape.of(model).tensor_parallel_size,
                                            **{name: getattr(m, name) for name in COEFFICIENT_NAMES}} for model, m in fitted_models.items()}
    (args.out / "fitted.json").write_text(json.dumps(fitted_json, indent=1) + "\n")
    hardware = calibrated_hardware(fitted_models, args.gpu)
    (args.out / "hardware.json").write_text(json.dumps(hardware, indent=1) + "\n")
    (args.out / "results.json").write_text(json.dumps({"links": links.as_json(), "checks": checks, "fits": fits, "hardware": hardware,
                                                        "batches": evaluated},
                                                       indent=None, separators=(",", ":")) + "\n")
    (args.out / "tables.md").write_text(tables(rows, checks, fits, links) + "\n")
    print((args.out / "tables.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
