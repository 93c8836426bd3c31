"""Applying a plan padded for FP8 (trainer_client/plans/apply.py): every rank's rows of every pass are
the plan's precision's multiple (`row_multiple_of`), and a pass whose padding lost that alignment is
refused at the boundary, naming the pass, its rows, the multiple and the precision (UnrunnablePlanError),
before Transformer Engine's GEMMs would refuse it deep inside the step."""

from __future__ import annotations

import itertools

import pytest
import torch

from batch_planner import padding
from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import CapacityBound, PlanRequest, SchedulerKind
from tests.support.megatron_builds import best_local_scheduler
from trainer_client.errors import UnrunnablePlanError
from trainer_client.plans import apply
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import GlobalBatch, JaggedField

LENGTHS = (3001, 1499, 701, 499, 301, 97, 1003, 63, 17, 5)


def _batch(lengths) -> GlobalBatch:
    starts = tuple(itertools.accumulate(lengths, initial=0))[:-1]
    return GlobalBatch(tuple(lengths), {"input_ids": JaggedField(torch.zeros(sum(lengths), dtype=torch.long), starts)}, {})


def _plan(precision: Precision, tp: int = 2, scheduler: SchedulerKind | None = None):
    return plan_batch(PlanRequest.of(LENGTHS, 2, 2, 1024, scheduler=scheduler or best_local_scheduler(), precision=precision,
                                     tensor_parallel_size=tp, sequence_parallel=True))


@pytest.mark.parametrize("precision", list(Precision))
def test_every_ranks_rows_of_every_pass_are_the_precisions_multiple(precision):
    plan = _plan(precision)
    multiple = padding.row_multiple_of(plan)
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    for rank in range(plan.dp_cp_size):
        for unit in micro_batches_for_rank(plan, _batch(LENGTHS), rank, pack_group_samples=packed, with_packed_seq_params=False):
            rows = int(unit.cu_seqlens_padded[-1]) // unit.local_cp_size
            assert rows % multiple == 0 and rows == len(unit.position_ids), (precision, rank, unit.micro_batch_index, rows)


def test_a_pass_whose_padding_lost_the_alignment_is_refused_naming_it(monkeypatch):
    """Planted: the padding step applies the layout's rule only (the row multiple dropped), while the plan
    says FP8; the guard reads the multiple from the plan itself."""
    plan = _plan(Precision.FP8_DELAYED)
    real = apply.group_padded_lengths
    monkeypatch.setattr(apply, "group_padded_lengths", lambda *args: real(*args[:-1], 1))
    with pytest.raises(UnrunnablePlanError) as caught:
        for rank in range(plan.dp_cp_size):
            micro_batches_for_rank(plan, _batch(LENGTHS), rank, with_packed_seq_params=False)
    error, message = caught.value, str(caught.value)
    assert error.option == "rows" and isinstance(error, RuntimeError)
    assert "micro-batch " in message and "samples [" in message and "CP group [" in message
    assert "not a multiple of 16" in message and "precision fp8_delayed" in message and f"rows={error.value!r}" in message
    # With the real padding the same plan applies.
    monkeypatch.setattr(apply, "group_padded_lengths", real)
    for rank in range(plan.dp_cp_size):
        micro_batches_for_rank(plan, _batch(LENGTHS), rank, with_packed_seq_params=False)
