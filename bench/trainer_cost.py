"""Trainer-side cost: applying a plan to a 1,024-sample batch on one rank, restoring outputs,
and memory.

    python -m bench.trainer_cost --out docs/bench

In process, on CPU, with trainer_client's apply and restore (the code a trainer rank runs):
- `unbind`: `trainer_client.plans.batch.unbind_batch` on the global batch (jagged NestedTensor
  `input_ids` and `labels`, int64): done once per step on every rank;
- `apply`: `micro_batches_for_rank(plan, global_batch, rank)` for one rank: this rank's shards,
  position ids, padding mask, cu_seqlens. One run per rank of the plan, so the spread is over ranks;
  measured with torch's default intra-op threads and with one thread, rank by rank side by side
  (on this busy 2-core machine, small tensor ops with 2 threads lose much time to waiting);
- `check`: what makes sure the batch is the one the plan was made for (trainer_client/plans/batch_check.py):
  `unbind` keeps the batch's lengths as int64 bytes (from the lengths tensor it reads anyway; timed
  alone, right after reading it as `unbind` does), and `BatchPlannerClient.micro_batches` compares
  them with the plan's recorded lengths (timed on every rank right before that rank's apply, default
  threads). Reported as a ratio to the apply: checks plus keys over applies, summed over the ranks;
- `restore`: `trainer_client.plans.outputs.restore_outputs` on one output per sample (a float32 tensor of
  the sample's length, e.g. per-token log-probs), without torch.distributed: the ordering and
  checking only, not the all-gather between ranks;
- `calibration`: the closed-loop calibration's own cost on this rank (trainer_client/service/calibration.py):
  timing every unit of one step (`client.timed(unit)` around an empty body, with the monotonic
  clock: the unit's features and two clock reads; on a GPU two CUDA event records instead), and
  one refit of the cost model over a full window (the default 50 steps of this rank's units; the
  all-gather between ranks not counted);
- memory: bytes of the tensors `apply` creates for one rank (its shards, position ids, masks,
  cu_seqlens; the unsharded per-sample views share the batch's storage), next to the batch itself.
The plan: dynamic CP (packed units), 1,024 samples of `lognormal_32k` on 64 ranks. Bars: apply <= 5 ms;
check <= 1% of apply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batch_planner.planner import plan_batch
from batch_planner.request import SchedulerKind
from bench.common import (
    Bar,
    BatchSize,
    Report,
    Spread,
    argument_parser,
    make_request,
    markdown_table,
    verdict,
    write_report,
)

DISTRIBUTION, SIZE, SMOKE_SIZE = "lognormal_32k", BatchSize(1024, 64), BatchSize(64, 8)
UNBIND_RUNS, RESTORE_RUNS = 10, 10
APPLY_BAR_S, APPLY_BAR = 5e-3, "<= 5 ms"
CHECK_BAR_RATIO, CHECK_BAR = 0.01, "<= 1% of apply"
MS, MIB = 1e3, 1 / 2**20


@dataclass(frozen=True)
class CostRow:
    """One measured step of the trainer side, in seconds (or bytes, for memory)."""

    what: str
    values: Spread
    scale: float = MS  # how the table shows it: MS for seconds, MIB for bytes
    bar_s: float | None = None  # the bar on p99, where there is one

    @property
    def met(self) -> bool | None:
        return None if self.bar_s is None else self.values.p99 <= self.bar_s

    def cells(self, batch: str) -> list[object]:
        bar = "-" if self.bar_s is None else APPLY_BAR
        met = "-" if self.met is None else verdict(self.met)
        return [batch, self.what, self.values.runs, self.values.fmt(self.scale), f"{self.values.p99 * self.scale:.2f}", bar, met]


def make_batch(lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 32000, (n,), generator=generator) for n in lengths]
    return {
        "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        "labels": torch.nested.nested_tensor([t.roll(-1) for t in ids], layout=torch.jagged),
    }


def created_bytes(micro_batches) -> int:
    total = 0
    for mb in micro_batches:
        tensors = [*mb.token_fields.values(), mb.position_ids, mb.padding_mask, mb.cu_seqlens, mb.cu_seqlens_padded]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def calibration_cost(plan, global_batch, runs: int) -> tuple[list[float], list[float]]:
    """Seconds to time one step's units of rank 0 (empty bodies), and to refit over a full window."""
    import random

    from batch_planner.request import PlanningOptions
    from trainer_client.plans.apply import micro_batches_for_rank
    from trainer_client.service.calibration import Calibrator

    units = micro_batches_for_rank(plan, global_batch, 0)
    window = 50
    calibrator = Calibrator(PlanningOptions(max_seqlen_per_dp_cp_rank=plan_max(plan)), window, 24, window)
    rng = random.Random(0)
    timing: list[float] = []
    for step in range(window):
        calibrator.begin_step(step)
        started = time.perf_counter()
        for unit in units:
            with calibrator.timed(unit, cuda=False):
                pass
        timing.append(time.perf_counter() - started)
        for timed in calibrator.timer._steps[step]:  # stand-in times, so that the fit has data
            timed.seconds = 1e-3 * (1 + sum(timed.features[:2]) * 1e-6) * rng.uniform(0.95, 1.05)
        if step < window - 1:
            calibrator.end_step()
    fitting: list[float] = []
    rows = calibrator.timer.collect(list(range(window)))
    for _ in range(runs):
        calibrator.window.clear()
        calibrator.window.extend(rows)
        started = time.perf_counter()
        calibrator._ended, calibrator.timer._steps = [], {}
        calibrator.begin_step(window - 1)
        calibrator.update_interval_steps = 1
        calibrator.end_step()
        fitting.append(time.perf_counter() - started)
    return timing[: max(runs, 10)], fitting


