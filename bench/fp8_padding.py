"""What FP8's row alignment costs in padding on the demo batch, for docs/cost-model.md ("Padding for FP8").

    python -m bench.fp8_padding

The batch `./dev run` plans (planner_server/demo.py's defaults): 256 samples of `long_tail_16k`, seed 0,
DP 8 x CP 4, 8,192 tokens per rank, the zigzag layout. For each precision, with TP 1 and with TP 2 under
sequence parallelism: the tokens the alignment adds (`PlanStatistics.alignment_padding_tokens`) to the
dynamic-CP plan, and to the static-CP comparison's packs (batch_planner/cost.py, `static_cp_packs`),
each also as a share of the batch's real tokens. Deterministic (the cost model and Megatron-Core's
scheduler are); tests/bench/test_fp8_padding_table.py keeps the doc's table equal to this output.
"""

from __future__ import annotations

from batch_planner.cost import static_cp_packs
from batch_planner.distributions import sample_lengths
from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind

DISTRIBUTION, SAMPLES, SEED = "long_tail_16k", 256, 0  # planner_server/demo.py's defaults
DP, CP, MAX_SEQLEN_PER_RANK = 8, 4, 8192
PARALLELISM = ((1, False, "TP 1"), (2, True, "TP 2 + SP"))
# Precisions with the same rule share a row (batch_planner/precision.py, ROW_RULES).
ROWS = ((Precision.FP8_DELAYED, "fp8_delayed, fp8_current, fp8_block"), (Precision.MXFP8, "mxfp8"))


def request(precision: Precision, tp: int, sequence_parallel: bool) -> PlanRequest:
    lengths = tuple(sample_lengths(DISTRIBUTION, SAMPLES, SEED))
    return PlanRequest.of(lengths, DP, CP, MAX_SEQLEN_PER_RANK, scheduler=SchedulerKind.DYNAMIC_CP, cp_layout=CpLayout.ZIGZAG,
                          tensor_parallel_size=tp, precision=precision, sequence_parallel=sequence_parallel)


def static_alignment_tokens(aligned: PlanRequest) -> int:
    """The static-CP packs' padded tokens less the same packs' in bf16."""
    return int(static_cp_packs(aligned)[2].sum() - static_cp_packs(aligned.replace(precision=Precision.BF16))[2].sum())


def _cell(tokens: int, real: int) -> str:
    return f"{tokens:,} ({100 * tokens / real:.2f}%)"


def table() -> str:
    """The markdown table docs/cost-model.md shows."""
    real = sum(sample_lengths(DISTRIBUTION, SAMPLES, SEED))
    header = ["precision", *(f"{name}: {kind}" for *_, name in PARALLELISM for kind in ("dynamic CP", "static CP"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for precision, label in ROWS:
        cells = [label]
        for tp, sp, _ in PARALLELISM:
            asked = request(precision, tp, sp)
            cells.append(_cell(plan_batch(asked).statistics.alignment_padding_tokens, real))
            cells.append(_cell(static_alignment_tokens(asked), real))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{SAMPLES} samples of `{DISTRIBUTION}` (seed {SEED}), {real:,} real tokens; DP {DP} x CP {CP}, "
                 f"{MAX_SEQLEN_PER_RANK:,} tokens per rank, zigzag.")
    return "\n".join(lines)


def main() -> int:
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
