"""Closed-loop calibration on one GPU: a real decoder layer's units, timed and fitted online by the
trainer client's own calibration (trainer_client/service/calibration.py), predict held-out units.

    measure (GPU):  python -m bench.gpu.calibration_online --out calibration_online.json

The layer is bench/gpu/layer_timing.py's (bf16, fused SDPA, forward + backward, upstream gradient
given). Each unit is one forward+backward pass over a pack of 1-8 sequences (128 to 16K tokens
each, at most 16K tokens in the pack, positions restarting per sequence), like one CP1 execution
unit of a packing plan. Training: `--steps` steps of `--units` units each; every unit is timed with
CUDA events through `Calibrator.timed` (read once per step, after one synchronisation), the
calibrator gathers and refits after every step over a sliding window, and each step is first
predicted by the model in force for it (online, before its own units are fitted). Held out: then
`--held-out-steps` further steps of new random units, predicted by the final model and not fitted.
CP1 only: one GPU has no CP group, so the CP terms keep the prior's values.

Python's cyclic garbage collector runs whenever allocations pass its thresholds; a full collection
of a process holding torch takes 10-30 ms on the host, and a short unit whose kernels are still
being launched waits for it on the GPU too. Megatron-LM offers `--manual-gc` for that reason
(collect at step boundaries only). `--shapes` names the collector's mode per run
(`name:layers:manual` or `name:layers:auto`), so both are measured side by side; every unit also
records its host-side time (launching its kernels), which says whether the GPU waited on the host.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from batch_planner.cost_spec import COEFFICIENT_NAMES, MODEL_PROFILES
from batch_planner.request import PlanningOptions, SchedulerKind

K = 1024
MAX_UNIT_TOKENS = 16 * K


def random_unit(rng: random.Random) -> list[int]:
    count = rng.choice((1, 1, 2, 3, 4, 8))
    lengths = []
    for _ in range(count):
        n = int(min(16 * K, max(128, rng.lognormvariate(7.8, 1.0))))
        if sum(lengths) + n > MAX_UNIT_TOKENS:
            break
        lengths.append(n)
    return lengths or [rng.randint(128, 16 * K)]


def unit_of(lengths: list[int], index: int) -> SimpleNamespace:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return SimpleNamespace(sequence_lengths=tuple(lengths), cu_seqlens_padded=cu, local_cp_size=1,
                           micro_batch_index=index, token_fields={})


def run_shape(name: str, layers: int, gc_mode: str, args, rng: random.Random) -> dict:
    import torch

    from bench.gpu.layer_timing import build_stack, rotary
    from batch_planner.cost_fit import price_vector
    from trainer_client.service.calibration import Calibrator, features_of

    profile = MODEL_PROFILES[name]
    stack = build_stack(profile, layers)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Flash first: cuDNN's SDPA builds a plan per new sequence length, which a stream of varied
    # lengths pays on nearly every unit (seen on the first run: 0.3 s units, no fit).
    backend = "FLASH_ATTENTION"
    gqa = profile.num_kv_heads != profile.num_attention_heads

    def attend(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def inputs(lengths: list[int]):
        x = torch.randn(sum(lengths), profile.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return x, torch.randn_like(x), *rotary(lengths, profile.head_dim)

    def run(lengths: list[int], prepared=None) -> None:
        x, dy, cos, sin = prepared or inputs(lengths)
        stack.zero_grad(set_to_none=True)
        stack.run(x, lengths, cos, sin, attend).backward(dy)

    # The largest unit first: the caching allocator then holds blocks big enough for every later
    # unit, so no timed unit waits on a cudaMalloc. Then single sequences over the whole length range:
    # the kernels chosen for a shape class are loaded on first use (CUDA's lazy module loading), a
    # stall of 10-100 ms on the host that a trainer pays once, in its first steps, not per unit.
    run([MAX_UNIT_TOKENS])
    for i in range(args.warmup_sweep):
        run([int(128 * (MAX_UNIT_TOKENS / 128) ** (i / max(1, args.warmup_sweep - 1)))])
    for _ in range(args.warmup):
        run(random_unit(rng))
    torch.cuda.synchronize()
    manual_gc = gc_mode == "manual"
    if manual_gc:
        gc.collect()
        gc.disable()
    options = PlanningOptions(max_seqlen_per_dp_cp_rank=MAX_UNIT_TOKENS, scheduler=SchedulerKind.AUTO)
    calibrator = Calibrator(options, window_steps=args.window, min_observations=args.min_observations,
                            update_interval_steps=1)
    online, held_out, models = [], [], []
    for step in range(args.steps + args.held_out_steps):
        fitting = step < args.steps
        calibrator.begin_step(step)
        units = [unit_of(random_unit(rng), i) for i in range(args.units)]
        model = calibrator.model_for(step) if fitting else calibrator.model
        host = []
        for unit in units:
            prepared = inputs(list(unit.sequence_lengths))  # the batch's tensors, before the pass
            allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
            started = time.perf_counter()
            with calibrator.timed(unit, cuda=True):
                run(list(unit.sequence_lengths), prepared)
            host.append((time.perf_counter() - started, torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs))
        if fitting:
            report = calibrator.end_step()
            measured = [row[2] for row in calibrator.window[-1]]
            rows = online
            models.append({"step": step, "fit": report.fit.result if report and report.fit else "",
                           **{n: getattr(calibrator.model, n) for n in COEFFICIENT_NAMES}})
        else:
            timings = calibrator.timer.collect([step])[0]
            measured = [row[2] for row in timings]
            rows = held_out
        for unit, seconds, (host_s, device_allocs) in zip(units, measured, host):
            predicted = price_vector(model, features_of(unit))
            rows.append({"step": step, "lengths": list(unit.sequence_lengths), "tokens": sum(unit.sequence_lengths),
                         "measured_s": seconds, "predicted_s": predicted, "host_s": host_s,
                         "device_allocs": device_allocs,  # cudaMalloc calls the caching allocator made in it
                         "relative_error": abs(predicted - seconds) / seconds})
        if manual_gc:
            gc.collect()  # at the step boundary, outside every timed unit
    if manual_gc:
        gc.enable()
    stack = None  # noqa: F841 - frees the layer before the next shape
    torch.cuda.empty_cache()

    def summary(rows: list[dict]) -> dict:
        errors = sorted(r["relative_error"] for r in rows)
        by_step: dict[int, list[dict]] = {}
        for r in rows:
            by_step.setdefault(r["step"], []).append(r)
        step_errors = [abs(sum(r["predicted_s"] for r in rs) - sum(r["measured_s"] for r in rs)) / sum(r["measured_s"] for r in rs)
                       for rs in by_step.values()]
        return {
            "units": len(rows),
            "median_relative_error": statistics.median(errors),
            "p90_relative_error": errors[int(0.9 * (len(errors) - 1))],
            "max_relative_error": errors[-1],
            "within_15pct": sum(e <= 0.15 for e in errors) / len(errors),
            # units whose GPU time was no longer than their host-side launch: the GPU waited on the host
            "host_bound_units": sum(r["measured_s"] <= r["host_s"] for r in rows),
            "step_max_relative_error": max(step_errors),
            "step_median_relative_error": statistics.median(step_errors),
        }

    late_online = [r for r in online if r["step"] >= args.steps // 2]
    return {
        "shape": name, "layers": layers, "gc": gc_mode, "attention_backend": backend,
        "final_model": {n: getattr(calibrator.model, n) for n in COEFFICIENT_NAMES},
        "first_fitted_step": next((m["step"] for m in models if m["fit"] == "updated"), None),
        "online_second_half": summary(late_online), "held_out": summary(held_out),
        "models": models, "online_units": online, "held_out_units": held_out,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--held-out-steps", type=int, default=10)
    p.add_argument("--units", type=int, default=8)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--min-observations", type=int, default=24)
    p.add_argument("--warmup", type=int, default=20, help="random units run before the first step")
    p.add_argument("--warmup-sweep", type=int, default=200,
                   help="single sequences of geometric lengths 128..16K run before those")
    p.add_argument("--shapes", default="llama3-8b:1:manual,llama3-8b:4:manual",
                   help="runs, comma-separated: profile:layers:gc, gc one of manual, auto")
    args = p.parse_args(argv)
    import torch

    rng = random.Random(0)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "args": {**vars(args), "out": Path(args.out).name}, "shapes": []}
    for item in args.shapes.split(","):
        name, layers, gc_mode = (item.split(":") + ["manual"])[:3]
        if gc_mode not in ("manual", "auto"):
            p.error(f"--shapes: {item!r}: the collector's mode must be manual or auto")
        shape = run_shape(name, int(layers), gc_mode, args, rng)
        result["shapes"].append(shape)
        for part in ("online_second_half", "held_out"):
            s = shape[part]
            print(f"{name} x{layers} gc={gc_mode} {part}: {s['units']} units, median {s['median_relative_error']:.3f}, "
                  f"p90 {s['p90_relative_error']:.3f}, max {s['max_relative_error']:.3f}, "
                  f"within 15% {100 * s['within_15pct']:.0f}%, host-bound {s['host_bound_units']}, "
                  f"step error max {s['step_max_relative_error']:.3f}", flush=True)
        print(f"{name} x{layers} gc={gc_mode} model: {shape['final_model']} (first fitted at step {shape['first_fitted_step']})", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after every run: a cut-short run keeps its data


if __name__ == "__main__":
    main()
