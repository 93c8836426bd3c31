"""GPU benchmark: run the planner's plan, static CP2 and static CP1 of the same batches.

One process per rank (torchrun). On the GPU machine, from a checkout with plans.json:

    torchrun --nproc-per-node 2 -m bench.gpu.run --plans plans.json --out $OUT

Writes results.json (per-step and per-micro-batch timings of every rank, the correctness check,
the configuration) under --out. bench/gpu/calibrate.py turns it into the cost-model fit, the
table and the plot. On a CPU (gloo, tests) pass --device cpu and a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from bench.gpu.correctness import check_cp_attention
from bench.gpu.execute import PlanExecutor, SampleInputs
from bench.gpu.groups import build_cp_groups
from bench.gpu.model import DecoderConfig, DecoderStack
from bench.gpu.plans import load_plans

BACKENDS = ("cudnn", "flash", "efficient", "math", "default")


def sdpa_backend(name: str) -> contextlib.AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if name == "default":
        return contextlib.nullcontext()
    if name == "math":
        return sdpa_kernel([table[name]])
    # The named backend first; flash as the fallback for a shape the named one cannot run.
    backends = [table[name]] + ([SDPBackend.FLASH_ATTENTION] if name != "flash" else [])
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # a torch without set_priority: the named backend alone
        return sdpa_kernel([table[name]])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", required=True, help="JSON from bench.gpu.make_plans")
    parser.add_argument("--out", required=True, help="directory for results.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--sdpa-backend", choices=BACKENDS, default=None, help="default: cudnn on cuda, math on cpu")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--batches", default="", help="comma-separated batch names to run (default: all)")
    parser.add_argument("--check-length", type=int, default=16384)
    parser.add_argument("--cp-groups", choices=("auto", "megatron", "torch"), default="auto")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.sdpa_backend = args.sdpa_backend or ("cudnn" if args.device == "cuda" else "math")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    batches = load_plans(args.plans)
    if args.batches:
        wanted = set(args.batches.split(","))
        batches = [b for b in batches if b["name"] in wanted]
    sizes = {g.size for b in batches for p in b["plans"] for mb in p.micro_batches for g in mb.cp_groups}
    cp_groups, group_source = build_cp_groups(world, sizes | {world}, prefer_megatron=args.cp_groups != "torch")
    config = DecoderConfig(args.hidden_size, args.num_heads, args.num_layers)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DecoderStack(config).to(device=device, dtype=dtype)

    checks, backend = [], args.sdpa_backend
    for attempt in (backend, "flash"):
        try:
            with sdpa_backend(attempt):
                for seed, length in enumerate((args.check_length, args.check_length // 4 + 2 * world * 3)):
                    length -= length % (2 * world)
                    checks.append(check_cp_attention(
                        cp_groups[(0, world)], length, config.num_heads, config.head_dim, dtype, device, seed,
                        tolerance=1e-2 if dtype == torch.bfloat16 else 1e-5,
                    ))
            backend = attempt
            break
        except Exception as exc:  # noqa: BLE001 - recorded, then the fallback backend is tried
            checks.append({"backend": attempt, "error": f"{type(exc).__name__}: {exc}"})
            if attempt == "flash" or device.type != "cuda":
                raise

    runs = []
    with sdpa_backend(backend):
        for batch in batches:
            inputs = SampleInputs(tuple(batch["lengths"]), config.hidden_size, dtype, device, batch["seed"])
            executor = PlanExecutor(model, inputs, cp_groups, device)
            plans = batch["plans"]
            for _ in range(args.warmup_steps):
                for plan in plans:
                    executor.run_step(plan)
            for repeat in range(args.timed_steps):
                for plan in plans:  # interleaved, so drift hits every plan alike
                    result = executor.run_step(plan)
                    runs.append({"batch": batch["name"], "repeat": repeat, **asdict(result)})
            if rank == 0:
                print(_batch_summary(batch, runs), flush=True)
            del inputs, executor
            if device.type == "cuda":
                torch.cuda.empty_cache()
            # Written after every batch, so a run cut short by a time limit still leaves results.
            report = _write_report(args, config, backend, group_source, device, checks, batches, runs, rank, world)
    if not batches:
        report = _write_report(args, config, backend, group_source, device, checks, batches, runs, rank, world)
    if rank == 0:
        print("checks:", json.dumps(report["checks"]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return report


def _write_report(args, config, backend, group_source, device, checks, batches, runs, rank, world) -> dict | None:
    gathered: list = [None] * world
    dist.all_gather_object(gathered, runs)
    report = None
    if rank == 0:
        report = {
            "config": {**asdict(config), "dtype": args.dtype, "sdpa_backend": backend, "device": args.device,
                       "world_size": world, "cp_groups": group_source, "warmup_steps": args.warmup_steps,
                       "timed_steps": args.timed_steps},
            "environment": _environment(device),
            "checks": [c if isinstance(c, dict) else {**asdict(c), "passed": c.passed} for c in checks],
            "batches": [{k: v for k, v in b.items() if k != "plans"} | {"plans": [p.name for p in b["plans"]]} for b in batches],
            "runs": [r for rank_runs in gathered for r in rank_runs],
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(report, f)
    return report


def _batch_summary(batch: dict, runs: list[dict]) -> str:
    tokens = sum(batch["lengths"])
    medians = {}
    for plan in batch["plans"]:
        times = sorted(r["step_seconds"] for r in runs if r["batch"] == batch["name"] and r["plan"] == plan.name)
        medians[plan.name] = (times[len(times) // 2], times[0], times[-1])
    static = medians.get("static_cp2", (None,))[0]
    lines = [f"{batch['name']}: {tokens} tokens"]
    for name, (median, low, high) in medians.items():
        ratio = f"{static / median:5.2f}x vs static_cp2" if static else ""
        lines.append(f"  {name:12s} median {median * 1e3:8.1f} ms (min {low * 1e3:.1f}, max {high * 1e3:.1f})"
                     f"  {tokens / median:10.0f} tok/s  {ratio}")
    return "\n".join(lines)


def _environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    # The fixed per-pass and per-ring-call costs are host-bound: record the host too.
    env["cpu"] = _cpu_model()
    env["cpu_count"] = os.cpu_count()
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cudnn"] = torch.backends.cudnn.version()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main(sys.argv[1:])
