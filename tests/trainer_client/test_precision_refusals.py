"""FP8 in the refusal table (trainer_client/refusals/compatibility.py, trainer_client/verl/refusals.py):
the Megatron-LM and Bridge drop-ins run FP8 (their plans are padded for it, batch_planner/precision.py),
so the core no longer refuses `fp8`; it refuses a plan or planner config made for another precision
than the model runs, a recipe the planner has no alignment for, and NVFP4. verl's dynamic CP runs bf16
only (verl's docs), and its drop-in equals verl: its own rows keep refusing FP8. No verl needed: the
verl drop-in's settings and checks are plain Python."""

from __future__ import annotations

import pytest

from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import CpLayout, PlanRequest
from trainer_client.errors import UnrunnablePlanError, UnsupportedCombinationError
from trainer_client.refusals.compatibility import check, rules_of
from trainer_client.verl.refusals import ROWS, SOURCE
from trainer_client.verl.settings import verl_planner_config

LENGTHS = (3000, 1500, 700, 500, 301, 97, 1000, 64)


def _verl_config(**settings):
    return verl_planner_config(settings, max_seqlen_per_dp_cp_rank=1024, cp_size=2, tp_size=1, cp_layout=CpLayout.ZIGZAG)


@pytest.mark.parametrize("precision", [p.value for p in Precision if p is not Precision.BF16])
def test_verls_drop_in_refuses_a_planner_setting_of_fp8_by_its_own_row(precision):
    with pytest.raises(UnsupportedCombinationError) as caught:
        _verl_config(precision=precision)
    error = caught.value
    assert error.rule in ROWS and error.rule.needs == (SOURCE,) and error.option == "precision"
    assert precision in str(error)
    assert "verl's docs: no FP8" in str(error) and "Megatron-LM and Bridge" in str(error)


def test_verls_drop_in_runs_bf16_as_before():
    assert _verl_config().precision is Precision.BF16
    assert _verl_config(precision="bf16").precision is Precision.BF16


def test_verls_drop_in_refuses_a_plan_padded_for_fp8_as_unrunnable():
    fp8_plan = plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024, precision=Precision.FP8_CURRENT))
    with pytest.raises(UnrunnablePlanError, match="verl's dynamic CP runs bf16 only") as caught:
        check({SOURCE: {"tp_size": 1, "cp_layout": "zigzag"}, "plan": fp8_plan})
    assert caught.value.option == "precision" and caught.value.rule in ROWS
    check({SOURCE: {"tp_size": 1, "cp_layout": "zigzag"}, "plan": plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024))})


def test_verls_rows_apply_to_verl_only():
    """The same FP8 planner config passes the core's rows when no verl source is given (the generic
    client and the Megatron drop-ins), and verl's own rows are in verl's part of the table."""
    from trainer_client import PlannerClientConfig

    check({"planner config": PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, precision="fp8_delayed")})
    assert all(rule in rules_of(SOURCE) for rule in ROWS)


def test_the_core_no_longer_refuses_fp8_for_a_plan_padded_for_it():
    """What the Megatron drop-ins hand the table each step: the transformer config, the planner config
    and the plan, all in the same FP8 recipe."""
    import warnings

    from trainer_client import PlannerClientConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.enums import Fp8Recipe
        from megatron.core.transformer.transformer_config import TransformerConfig

        model = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, calculate_per_token_loss=True,
                                  fp8="hybrid", fp8_recipe=Fp8Recipe.tensorwise)
    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, precision="fp8_current")
    plan = plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024, precision=Precision.FP8_CURRENT))
    check({"transformer": model, "planner config": config, "plan": plan})
