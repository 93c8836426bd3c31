"""Time one real decoder layer of each model preset's shape on one GPU, and compare the cost model's
derived per-token and attention terms (batch_planner/cost_derivation.py) with what it measures.

    measure (GPU):  python -m bench.gpu.layer_timing measure --out raw.json
    report (CPU):   python -m bench.gpu.layer_timing report --raw raw.json \
                        --json docs/gpu-benchmark-data/layer_timing.json --markdown table.md

The layer is what a Megatron decoder layer computes, in plain PyTorch, bf16: RMSNorm, one fused QKV
projection, rotary embedding, causal attention through scaled_dot_product_attention (cuDNN backend,
flash as fallback; GQA without copying K/V), output projection, RMSNorm, MLP (SwiGLU with one fused
gate/up projection, or GELU for the benchmark stack). Packed sequences run attention one sequence
at a time, so they never attend across a boundary.

MoE (Qwen3-30B-A3B) stand-in: the router (hidden x experts, top-k softmax weights, in the graph so
its backward runs) and one dense SwiGLU of width top_k x expert FFN on every token: the active
experts' FLOPs at dense-GEMM efficiency, without token permutation, grouped GEMM or expert-parallel
all-to-all. A real MoE layer is slower than this; the derived term prices its FLOPs only.

Each case: forward + backward of the layer (upstream gradient given, no loss), 3 warm-ups, then
`--repeats` timed iterations with CUDA events, median taken. The fit per shape is a least-squares
fit of time = a * tokens + b * sum(L^2) + c, weighted by 1/time so that short cases count as much
as long ones; a and b are the measured per-token and per-L^2 terms of ONE layer, c the fixed cost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from batch_planner.cost_derivation import layer_terms
from batch_planner.cost_spec import MODEL_PROFILES, ModelProfile, preset_hardware

K = 1024
SINGLE_LENGTHS = (1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K)
PACKED = {"16x1K": [1 * K] * 16, "4x4K": [4 * K] * 4, "2x8K+8x1K": [8 * K] * 2 + [1 * K] * 8}
TOLERANCE = 0.20


def cases() -> dict[str, list[int]]:
    single = {f"1x{n // K}K": [n] for n in SINGLE_LENGTHS}
    return {**single, **PACKED}


# ---------------------------------------------------------------- measure (GPU only: imports torch)


def build_layer(profile: ModelProfile):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            p = profile
            h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_kv_heads * p.head_dim
            self.p = p
            self.attn_norm, self.mlp_norm = nn.RMSNorm(h), nn.RMSNorm(h)
            self.qkv = nn.Linear(h, q + 2 * kv, bias=False)
            self.out = nn.Linear(q, h, bias=False)
            width = p.moe_top_k * p.moe_ffn_hidden_size if p.is_moe else p.ffn_hidden_size
            self.router = nn.Linear(h, p.num_experts, bias=False) if p.is_moe else None
            self.up = nn.Linear(h, (2 if p.gated_mlp else 1) * width, bias=False)
            self.down = nn.Linear(width, h, bias=False)

        def attention(self, x, seq_lens, cos, sin, attend):
            p, tokens = self.p, x.shape[0]
            q, k, v = self.qkv(x).split(
                [p.num_attention_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.num_kv_heads * p.head_dim], dim=-1
            )
            q = rotate(q.view(tokens, -1, p.head_dim), cos, sin).transpose(0, 1)
            k = rotate(k.view(tokens, -1, p.head_dim), cos, sin).transpose(0, 1)
            v = v.view(tokens, -1, p.head_dim).transpose(0, 1)
            parts = [
                attend(*(t.unsqueeze(0) for t in qkv)).squeeze(0)
                for qkv in zip(q.split(seq_lens, 1), k.split(seq_lens, 1), v.split(seq_lens, 1))
            ]
            return self.out(torch.cat(parts, dim=1).transpose(0, 1).reshape(tokens, -1))

        def mlp(self, x):
            if self.p.gated_mlp:
                gate, up = self.up(x).chunk(2, dim=-1)
                y = self.down(nn.functional.silu(gate) * up)
            else:
                y = self.down(nn.functional.gelu(self.up(x), approximate="tanh"))
            if self.router is not None:
                weights = self.router(x).float().softmax(-1).topk(self.p.moe_top_k, dim=-1).values
                y = y * weights.sum(-1, keepdim=True).to(y.dtype)
            return y

        def forward(self, x, seq_lens, cos, sin, attend):
            x = x + self.attention(self.attn_norm(x), seq_lens, cos, sin, attend)
            return x + self.mlp(self.mlp_norm(x))

    def rotate(t, cos, sin):
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-second, first), dim=-1) * sin

    return Layer().to(device="cuda", dtype=torch.bfloat16)


def build_stack(profile: ModelProfile, layers: int):
    """`layers` identical layers run one after the other: shows how the fixed cost adds up."""
    import torch

    stack = torch.nn.ModuleList(build_layer(profile) for _ in range(layers))

    def run(x, *args):
        for layer in stack:
            x = layer(x, *args)
        return x

    stack.run = run
    return stack


def rotary(seq_lens: list[int], head_dim: int):
    """cos/sin per token, positions restarting at every sequence (as in packed THD batches)."""
    import torch

    positions = torch.cat([torch.arange(n, device="cuda") for n in seq_lens]).float()
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.outer(positions, inv).repeat(1, 2)[:, None, :]
    return angles.cos().bfloat16(), angles.sin().bfloat16()


def pick_attention(profile: ModelProfile):
    """The first SDPA backend that runs this shape forward and backward: cuDNN, then flash."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = profile.num_kv_heads != profile.num_attention_heads

    # The layer's own layout: [tokens, heads, head_dim] transposed, so strides match the real calls.
    def probe(heads):
        t = torch.randn(256, heads, profile.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return t.transpose(0, 1).unsqueeze(0)

    q, kv = probe(profile.num_attention_heads), probe(profile.num_kv_heads)
    errors = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):

        def attend(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        try:
            attend(q, kv, kv).sum().backward()
            torch.cuda.synchronize()
            return backend.name, attend, errors
        except RuntimeError as exc:
            errors[backend.name] = str(exc).splitlines()[0][:200]
    raise RuntimeError(f"no fused SDPA backend runs {profile}: {errors}")


def time_case(layer, profile: ModelProfile, seq_lens: list[int], attend, repeats: int) -> list[float]:
    import torch

    tokens = sum(seq_lens)
    x = torch.randn(tokens, profile.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    cos, sin = rotary(seq_lens, profile.head_dim)
    seconds = []
    for i in range(3 + repeats):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer.run(x, seq_lens, cos, sin, attend).backward(dy)
        end.record()
        end.synchronize()
        if i >= 3:
            seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def gemm_rate() -> float:
    """bf16 8192^3 matrix products per second on this GPU: the ceiling actually reachable."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3)


def measure_shape(name: str, repeats: int, layers: int) -> dict:
    import torch

    profile = MODEL_PROFILES[name]
    layer = build_stack(profile, layers)
    backend, attend, errors = pick_attention(profile)
    rows = []
    for case, seq_lens in cases().items():
        seconds = time_case(layer, profile, seq_lens, attend, repeats)
        rows.append(
            {
                "case": case,
                "seq_lens": seq_lens,
                "tokens": sum(seq_lens),
                "attention_units": sum(n * n for n in seq_lens),
                "median_s": statistics.median(seconds),
                "seconds": seconds,
            }
        )
        print(f"{name:16s} {case:10s} {rows[-1]['median_s'] * 1e3:9.3f} ms", flush=True)
    del layer
    torch.cuda.empty_cache()
    return {"profile": asdict(profile), "attention_backend": backend, "backend_errors": errors, "cases": rows}


def measure(args: argparse.Namespace) -> None:
    import torch

    raw = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "repeats": args.repeats,
        "layers": args.layers,
        "gemm_8192_flops": gemm_rate(),
        "shapes": {name: measure_shape(name, args.repeats, args.layers) for name in args.shapes},
    }
    Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")


# ---------------------------------------------------------------- report (CPU)


def fit(rows: list[dict], layers: int = 1) -> dict:
    """Weighted least squares of median time on (tokens, sum L^2, 1), weights 1/time; the terms
    divided by the stack's `layers`, so they are per layer."""
    import numpy as np

    x = np.array([[r["tokens"], r["attention_units"], 1.0] for r in rows], dtype=float)
    y = np.array([r["median_s"] for r in rows])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    predicted = x @ coef
    return {
        "seconds_per_token": coef[0] / layers,
        "seconds_per_attention_token_pair": coef[1] / layers,
        "seconds_fixed": coef[2] / layers,
        "max_relative_residual": float(np.max(np.abs(predicted - y) / y)),
    }


def compare_shape(name: str, shape: dict, hardware_name: str, layers: int) -> dict:
    measured = fit(shape["cases"], layers)
    derived = layer_terms(MODEL_PROFILES[name], preset_hardware(hardware_name))
    error = {
        term: derived[term] / measured[term] - 1.0 for term in ("seconds_per_token", "seconds_per_attention_token_pair")
    }
    return {
        "attention_backend": shape["attention_backend"],
        "measured": measured,
        "derived": derived,
        "relative_error": error,
        "within_tolerance": all(abs(e) <= TOLERANCE for e in error.values()),
        "cases": [{k: r[k] for k in ("case", "tokens", "attention_units", "median_s")} for r in shape["cases"]],
    }


def markdown(report: dict) -> str:
    lines = [
        (
            f"{report['device']}, torch {report['torch']}, cuDNN {report['cudnn']}, {report['date']}; "
            f"bf16 8192^3 GEMM {report['gemm_8192_flops'] / 1e12:.0f} TFLOP/s. A stack of {report['layers']} layer(s), "
            "forward + backward, terms per layer; "
            f"derived with the `{report['hardware']}` hardware profile."
        ),
        "",
        "| shape | attention | per token: measured | derived | error | per L^2: measured | derived | error | fixed ms per layer (fit) | worst fit residual |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in report["shapes"].items():
        m, d, e = s["measured"], s["derived"], s["relative_error"]
        lines.append(
            f"| {name} | {s['attention_backend']} | {m['seconds_per_token']:.3g} | {d['seconds_per_token']:.3g} | "
            f"{e['seconds_per_token']:+.0%} | {m['seconds_per_attention_token_pair']:.3g} | "
            f"{d['seconds_per_attention_token_pair']:.3g} | {e['seconds_per_attention_token_pair']:+.0%} | "
            f"{m['seconds_fixed'] * 1e3:.2f} | {m['max_relative_residual']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace) -> None:
    raw = json.loads(Path(args.raw).read_text())
    out = {k: raw[k] for k in ("date", "device", "torch", "cudnn", "repeats", "gemm_8192_flops")}
    out["layers"] = raw.get("layers", 1)
    out["hardware"] = args.hardware
    out["tolerance"] = TOLERANCE
    out["shapes"] = {
        name: compare_shape(name, shape, args.hardware, out["layers"]) for name, shape in raw["shapes"].items()
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    table = markdown(out)
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the layers (needs a CUDA GPU)")
    m.add_argument("--out", required=True)
    m.add_argument("--repeats", type=int, default=10)
    m.add_argument("--layers", type=int, default=1, help="layers in the timed stack (terms are reported per layer)")
    m.add_argument("--shapes", nargs="+", default=list(MODEL_PROFILES))
    r = sub.add_parser("report", help="fit and compare with the derived terms")
    r.add_argument("--raw", required=True)
    r.add_argument("--json", required=True)
    r.add_argument("--markdown")
    r.add_argument("--hardware", default="h200")
    args = parser.parse_args(argv)
    measure(args) if args.command == "measure" else report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
