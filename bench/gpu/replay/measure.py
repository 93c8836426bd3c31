"""Times one rank's kernels on one GPU for the replay (docs/gpu-replay.md); GPU only.

    python -m bench.gpu.replay.measure --out kernels.json [--models llama3-8b,llama3-70b] [--quick]

For each model, at one TP rank's shapes (`shapes.RankShape`), through Megatron-Core's Transformer
Engine layer spec in bf16 (`kernels.Engine`):

- `rest`: the layer without core attention, forward and backward, on a grid of token counts;
- `head`: embedding, output layer and cross-entropy on the same grid;
- `attention`: core attention (`TEDotProductAttention`, Transformer Engine's THD ring) on random
  passes of one rank of a CP group, CP 1 to 32, lengths drawn from the replay's distributions and
  padded by the planner's rule; each with the messages its ring sent (`in_process_peers.py`). Role
  "fit" for fitting the attention clock, "check" for the 50 passes it is checked against;
- `layer_check`: the whole layer (its real core attention) on CP1 micro-batches, with `rest` and
  `attention` of the same micro-batch measured beside it.

Measurements are cached by shape in the output file: run again with the same `--out` (carried back
from an earlier run) and only what is missing is measured. Every record carries the GPU's name.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from batch_planner.distributions import sample_lengths
from batch_planner.padding import padded_length
from batch_planner.request import CpLayout
from bench.gpu.replay.shapes import REPLAY_TP, RankShape

TOKEN_GRID = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384)
CP_SIZES = (1, 2, 4, 8, 16, 32, 64)
DISTRIBUTIONS = ("long_tail_16k", "lognormal_32k", "megatron_dcp", "rl_rollout_16k")
LOCAL_BUDGET = 8192  # the replay's max_seqlen_per_dp_cp_rank: a rank's local tokens in one pass
FIT_PASSES, CHECK_PASSES, LAYER_CHECKS = 200, 50, 8


def random_pass(rng: random.Random, tensor_parallel_size: int) -> dict:
    """One rank's share of a random CP group's micro-batch: CP size, rank, real and padded lengths.
    Lengths from a random distribution of the replay's, packed up to a random fill of the group's
    budget (CP x LOCAL_BUDGET padded tokens), at least one sample, each at most the budget."""
    cp = rng.choice(CP_SIZES)
    budget = cp * LOCAL_BUDGET
    fill = budget * rng.uniform(0.15, 1.0)
    pool = sample_lengths(rng.choice(DISTRIBUTIONS), 64, rng.randrange(1 << 30))
    if cp > 1 and rng.random() < 0.5:  # a long sample, as the CP groups of dynamic and hybrid CP hold
        pool.insert(0, rng.randint(budget // 2, budget))
    real, padded = [], []
    for n in pool:
        n = min(n, budget)
        p = padded_length(n, cp, tensor_parallel_size, CpLayout.ZIGZAG)
        if real and sum(padded) + p > fill:
            break
        if p > budget:
            continue
        real.append(n)
        padded.append(p)
    return {"cp_size": cp, "cp_rank": rng.randrange(cp), "real": real, "padded": padded}


def _timing(t) -> dict:
    return {"forward": t.forward, "backward": t.backward}


def measure_model(model: str, records: dict, quick: bool, log, fit_passes: int = FIT_PASSES, save=lambda: None) -> None:
    """Measures what `records` lacks for `model`; `save()` after each phase and every 20 attention
    passes, so a run cut off by its time limit keeps what it measured."""
    import torch

    from bench.gpu.replay.kernels import Engine

    shape = RankShape.of(model)
    key = shape.key
    entry = records.setdefault(key, {"shape": shape.__dict__, "gpu": torch.cuda.get_device_name(0), "rest": {}, "head": {},
                                     "attention": [], "layer_check": []})
    started = time.monotonic()
    engine = Engine(shape, warmup=1 if quick else 2, repeats=2 if quick else 5)
    grid = TOKEN_GRID[::4] if quick else TOKEN_GRID
    for tokens in grid:
        if str(tokens) not in entry["rest"]:
            entry["rest"][str(tokens)] = _timing(engine.rest_pass(tokens))
        if str(tokens) not in entry["head"]:
            entry["head"][str(tokens)] = _timing(engine.head_pass(tokens))
    save()
    log(f"{key}: rest and head on {len(grid)} token counts, {time.monotonic() - started:.0f} s")
    rng = random.Random(f"replay-attention:{key}")
    wanted = [("fit", n) for n in range(6 if quick else fit_passes)] + [("check", n) for n in range(3 if quick else CHECK_PASSES)]
    done = {(a["role"], a["index"]) for a in entry["attention"]}
    for role, index in wanted:
        case = random_pass(rng, shape.tensor_parallel_size)
        if (role, index) in done:
            continue
        timing, messages = engine.attention_pass(case["real"], case["padded"], case["cp_size"], case["cp_rank"])
        entry["attention"].append({**case, "role": role, "index": index, **_timing(timing),
                                   "messages": [[m.phase, m.op, m.peer, m.bytes] for m in messages]})
        if len(entry["attention"]) % 20 == 0:
            save()
    log(f"{key}: {len(entry['attention'])} attention passes, {time.monotonic() - started:.0f} s")
    rng = random.Random(f"replay-layer:{key}")
    for index in range(len(entry["layer_check"]), 2 if quick else LAYER_CHECKS):
        case = random_pass(rng, shape.tensor_parallel_size)
        while case["cp_size"] != 1:
            case = random_pass(rng, shape.tensor_parallel_size)
        tokens = sum(case["padded"])
        entry["layer_check"].append({
            "index": index, "real": case["real"], "padded": case["padded"],
            "layer": _timing(engine.layer_pass(case["real"], case["padded"])),
            "rest": _timing(engine.rest_pass(tokens)),
            "attention": _timing(engine.attention_pass(case["real"], case["padded"], 1, 0)[0]),
            "head": _timing(engine.head_pass(tokens)),
        })
    log(f"{key}: {len(entry['layer_check'])} CP1 layer checks, {time.monotonic() - started:.0f} s")
    del engine
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the measurements (JSON), read first if it exists: a cache by shape")
    parser.add_argument("--models", default=",".join(REPLAY_TP))
    parser.add_argument("--quick", action="store_true", help="a few of each, to try the command")
    parser.add_argument("--fit-passes", type=int, default=FIT_PASSES, help="random attention passes to fit the clock to")
    args = parser.parse_args(argv)
    records = json.loads(args.out.read_text()) if args.out.exists() else {}

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def save() -> None:
        args.out.write_text(json.dumps(records, indent=None, separators=(",", ":")))

    failures = {}
    for model in args.models.split(","):
        try:
            measure_model(model, records, args.quick, log, args.fit_passes, save)
        except Exception as error:  # noqa: BLE001 - one model's failure is recorded and the others still run
            import traceback

            failures[model] = f"{type(error).__name__}: {error}"
            log(traceback.format_exc())
        save()
    records.setdefault("_failures", {}).update(failures)
    save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
