"""Cost-model coefficients from model and hardware profiles (batch_planner/cost_spec.py, the profiles;
batch_planner/cost_derivation.py, the formulas)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from batch_planner.cost_derivation import (
    cost_model_for_preset,
    cp_bytes_per_token_per_layer,
    derive_cost_model,
    layer_terms,
    matmul_params_per_layer,
)
from batch_planner.cost_spec import (
    CALIBRATED_PRESET,
    COEFFICIENT_NAMES,
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    CostModel,
    HardwareProfile,
    ModelProfile,
    cost_model_from_coefficients,
    preset_hardware,
    preset_names,
)
from batch_planner.errors import InvalidRequestError

DATA = Path(__file__).resolve().parents[2] / "docs" / "gpu-benchmark-data"
# The one-layer runs carry the <= 20% claim of docs/cost-model.md; the 4-layer stack run is
# reported there too, with its one miss.
ONE_LAYER_RUNS = ("layer_timing_run1.json", "layer_timing_run2.json")
LLAMA8B = MODEL_PROFILES["llama3-8b"]
H200 = HARDWARE_PROFILES["h200"]


def _profile_values(profile) -> dict:
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile) if f.name != "field_prefix"}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_finite_and_prices_work(name: str) -> None:
    model = cost_model_for_preset(name)
    for f in dataclasses.fields(CostModel):
        assert math.isfinite(getattr(model, f.name)) and getattr(model, f.name) >= 0.0, f.name
    assert model.seconds_per_token > 0 and model.seconds_per_attention_token_pair > 0
    assert model.seconds_per_pass > 0 and model.cp_seconds_per_micro_batch > 0


def test_the_default_is_the_replays_llama3_8b_fit_and_the_toy_engine_stays_a_preset() -> None:
    from batch_planner.cost_spec import DEFAULT_PRESET, REPLAY_PRESETS, TOY_ENGINE_COEFFICIENTS

    assert DEFAULT_PRESET == "llama3-8b-h100" and REPLAY_PRESETS[DEFAULT_PRESET].tensor_parallel_size == 1
    assert cost_model_for_preset(DEFAULT_PRESET) == CostModel() == REPLAY_PRESETS[DEFAULT_PRESET].coefficients
    assert cost_model_for_preset(CALIBRATED_PRESET) == TOY_ENGINE_COEFFICIENTS != CostModel()


def test_bench_stack_derived_agrees_with_its_two_gpu_calibration() -> None:
    """Two independent measurements of one model: the derived bench-4l-2048 (one-GPU layer
    timings) and the 2x H200 plan fit of the toy engine (the defaults before the replay)."""
    from batch_planner.cost_spec import TOY_ENGINE_COEFFICIENTS

    derived, calibrated = cost_model_for_preset("bench-4l-2048-h200"), TOY_ENGINE_COEFFICIENTS
    assert derived.seconds_per_token == pytest.approx(calibrated.seconds_per_token, rel=0.05)
    assert derived.seconds_per_attention_token_pair == pytest.approx(
        calibrated.seconds_per_attention_token_pair, rel=0.2
    )
    assert derived.seconds_per_pass == pytest.approx(calibrated.seconds_per_pass)
    assert derived.cp_seconds_per_micro_batch == pytest.approx(calibrated.cp_seconds_per_micro_batch)


def test_bigger_models_cost_more() -> None:
    small, large = cost_model_for_preset("llama3-8b-h200"), cost_model_for_preset("llama3-70b-h200")
    assert large.seconds_per_token > 5 * small.seconds_per_token
    assert large.seconds_per_attention_token_pair > small.seconds_per_attention_token_pair
    assert large.seconds_per_pass > small.seconds_per_pass
    # The scale check: the 32-layer 8B is ~30x the toy engine's calibrated 4-layer stack per token.
    from batch_planner.cost_spec import TOY_ENGINE_COEFFICIENTS

    assert 25 < small.seconds_per_token / TOY_ENGINE_COEFFICIENTS.seconds_per_token < 40


def test_more_kv_heads_more_cp_traffic() -> None:
    mha = dataclasses.replace(LLAMA8B, num_kv_heads=32)
    assert cp_bytes_per_token_per_layer(mha) == 4 * cp_bytes_per_token_per_layer(LLAMA8B)
    assert derive_cost_model(mha, H200).cp_seconds_per_token > derive_cost_model(LLAMA8B, H200).cp_seconds_per_token
    # Attention FLOPs depend on the query heads only.
    assert derive_cost_model(mha, H200).seconds_per_attention_token_pair == pytest.approx(
        derive_cost_model(LLAMA8B, H200).seconds_per_attention_token_pair
    )


def test_tensor_parallel_divides_the_work_not_the_fixed_costs() -> None:
    tp1, tp8 = (
        cost_model_for_preset("llama3-70b-h200"),
        cost_model_for_preset("llama3-70b-h200", tensor_parallel_size=8),
    )
    assert tp8.seconds_per_token == pytest.approx(tp1.seconds_per_token / 8)
    assert tp8.cp_seconds_per_token == pytest.approx(tp1.cp_seconds_per_token / 8)
    assert tp8.seconds_per_pass == tp1.seconds_per_pass


def test_moe_counts_active_experts_only() -> None:
    qwen = MODEL_PROFILES["qwen3-30b-a3b"]
    all_experts = dataclasses.replace(qwen, moe_top_k=qwen.num_experts)
    assert matmul_params_per_layer(qwen) < matmul_params_per_layer(all_experts) / 10


def test_profiles_round_trip_through_mappings() -> None:
    assert ModelProfile.from_mapping(_profile_values(LLAMA8B)) == LLAMA8B
    assert HardwareProfile.from_mapping(_profile_values(H200)) == H200
    assert cost_model_from_coefficients(dataclasses.asdict(CostModel())) == CostModel()


def _model_with(**change):
    return lambda: ModelProfile.from_mapping({**_profile_values(LLAMA8B), **change})


def _model_without(name):
    return lambda: ModelProfile.from_mapping({k: v for k, v in _profile_values(LLAMA8B).items() if k != name})


def _hardware_with(**change):
    return lambda: HardwareProfile.from_mapping({**_profile_values(H200), **change})


def _coefficients_with(**change):
    return lambda: cost_model_from_coefficients({**dataclasses.asdict(CostModel()), **change})


BAD_INPUT = [
    ("unknown preset", lambda: cost_model_for_preset("llama9-400b-tpu"), "cost_model.preset", "llama3-8b-h200"),
    ("unknown hardware", lambda: preset_hardware("a100"), "cost_model.hardware", "h200"),
    ("missing layers", _model_without("num_layers"), "cost_model.model.num_layers", "[1, 1024]"),
    ("zero hidden", _model_with(hidden_size=0), "cost_model.model.hidden_size", "[64, 131072]"),
    ("negative heads", _model_with(num_attention_heads=-32), "cost_model.model.num_attention_heads", "[1, 1024]"),
    ("absurd layers", _model_with(num_layers=10**6), "cost_model.model.num_layers", "[1, 1024]"),
    ("float layers", _model_with(num_layers=32.5), "cost_model.model.num_layers", "integer"),
    ("bool as a number", _model_with(num_layers=True), "cost_model.model.num_layers", "integer"),
    ("NaN head dim", _model_with(head_dim=float("nan")), "cost_model.model.head_dim", "[8, 1024]"),
    ("kv heads not dividing", _model_with(num_kv_heads=5), "cost_model.model.num_kv_heads", "divide"),
    ("dense without MLP", _model_with(ffn_hidden_size=0), "cost_model.model.ffn_hidden_size", "[1, 1048576]"),
    ("half a MoE", _model_with(num_experts=8), "cost_model.model.num_experts", "all 0"),
    (
        "top-k above experts",
        _model_with(num_experts=8, moe_top_k=16, moe_ffn_hidden_size=512),
        "cost_model.model.moe_top_k",
        "num_experts",
    ),
    ("zero bytes per value", _model_with(bytes_per_value=0), "cost_model.model.bytes_per_value", "[1, 8]"),
    ("unknown model field", _model_with(hidden=4096), "cost_model.model.hidden", "known"),
    ("zero peak", _hardware_with(peak_bf16_flops=0.0), "cost_model.hardware.peak_bf16_flops", "[1e+12, 1e+17]"),
    (
        "infinite peak",
        _hardware_with(peak_bf16_flops=math.inf),
        "cost_model.hardware.peak_bf16_flops",
        "[1e+12, 1e+17]",
    ),
    (
        "fraction above 1",
        _hardware_with(sustained_fraction=1.5),
        "cost_model.hardware.sustained_fraction",
        "[0.001, 1]",
    ),
    (
        "zero attention fraction",
        _hardware_with(attention_sustained_fraction=0.0),
        "cost_model.hardware.attention_sustained_fraction",
        "[0.001, 1]",
    ),
    (
        "negative bandwidth",
        _hardware_with(cp_bandwidth_bytes_per_second=-1.0),
        "cost_model.hardware.cp_bandwidth_bytes_per_second",
        "[1e+08, 1e+13]",
    ),
    (
        "fixed cost in ms",
        _hardware_with(seconds_per_layer_pass=450.0),
        "cost_model.hardware.seconds_per_layer_pass",
        "[0, 0.1]",
    ),
    ("string value", _hardware_with(cp_exposed_fraction="0.1"), "cost_model.hardware.cp_exposed_fraction", "[0, 1]"),
    (
        "every plan free",
        _coefficients_with(seconds_per_token=0.0, seconds_per_attention_token_pair=0.0),
        "cost_model.seconds_per_token",
        "(0, 0.1]",
    ),
    ("infinite coefficient", _coefficients_with(seconds_per_pass=math.inf), "cost_model.seconds_per_pass", "[0, 60]"),
    (
        "negative coefficient",
        _coefficients_with(cp_seconds_per_token=-1e-9),
        "cost_model.cp_seconds_per_token",
        "[0, 0.1]",
    ),
    ("NaN coefficient", _coefficients_with(seconds_per_token=math.nan), "cost_model.seconds_per_token", "[0, 0.1]"),
    (
        "absurd coefficient",
        _coefficients_with(seconds_per_attention_token_pair=1.0),
        "cost_model.seconds_per_attention_token_pair",
        "[0, 0.0001]",
    ),
    (
        "missing coefficient",
        lambda: cost_model_from_coefficients({"seconds_per_token": 1e-6}),
        "cost_model.seconds_per_attention_token_pair",
        "missing",
    ),
    ("unknown coefficient", _coefficients_with(seconds_per_flop=1.0), "cost_model.seconds_per_flop", "known"),
    (
        "bad TP",
        lambda: cost_model_for_preset("llama3-8b-h200", tensor_parallel_size=0),
        "layout.tensor_parallel_size",
        "[1, 1024]",
    ),
]


@pytest.mark.parametrize(("case", "call", "field", "allowed"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_names_field_and_range(case: str, call, field: str, allowed: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.field == field
    message = str(info.value)
    assert field in message and allowed in message, message


@pytest.mark.parametrize("run", ONE_LAYER_RUNS)
def test_committed_gpu_timings_within_tolerance_of_derived(run: str) -> None:
    """Re-derives the terms with today's code from the committed H200 layer timings."""
    report = json.loads((DATA / run).read_text())
    assert report["layers"] == 1 and "H200" in report["device"]
    assert set(report["shapes"]) == set(MODEL_PROFILES)
    for name, shape in report["shapes"].items():
        derived = layer_terms(MODEL_PROFILES[name], preset_hardware(report["hardware"]))
        for term, value in derived.items():
            measured = shape["measured"][term]
            assert abs(value / measured - 1.0) <= report["tolerance"] == 0.20, (name, term, value, measured)


