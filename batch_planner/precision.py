"""The precision a trainer's GEMMs run in, and what it needs of every rank's rows in every pass.

Transformer Engine's FP8 GEMMs refuse an input whose leading dimensions do not multiply to a
multiple of 8, and cuBLASLt a GEMM whose rows are not a multiple of 16; MXFP8 quantizes the rows in
blocks of 32. Under dynamic CP a rank's rows in
a pass are its group's padded tokens divided by the group's CP size: any multiple of 2 x TP, not of
what FP8 needs. The planner pads each pass's buffer until they are (batch_planner/padding.py,
`group_padded_lengths`); this module says how far, and from where each rule comes (`ROW_RULES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Precision(str, Enum):
    """The precision a trainer's linear layers run in (proto enum `Precision`)."""

    BF16 = "bf16"
    # FP8 with one scale per tensor, from an amax history (Transformer Engine's DelayedScaling;
    # Megatron-Core's fp8_recipe "delayed").
    FP8_DELAYED = "fp8_delayed"
    # FP8 with one scale per tensor, from the tensor itself (Float8CurrentScaling; "tensorwise").
    FP8_CURRENT = "fp8_current"
    # FP8 with one scale per block of 128 values (Float8BlockScaling; "blockwise"), Hopper's block scaling.
    FP8_BLOCK = "fp8_block"
    # MXFP8: FP8 with an E8M0 scale per 32 values (MXFP8BlockScaling; "mxfp8"); Blackwell only.
    MXFP8 = "mxfp8"


@dataclass(frozen=True)
class RowRule:
    """What a precision needs of the rows one TP rank's linear layers see in one pass."""

    # Each TP rank's own input rows (its sequence-parallel shard, under sequence parallelism) are a
    # multiple of this: what Transformer Engine checks before it quantizes them.
    shard: int
    # Every GEMM operand's rows are a multiple of this, the weight gradient's included, which takes
    # a TP rank's whole rows (gathered, under sequence parallelism) as its inner dimension.
    gemm: int


# Each precision's rule, from Transformer Engine 2.20's own checks (lines of its Python package
# `transformer_engine/pytorch/` and of its C++ `common/`), and for the Hopper recipes from the GPU:
# docs/gpu-benchmark-data/fp8-rows-h100.json ran Linear, LayerNormLinear and LayerNormMLP forward and
# backward at every row count 1-272 under each recipe (bench/gpu/fp8_rows.py).
#
# - FP8, every per-tensor and block recipe: `assert_dim_for_fp8_exec(inputmat, weight)` (utils.py:704,
#   called by linear.py:472, layernorm_linear.py:184, layernorm_mlp.py:356 before any all-gather)
#   raises ValueError unless the input's rows are a multiple of 8; cuBLASLt's FP8 GEMM then asserts
#   `lda % 16 == 0` ("Leading dimension requirement on A for FP8 GEMM. Caller must pad",
#   gemm/cublaslt_gemm.cu:161, :209 for block scaling), and the weight-gradient GEMM's A is the rows
#   transposed. On the H100 each recipe ran at the multiples of 16 only: 238 row counts failed the
#   first check, 8, 24, 40, ... the second.
# - Block scaling additionally gathers in FP8 only a shard of rows a multiple of 128
#   (`Float8BlockQuantizer.is_quantizable`, tensor/float8_blockwise_tensor.py:235); any other runs the
#   all-gather in bf16 with a warning (distributed.py:1148): slower, not refused, so not padded for.
# - MXFP8: the quantizer scales blocks of 32 rows (`MXFP8Quantizer.is_quantizable`,
#   tensor/mxfp8_tensor.py:125) and Megatron-Core's own `get_padding` pads to 32 for it. Not run:
#   the H100 refuses MXFP8 ("Device compute capability 10.0 or higher required").
ROW_RULES: dict[Precision, RowRule] = {
    Precision.BF16: RowRule(shard=1, gemm=1),
    Precision.FP8_DELAYED: RowRule(shard=8, gemm=16),
    Precision.FP8_CURRENT: RowRule(shard=8, gemm=16),
    Precision.FP8_BLOCK: RowRule(shard=8, gemm=16),
    Precision.MXFP8: RowRule(shard=32, gemm=32),
}

# Megatron-Core's names (TransformerConfig.fp8_recipe, Megatron-LM's --fp8-recipe) of each FP8
# precision: what the drop-ins read from a trainer's config.
MEGATRON_FP8_RECIPES: dict[str, Precision] = {
    "delayed": Precision.FP8_DELAYED,
    "tensorwise": Precision.FP8_CURRENT,
    "blockwise": Precision.FP8_BLOCK,
    "mxfp8": Precision.MXFP8,
}


def rank_row_multiple(precision: Precision, tensor_parallel_size: int, sequence_parallel: bool) -> int:
    """What one DPxCP rank's rows in a pass must be a multiple of, so that every TP rank's linear
    layers take them: under sequence parallelism each TP rank's shard is 1/TP of them and must be the
    rule's `shard`, and the GEMMs see all of them; without it every TP rank sees all of them."""
    rule = ROW_RULES[precision]
    if rule == RowRule(1, 1):
        return 1  # bf16: nothing to align, whatever the parallelism
    return math.lcm(rule.shard * (tensor_parallel_size if sequence_parallel else 1), rule.gemm)
