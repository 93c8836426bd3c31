"""What the Transformer Engine tests share: the skip where they cannot run, the bf16 tolerance, and
the report of what they measured.

Where they run: a host with a CUDA GPU and Transformer Engine's PyTorch extension, several ranks on
one GPU over gloo (tests/support/attention_ranks.py, `on_gpu=True`; the transport between ranks is the
stand-in tests/trainer_client/transformer_engine/staged_p2p.py). docs/gpu-benchmark.md, "Plans through Transformer
Engine", says how to get Transformer Engine onto such a host and run them (scripts/gpu/).

The tolerance. The packed CP run and the whole-sample run compute the same sums in bf16, which
keeps 8 significant bits: a rounding moves a value by up to 2^-9 of itself, and two runs that round
at different places differ by about 2^-8 per rounding. They do round at different places:
Transformer Engine's ring merges each query's partial softmax results step by step, the packed
kernels tile other rows together, each pass's bf16 gradient is rounded before it is summed (in
fp32, as Megatron-Core's DDP sums into main_grad). Between the loss and a weight's gradient lie
about 16 such roundings here (two layers, forward and backward: norm, projections, attention,
MLP), so TOLERANCE = 16 x 2^-8 = 2^-4 of each quantity's scale: the loss of its value, the token
losses of the largest one, each parameter's gradient as the norm of its difference of its own norm
(tests/support/attention_parity.worst_differences). Every run records what it measured
(`record_measurements`, docs/gpu-benchmark.md shows it), and each test runs a planted mistake, a
shard rotated by one rank of its CP group, whose gradients must miss by far more.

The FP8 tolerance (test_te_fp8_dynamic_cp.py: Megatron-Core's FP8 with Transformer Engine's
per-tensor recipes, format "hybrid"). Both FP8 runs, the plan's and the whole samples', quantize
every linear layer's inputs: activations and weights to E4M3 (4 significant bits: a rounding moves
a value by up to 2^-4 of itself), output gradients to E5M2 (3 bits: 2^-3). Each tensor is scaled
by its own amax (current scaling) or by an amax history (delayed scaling) before it is rounded, and
a packed pass's tensors hold other rows than a whole sample's, so the two runs round each value at
another place of its grid: their errors are two draws of FP8's error on the same values, not one
error shared.

A bound on their difference from the formats alone does not hold for every parameter, as the first
run on the H100 showed (2026-12-07, docs/gpu-benchmark.md, "FP8"): the loss agreed to 0.4%, but
the first layer's norm weights' gradients differed by 0.75 of their norm (current scaling) and by
1.22, then 0.37 (delayed scaling, its first and second step), above the 2^-1 this module had
derived from about 8 roundings of each format adding in quadrature (0.32). That derivation took a
gradient's error relative to the values it sums; a norm weight's gradient sums, over every row,
products of both signs that mostly cancel, so the same roundings are a far larger share of the sum
than of its terms, by a factor the formats do not set (the data does).

So the FP8 test measures FP8's own error and holds dynamic CP to it: both FP8 runs against the
same whole samples in bf16 (Megatron-Core's FP8 context left out, the same weights), over every
parameter's gradient together (the relative L2 of the whole gradient). The plan's FP8 run may be
at most FP8_ERROR_RATIO = 2 times as far from bf16 as the whole samples' FP8 run, plus
FP8_ERROR_FLOOR = 2^-6 (bf16's own rounding between the runs, 0.045-0.055 of the worst parameter's
norm above, far less over the whole gradient): two draws of one error over tens of thousands of
values differ by far less than a factor of 2, and an error that dynamic CP adds (a shard on the
wrong rank, a padding row that trains) is not FP8's and is not bounded by it. The planted shard
rotated by one rank moved the bf16 run's gradients by 1.3 and 1.8 of their norm on the H100
(docs/gpu-benchmark-data/transformer-engine/megatron_lm_dropin-dp2-cp2.json). The loss takes the
forward's roundings only (sqrt(8) x 0.051 = 0.14 of a token's loss, the 8 E4M3 roundings in
quadrature) and sums hundreds of tokens whose differences are independent: FP8_LOSS_TOLERANCE =
2^-4 of the whole samples' FP8 loss leaves it a factor of ten (0.4% measured). A plan padded for
bf16 does not run at all (Transformer Engine refuses it).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

TOLERANCE = 2.0**-4
FP8_ERROR_RATIO = 2.0  # the plan's FP8 gradient error over the whole samples' (both against bf16; module docstring)
FP8_ERROR_FLOOR = 2.0**-6  # added to the bound: bf16's own share
FP8_LOSS_TOLERANCE = 2.0**-4  # the step's loss, under FP8
REPORT_DIR_ENV = "GPU_REPORT_DIR"  # where each test writes what it measured (scripts/gpu/run-tests sets it)
DEADLINE_SECONDS = 240  # per run of ranks: they import torch, Megatron-Core and Transformer Engine (about 15 s), then run a few steps


def require_transformer_engine() -> None:
    """Skips the test, saying why, where there is no GPU or no Transformer Engine, or the Megatron-Core
    build lacks dynamic CP."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: Transformer Engine's THD/CP attention runs there only "
                    "(docs/gpu-benchmark.md, 'Plans through Transformer Engine': scripts/gpu/run-tests on a GPU host)")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import it is the reason to skip
        pytest.skip(f"needs Transformer Engine's PyTorch extension (import transformer_engine.pytorch: "
                    f"{type(error).__name__}: {error}); scripts/gpu/bundle and scripts/gpu/run-tests install it")
    from tests.support.attention_ranks import require_dynamic_build

    require_dynamic_build()


def record_measurements(name: str, records: object) -> None:
    """Writes what a test measured to $GPU_REPORT_DIR/<name>.json, when that is set."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.json"), "w") as handle:
            json.dump(records, handle, indent=1, sort_keys=True)