# ---------------------------------------------------------------- the replay's presets


def test_a_replay_preset_takes_the_derived_ones_place_and_scales_its_work_by_tp(monkeypatch) -> None:
    from batch_planner import cost_spec
    from batch_planner.cost_spec import ReplayPreset

    fitted = CostModel(seconds_per_token=4e-5, seconds_per_attention_token_pair=2e-10, cp_seconds_per_micro_batch=3e-3,
                       cp_seconds_per_token=1e-8, seconds_per_pass=2e-3)
    monkeypatch.setitem(cost_spec.REPLAY_PRESETS, "llama3-70b-h100", ReplayPreset(8, fitted))
    names = preset_names()
    assert names.count("llama3-70b-h100") == 1 and names[0] == CALIBRATED_PRESET
    assert cost_model_for_preset("llama3-70b-h100", 8) == fitted
    at_four = cost_model_for_preset("llama3-70b-h100", 4)  # half the TP group: twice the work a rank
    assert at_four.seconds_per_token == pytest.approx(8e-5) and at_four.seconds_per_attention_token_pair == pytest.approx(4e-10)
    assert at_four.cp_seconds_per_token == pytest.approx(2e-8)
    assert (at_four.seconds_per_pass, at_four.cp_seconds_per_micro_batch) == (fitted.seconds_per_pass, fitted.cp_seconds_per_micro_batch)
    with pytest.raises(InvalidRequestError, match="layout.tensor_parallel_size"):
        cost_model_for_preset("llama3-70b-h100", 0)


