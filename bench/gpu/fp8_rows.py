"""What each precision needs of a rank's rows, asked of Transformer Engine on the GPU (issue: FP8
with dynamic CP). A probe, not a test: it records, and batch_planner/precision.py states the rule.

For every recipe Transformer Engine has (delayed and current per-tensor scaling, MXFP8, 1D/2D
block scaling) and each module a Megatron-Core layer runs its GEMMs through (`Linear`,
`LayerNormLinear`, `LayerNormMLP`), one forward and backward under that recipe's autocast at every
row count from 1 to `--max-rows`, bf16 parameters, a hidden size that every recipe accepts. Each
row count is recorded as `ok`, `warned` (ran, with the warning's text: e.g. a fallback to a
high-precision path) or `error` (the exception's type and first line). A recipe the GPU cannot run
(MXFP8 before Blackwell) is recorded with Transformer Engine's own reason.

    GPU_RUN=python3 scripts/gpu/run-tests -m bench.gpu.fp8_rows --out $OUT/fp8-rows.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import warnings


def _recipes(recipe_module):
    made = {}
    for name, build in (
        ("fp8_delayed", lambda: recipe_module.DelayedScaling()),
        ("fp8_current", lambda: recipe_module.Float8CurrentScaling()),
        ("fp8_block", lambda: recipe_module.Float8BlockScaling()),
        ("mxfp8", lambda: recipe_module.MXFP8BlockScaling()),
    ):
        try:
            made[name] = build()
        except Exception as exc:  # noqa: BLE001 - a recipe this build lacks, recorded with its reason
            made[name] = exc
    return made


def _runs(te, torch, module, recipe, rows: int, hidden: int) -> tuple[str, str]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with te.autocast(enabled=True, recipe=recipe):
                out = module(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a probe: every failure is recorded, whatever raised it
            torch.cuda.synchronize()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            first = re.sub(r",? but got tensor with dims=.*$", "", first)  # one message for every row count
            return "error", f"{type(exc).__name__}: {first}"[:300]
    texts = sorted({str(w.message).splitlines()[0][:200] for w in seen if "deprecat" not in str(w.message).lower()})
    return ("warned", " | ".join(texts)) if texts else ("ok", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-rows", type=int, default=272)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipe_module

    torch.manual_seed(0)
    hidden = args.hidden
    modules = {
        "Linear": te.Linear(hidden, hidden, params_dtype=torch.bfloat16, device="cuda"),
        "LayerNormLinear": te.LayerNormLinear(hidden, hidden, normalization="RMSNorm", params_dtype=torch.bfloat16, device="cuda"),
        "LayerNormMLP": te.LayerNormMLP(hidden, 2 * hidden, normalization="RMSNorm", activation="swiglu",
                                        params_dtype=torch.bfloat16, device="cuda"),
    }
    result = {
        "device": torch.cuda.get_device_name(),
        "transformer_engine": getattr(transformer_engine, "__version__", "?"),
        "torch": torch.__version__,
        "how": "python -m bench.gpu.fp8_rows: one forward and backward of each module under each recipe's autocast at every "
               "row count 1..max_rows (bf16 parameters); the row counts of each outcome",
        "hidden": hidden,
        "max_rows": args.max_rows,
        "recipes": {},
    }
    for name, recipe in _recipes(recipe_module).items():
        if isinstance(recipe, Exception):
            result["recipes"][name] = {"unavailable": f"{type(recipe).__name__}: {recipe}"}
            continue
        entry = {"recipe": repr(recipe)[:300], "modules": {}}
        for module_name, module in modules.items():
            rows_seen = {}
            for rows in range(1, args.max_rows + 1):
                rows_seen[rows] = _runs(te, torch, module, recipe, rows, hidden)
                if rows == 1 and rows_seen[1][0] == "error" and "not supported" in rows_seen[1][1].lower():
                    break
            groups: dict[str, list[int]] = {}
            for rows, (kind, text) in rows_seen.items():
                groups.setdefault(kind if kind == "ok" else f"{kind}: {text}", []).append(rows)
            clean = groups.get("ok", [])
            entry["modules"][module_name] = {
                "outcomes": [{"outcome": outcome, "rows": rows} for outcome, rows in groups.items()],
                "clean_gcd": math.gcd(*clean) if clean else None,
            }
            print(name, module_name, "ran at", len(clean), "row counts; their gcd", entry["modules"][module_name]["clean_gcd"], flush=True)
        result["recipes"][name] = entry
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