def plan_max(plan) -> int:
    return max(1, max((g.padded_tokens for mb in plan.micro_batches for g in mb.cp_groups), default=1))


def key_seconds(lengths: torch.Tensor) -> float:
    """The lengths key as `unbind_batch` makes it: right after reading the lengths into ints."""
    tuple(lengths.tolist())
    started = time.perf_counter()
    lengths.numpy().tobytes()
    return time.perf_counter() - started


def check_seconds(planned, plan, global_batch) -> float:
    """The check `micro_batches` runs before the apply: the recorded plan's lengths against the
    batch's, by their keys."""
    started = time.perf_counter()
    planned.check(plan, global_batch.lengths, global_batch.lengths_bytes)
    return time.perf_counter() - started


def run(out: Path, smoke: bool = False) -> Report[CostRow]:
    from trainer_client.plans.apply import micro_batches_for_rank
    from trainer_client.plans.batch import unbind_batch
    from trainer_client.plans.batch_check import PlannedBatches
    from trainer_client.plans.outputs import restore_outputs

    size = SMOKE_SIZE if smoke else SIZE
    request = make_request(DISTRIBUTION, size, scheduler=SchedulerKind.DYNAMIC_CP)  # the main path: packed units
    plan = plan_batch(request)
    batch = make_batch(request.sequence_lengths)
    batch_bytes = sum(sum(t.numel() * t.element_size() for t in v.unbind()) for v in batch.values())
    unbind_runs = 2 if smoke else UNBIND_RUNS
    unbind, apply, created = [], [], []
    for _ in range(unbind_runs):
        started = time.perf_counter()
        global_batch = unbind_batch(batch)
        unbind.append(time.perf_counter() - started)
    default_threads = torch.get_num_threads()
    apply_one_thread: list[float] = []
    planned, check = PlannedBatches(keep=3), []
    planned.record(plan, request.sequence_lengths, step=0)  # as plan_step records it
    lengths = batch["input_ids"].offsets().diff().to(dtype=torch.int64)  # as unbind_batch reads it
    micro_batches_for_rank(plan, global_batch, 0)  # warm-up
    check_seconds(planned, plan, global_batch)
    key = [key_seconds(lengths) for _ in range(64)]
    try:
        for rank in range(plan.dp_cp_size):
            # Side by side: torch's default intra-op threads, then one thread, on the same rank.
            for threads, sink in ((default_threads, apply), (1, apply_one_thread)):
                torch.set_num_threads(threads)
                if threads == default_threads:  # as micro_batches: the check, then the apply
                    check.append(check_seconds(planned, plan, global_batch))
                started = time.perf_counter()
                mine = micro_batches_for_rank(plan, global_batch, rank)
                sink.append(time.perf_counter() - started)
            created.append(created_bytes(mine))
    finally:
        torch.set_num_threads(default_threads)
    outputs = {i: torch.zeros(n, dtype=torch.float32) for i, n in enumerate(request.sequence_lengths)}
    restore = []
    for _ in range(2 if smoke else RESTORE_RUNS):
        started = time.perf_counter()
        restored = restore_outputs(outputs, len(outputs))
        restore.append(time.perf_counter() - started)
    assert len(restored) == size.samples
    timing, fitting = calibration_cost(plan, global_batch, 2 if smoke else RESTORE_RUNS)
    ratio = (sum(check) + len(check) * Spread.of(key).p50) / sum(apply)
    rows = [
        CostRow("unbind the global batch (once per step)", Spread.of(unbind)),
        CostRow(f"apply the plan for one rank, torch default threads ({default_threads})", Spread.of(apply), bar_s=APPLY_BAR_S),
        CostRow("apply the plan for one rank, torch.set_num_threads(1)", Spread.of(apply_one_thread), bar_s=APPLY_BAR_S),
        CostRow("check: the batch's lengths key, made in unbind, in µs", Spread.of(key), 1e6),
        CostRow("check: the batch against the plan's lengths, before each apply above, in µs", Spread.of(check), 1e6),
        CostRow("restore output order (no all-gather)", Spread.of(restore)),
        CostRow("calibration: time every unit of one step on one rank", Spread.of(timing)),
        CostRow("calibration: refit over a 50-step window (no all-gather)", Spread.of(fitting)),
        CostRow(f"memory: tensors apply creates per rank, MiB (batch itself: {batch_bytes * MIB:.1f} MiB)", Spread.of(created), MIB),
    ]
    table = markdown_table(
        ["batch", "what", "runs", "ms p50 (min..max)", "ms p99", "bar", "verdict"], [r.cells(size.label) for r in rows]
    )
    check_line = (
        f"Checking the batch costs {ratio:.3%} of applying the plan: the {len(check)} ranks' checks (each timed "
        f"right before its rank's apply) and as many lengths keys (p50), over the sum of the applies; bar "
        f"{CHECK_BAR}, {verdict(ratio <= CHECK_BAR_RATIO)}."
    )
    suffix = "_smoke" if smoke else ""
    return write_report(
        out, f"trainer_cost{suffix}", "Trainer-side cost of applying a plan",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nThe plan has {len(plan.micro_batches)} micro-batches; the verdict uses p99 over the ranks.",
        [("Results", table), ("Checking the batch against the plan", check_line)],
        rows=rows,
        bars=[Bar(f"{size.label}: {r.what}", APPLY_BAR, r.met) for r in rows if r.met is not None],
    )


def main(argv: list[str] | None = None) -> None:
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    print(run(args.out, args.smoke).path.read_text())


if __name__ == "__main__":
    main()