def test_the_replay_presets_are_the_replays_fit() -> None:
    """batch_planner's REPLAY_PRESETS and the fit bench/gpu/replay/report.py wrote are one thing."""
    from batch_planner.cost_spec import REPLAY_PRESETS

    fitted_file = Path(__file__).resolve().parents[2] / "docs" / "gpu-benchmark-data" / "replay" / "fitted.json"
    if not fitted_file.exists():
        assert REPLAY_PRESETS == {}, "REPLAY_PRESETS without the replay's fitted.json"
        pytest.skip(f"no replay fit yet ({fitted_file.name} is written by bench/gpu/replay/report.py after a GPU run)")
    fitted = json.loads(fitted_file.read_text())
    assert set(REPLAY_PRESETS) == set(fitted)
    for name, values in fitted.items():
        preset = REPLAY_PRESETS[name]
        assert preset.tensor_parallel_size == values["tensor_parallel_size"]
        assert dataclasses.asdict(preset.coefficients) == {k: v for k, v in values.items() if k != "tensor_parallel_size"}


@pytest.mark.parametrize("model_name, tp", [("llama3-8b", 1), ("llama3-70b", 8), ("qwen3-30b-a3b", 2)])
def test_hardware_from_a_fit_derives_that_fit_back(model_name: str, tp: int) -> None:
    from batch_planner.cost_derivation import hardware_from_fit

    model = MODEL_PROFILES[model_name]
    fitted = derive_cost_model(model, HARDWARE_PROFILES["h100"], tp)  # any coefficients the path can express
    hardware = hardware_from_fit(model, fitted, tp, HARDWARE_PROFILES["h100"].peak_bf16_flops)
    back = derive_cost_model(model, hardware, tp)
    for name in COEFFICIENT_NAMES:
        assert getattr(back, name) == pytest.approx(getattr(fitted, name), rel=1e-9), name


def test_a_fit_faster_than_the_peak_is_refused() -> None:
    from batch_planner.cost_derivation import hardware_from_fit

    impossible = CostModel(seconds_per_token=1e-9)
    with pytest.raises(InvalidRequestError, match="hardware_from_fit.sustained_fraction"):
        hardware_from_fit(MODEL_PROFILES["llama3-8b"], impossible, 1, 989.4e12)
