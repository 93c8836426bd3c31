"""FP8 and the Megatron-LM drop-in, on the CPU: what the GPU test
tests/trainer_client/transformer_engine/test_te_fp8_dynamic_cp.py relies on, checked without a GPU.

- The GPU test's lengths (tests/support/dropin_attention.py's steps, DP2 x CP2) make a plan for bf16
  in which some rank's rows in some pass are not a multiple of 16 (what Transformer Engine's FP8
  GEMMs take on an H100), the first such pass the same on every rank (the test runs it under
  delayed scaling, whose amax reduction spans every rank); the plans for FP8 (current and delayed
  scaling) hold multiples of 16 only; the planted rule (half the multiple: 8) holds multiples of 8
  of which some are not of 16, so the planted run meets cuBLASLt's check and not Transformer
  Engine's Python one.
- The drop-in packs each sample at the length the plan pads it to (`plan_padded_lengths`: each CP
  group's last sample topped up), so each rank's rows are the plan's; in bf16, the dataset's
  lengths unchanged (upstream's micro-batches, bitwise).
- `topped_up` adds padding rows that train nothing: token, label and loss mask 0, positions going on.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import batch_planner.precision as precision
from batch_planner.precision import Precision, RowRule, rank_row_multiple
from tests.support.dropin_attention import MAX_SEQLEN_PER_RANK, padded_length, step_samples
from tests.support.rank_rows import RECIPES, drop_in_plan, first_failure_is_shared, model_settings, not_multiples, rank_rows
from trainer_client.megatron_lm.packing import plan_padded_lengths, topped_up

DP = 2
STEPS = 2  # the GPU test's
FP8_ROWS = rank_row_multiple(Precision.FP8_CURRENT, 1, False)


def _lengths(step: int) -> list[int]:
    return [padded_length(len(s)) for s in step_samples(step, DP)]


def _plan(recipe: str | None, step: int):
    return drop_in_plan(model_settings(recipe, MAX_SEQLEN_PER_RANK), _lengths(step), DP)


def test_fp8_needs_rows_of_16_at_tp1():
    assert FP8_ROWS == 16 == rank_row_multiple(Precision.FP8_DELAYED, 1, False)


@pytest.mark.parametrize("step", range(STEPS))
def test_the_gpu_tests_bf16_plan_leaves_rows_fp8_refuses_and_the_first_such_pass_on_every_rank(step):
    plan = _plan(None, step)
    assert plan.precision is Precision.BF16
    rows = rank_rows(plan, _lengths(step), 1)
    assert not_multiples(rows, FP8_ROWS), rows
    assert first_failure_is_shared(rows, FP8_ROWS), rows


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("step", range(STEPS))
def test_the_gpu_tests_fp8_plans_hold_rows_of_16_where_the_layout_alone_would_not(recipe, step):
    plan = _plan(RECIPES[recipe], step)
    assert plan.precision is {"current": Precision.FP8_CURRENT, "delayed": Precision.FP8_DELAYED}[recipe]
    assert not_multiples(rank_rows(plan, _lengths(step), FP8_ROWS), FP8_ROWS) == []
    # The same plan's groups with the layout's padding alone: the alignment is what makes them 16.
    assert not_multiples(rank_rows(plan, _lengths(step), 1), FP8_ROWS), "the lengths test no alignment"


@pytest.mark.parametrize("step", range(STEPS))
def test_the_planted_half_rule_leaves_multiples_of_8_that_are_not_of_16(step):
    with mock.patch.dict(precision.ROW_RULES, {Precision.FP8_CURRENT: RowRule(shard=8, gemm=8)}):
        plan = _plan(RECIPES["current"], step)
        rows = rank_rows(plan, _lengths(step), rank_row_multiple(Precision.FP8_CURRENT, 1, False))
    assert not_multiples(rows, 8) == []
    assert not_multiples(rows, 16), rows
    assert first_failure_is_shared(rows, 16), rows


@pytest.mark.parametrize("recipe", [None, RECIPES["current"]])
def test_the_drop_in_packs_each_sample_at_the_plans_length(recipe):
    lengths = _lengths(0)
    plan = _plan(recipe, 0)
    padded = plan_padded_lengths(plan, lengths)
    if recipe is None:
        assert padded == lengths  # bf16: the dataset's lengths, as upstream packs them
        return
    assert padded != lengths and all(p >= n for p, n in zip(padded, lengths))
    for micro_batch, per_rank in zip(plan.micro_batches, rank_rows(plan, lengths, FP8_ROWS)):
        for rank, rows in enumerate(per_rank):
            group = micro_batch.group_of_rank(rank)
            assert sum(padded[i] for i in group.sample_ids) == rows * group.size
            # Only the group's last sample grows.
            assert all(padded[i] == lengths[i] for i in group.sample_ids[:-1])


def test_topped_up_rows_train_nothing():
    fields = {"tokens": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, 0]), "loss_mask": torch.tensor([1.0, 1.0, 0.0]),
              "position_ids": torch.arange(3)}
    out = topped_up(fields, 2)
    assert out["tokens"].tolist() == [5, 6, 7, 0, 0] and out["labels"].tolist() == [6, 7, 0, 0, 0]
    assert out["loss_mask"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and out["position_ids"].tolist() == [0, 1, 2, 3, 4]
    assert out["tokens"].dtype == torch.int64 and out["loss_mask"].dtype == torch.float32
    assert topped_up(fields, 0) is fields


@pytest.mark.attention
def test_the_gpu_tests_ranks_run_their_plans_on_the_cpu_stand_in(tmp_path):
    """The GPU test's rank function (test_te_fp8_dynamic_cp.fp8_rank) on four CPU ranks, the
    attention stand-in in fp32 (Megatron-Core enters no FP8 without Transformer Engine): the
    drop-in plans for the config's FP8 recipe, hands out the plan's rows (topped-up samples that
    train nothing: the loss and gradients equal the whole samples', padded to 16, at fp32's
    tolerance), and the runs without the alignment plan for bf16 and for the planted rule, pass by
    pass, every pass running here."""
    from functools import partial

    from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks
    from tests.trainer_client.transformer_engine.test_te_fp8_dynamic_cp import fp8_rank

    require_dynamic_build()
    jobs = ["current", "bf16-plan:delayed", "half:current"]
    per_rank = run_attention_ranks(partial(fp8_rank, jobs, "cpu-standin", 1), 4, tmp_path)
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    for r in per_rank:
        (step,) = r["current"]
        assert step["precision"] == "fp8_current" and step["row_multiple"] == FP8_ROWS, step
        assert step["fed_rows"] == [per_pass[r["dp_cp_rank"]] for per_pass in step["planned"]], step
        assert not_multiples(step["planned"], FP8_ROWS) == [] and not_multiples(step["layout_only"], FP8_ROWS), step
        assert step["tokens"] == step["reference_tokens"] > 0, step
        assert step["loss_difference"] <= 1e-5 and step["gradients_largest_entry"] <= 1e-4, step
        # The GPU test's yardstick, here without FP8: the whole samples' two runs are one computation,
        # and the plan's gradients equal theirs at fp32's tolerance.
        error = step["fp8_error"]
        assert error["whole_samples"] <= 1e-12 and error["dynamic_cp"] <= 1e-5 and error["dynamic_cp"] <= error["bound"], error
        for job, precision_name, multiple in (("bf16-plan:delayed", "bf16", 1), ("half:current", "fp8_current", 8)):
            record = r[job]
            assert (record["precision"], record["row_multiple"]) == (precision_name, multiple), record
            assert "skipped" not in record, record
            assert record["fed_rows"] == [per_pass[r["dp_cp_rank"]] for per_pass in record["planned"]], record
            assert not_multiples(record["planned"], FP8_ROWS), record
            assert [p["error"] for p in record["passes"]] == [None] * len(record["fed_rows"]), record
