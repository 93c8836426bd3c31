"""The precision the Megatron drop-ins derive (trainer_client/dropin/settings.py, `megatron_precision`,
through `planner_settings_of`): Megatron-Core's `fp8` and `fp8_recipe` (as a string, as
Megatron-Core's own Fp8Recipe enum, and on its real TransformerConfig) give the precision the plan
pads for; a recipe the planner has no alignment for is a ConfigError naming the allowed ones; a
planner setting that disagrees with the trainer is refused naming both, through Megatron-LM's
drop-in's entry point (`megatron_planner_config`)."""

from __future__ import annotations

import warnings

import pytest

from batch_planner.precision import MEGATRON_FP8_RECIPES, Precision
from batch_planner.request import SchedulerKind
from tests.support.dropin_support import megatron_config
from trainer_client.dropin.settings import megatron_precision, planner_settings_of
from trainer_client.errors import ConfigError
from trainer_client.megatron_lm.checks import megatron_planner_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.enums import Fp8Recipe

RECIPES = ["delayed", "tensorwise", "blockwise", "mxfp8"]
EXPECTED = {"delayed": Precision.FP8_DELAYED, "tensorwise": Precision.FP8_CURRENT, "blockwise": Precision.FP8_BLOCK, "mxfp8": Precision.MXFP8}


def test_the_table_names_every_recipe_megatron_core_has_but_custom():
    assert set(MEGATRON_FP8_RECIPES) == {r.value for r in Fp8Recipe} - {"custom"} == set(EXPECTED)


@pytest.mark.parametrize("recipe", [*RECIPES, *(Fp8Recipe(r) for r in RECIPES), None])
@pytest.mark.parametrize("fp8", [None, "e4m3", "hybrid"])
def test_fp8_and_its_recipe_give_the_precision(fp8, recipe):
    config = megatron_config(fp8=fp8, fp8_recipe=recipe)
    expected = Precision.BF16 if fp8 is None else EXPECTED[getattr(recipe, "value", recipe) or "delayed"]  # Megatron-Core's default: delayed
    assert megatron_precision(config) is expected
    assert planner_settings_of(config, SchedulerKind.DYNAMIC_CP, 2).precision is expected


def test_a_config_without_the_fields_runs_bf16():
    assert megatron_precision(megatron_config()) is Precision.BF16


@pytest.mark.parametrize("recipe", ["custom", Fp8Recipe.custom, "nvfp4"])
def test_a_recipe_without_alignment_is_refused_naming_the_allowed(recipe):
    with pytest.raises(ConfigError) as caught:
        megatron_precision(megatron_config(fp8="e4m3", fp8_recipe=recipe))
    message = str(caught.value)
    assert message.startswith(f"fp8_recipe: {getattr(recipe, 'value', recipe)!r} with fp8='e4m3' has no row alignment"), message
    assert "allowed with dynamic CP: delayed, tensorwise, blockwise, mxfp8" in message


def test_megatron_cores_real_config_gives_the_precision_and_sequence_parallelism():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

        model = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="hybrid", fp8_recipe=Fp8Recipe.blockwise,
                                  tensor_model_parallel_size=2, sequence_parallel=True)
    model.max_seqlen_per_dp_cp_rank = 512
    derived = planner_settings_of(model, SchedulerKind.DYNAMIC_CP, 2)
    assert (derived.precision, derived.sequence_parallel, derived.tensor_parallel_size) == (Precision.FP8_BLOCK, True, 2)


def test_megatron_lms_drop_in_plans_for_the_models_precision():
    config = megatron_planner_config(megatron_config(fp8="e4m3", fp8_recipe="tensorwise", tensor_model_parallel_size=2,
                                                     sequence_parallel=True), SchedulerKind.DYNAMIC_CP, 2)
    assert (config.precision, config.sequence_parallel, config.tensor_parallel_size) == (Precision.FP8_CURRENT, True, 2)
    plain = megatron_planner_config(megatron_config(), SchedulerKind.DYNAMIC_CP, 2)
    assert (plain.precision, plain.sequence_parallel) == (Precision.BF16, False)


@pytest.mark.parametrize(("given", "model", "said", "runs"), [
    ({"precision": "bf16"}, dict(fp8="e4m3"), "'bf16'", "'fp8_delayed'"),
    ({"precision": "fp8_delayed"}, dict(fp8="hybrid", fp8_recipe="blockwise"), "'fp8_delayed'", "'fp8_block'"),
    ({"precision": "fp8_current"}, dict(), "'fp8_current'", "'bf16'"),
    ({"sequence_parallel": True}, dict(fp8="e4m3", sequence_parallel=False), "True", "False"),
])
def test_a_planner_setting_that_disagrees_with_the_trainer_is_refused_naming_both(given, model, said, runs):
    key = next(iter(given))
    with pytest.raises(ConfigError) as caught:
        megatron_planner_config(megatron_config(**model), SchedulerKind.DYNAMIC_CP, 2, given)
    message = str(caught.value)
    assert message.startswith(f"{key}: the planner settings say {said} but Megatron runs {runs}"), message
    assert f"drop {key} from the planner settings" in message


def test_a_planner_setting_that_agrees_is_taken():
    config = megatron_planner_config(megatron_config(fp8="e4m3", fp8_recipe="mxfp8"), SchedulerKind.DYNAMIC_CP, 2, {"precision": "mxfp8"})
    assert config.precision is Precision.MXFP8
