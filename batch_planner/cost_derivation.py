"""Cost-model coefficients from the job's model and hardware (docs/cost-model.md, "Coefficients from
the model and the hardware").

`CostModel` (batch_planner/cost_spec.py) prices a plan with five coefficients. Here a `ModelProfile`
(the decoder's shape) and a `HardwareProfile` (what one GPU sustains, the link between CP ranks, the
fixed costs of a pass) turn into those coefficients, so a job can name its model instead of
fitting seconds by hand. All counts are for the whole model on one rank of a TP group of size t:

    FLOPs per token and layer   F_tok  = 6 * active matmul parameters of one layer
                                         (forward 2, backward 4 FLOPs per parameter and token)
    FLOPs per L^2 and layer     F_attn = 7 * heads * head_dim
                                         (causal: L^2 / 2 pairs; per pair 4 * heads * head_dim
                                          forward (Q.K^T and P.V), backward 2.5x the forward)
    output layer per token      F_out  = 6 * hidden * vocab

    seconds_per_token                = (layers * F_tok + F_out) / (t * peak * sustained_fraction)
    seconds_per_attention_token_pair = layers * F_attn / (t * peak * attention_sustained_fraction)
    cp_seconds_per_token             = cp_exposed_fraction * layers * 3 * KV bytes per token
                                       / (t * cp_bandwidth)
                                       (KV bytes = 2 * kv_heads * head_dim * bytes_per_value; the
                                        ring sends K,V forward, and K,V plus dK,dV backward: 3x)
    seconds_per_pass                 = seconds_per_pass_base + layers * seconds_per_layer_pass
    cp_seconds_per_micro_batch       = layers * cp_seconds_per_layer_pass    (per ring step)

Active parameters of one layer: Q and O projections (hidden x heads*head_dim each), K and V
(hidden x kv_heads*head_dim each), and the MLP: 3 (gated, SwiGLU) or 2 matrices of hidden x FFN
width, where a mixture of experts counts its router (hidden x experts) and top_k experts of
moe_ffn_hidden_size. Norms, rotary embedding and activations do no matrix work: their time is in
the sustained fractions, which are calibrated from timed layers (bench/gpu/layer_timing.py).
"""

from __future__ import annotations

import dataclasses

from batch_planner.cost_spec import (
    CALIBRATED_PRESET,
    REPLAY_PRESETS,
    TOY_ENGINE_COEFFICIENTS,
    COEFFICIENTS_FIELD,
    CostModel,
    CostModelSpec,
    HardwareProfile,
    ModelProfile,
    preset_profiles,
    validate_coefficients,
)
from batch_planner.errors import InvalidRequestError

TP_FIELD = "layout.tensor_parallel_size"


def matmul_params_per_layer(model: ModelProfile) -> int:
    """Parameters one token multiplies through in one layer (its active parameters)."""
    h = model.hidden_size
    attention = 2 * h * model.num_attention_heads * model.head_dim + 2 * h * model.num_kv_heads * model.head_dim
    matrices = 3 if model.gated_mlp else 2
    if model.is_moe:
        mlp = h * model.num_experts + matrices * h * model.moe_top_k * model.moe_ffn_hidden_size
    else:
        mlp = matrices * h * model.ffn_hidden_size
    return attention + mlp


def flops_per_token_per_layer(model: ModelProfile) -> float:
    return 6.0 * matmul_params_per_layer(model)


def flops_per_attention_unit_per_layer(model: ModelProfile) -> float:
    """FLOPs per unit of L^2 (causal: L^2/2 pairs), forward + backward."""
    return 7.0 * model.num_attention_heads * model.head_dim


def output_flops_per_token(model: ModelProfile) -> float:
    return 6.0 * model.hidden_size * model.vocab_size


def cp_bytes_per_token_per_layer(model: ModelProfile) -> float:
    """Bytes a ring-attention rank receives per token of the other ranks' shards, fwd + bwd."""
    kv = 2 * model.num_kv_heads * model.head_dim * model.bytes_per_value
    return 3.0 * kv


def derive_cost_model(model: ModelProfile, hardware: HardwareProfile, tensor_parallel_size: int = 1) -> CostModel:
    """The five coefficients by the formulas of this module's docstring."""
    t = _checked_tp(tensor_parallel_size)
    layers = model.num_layers
    compute = t * hardware.peak_bf16_flops
    token_flops = layers * flops_per_token_per_layer(model) + output_flops_per_token(model)
    cp_bytes = layers * cp_bytes_per_token_per_layer(model)
    derived = CostModel(
        seconds_per_token=token_flops / (compute * hardware.sustained_fraction),
        seconds_per_attention_token_pair=layers * flops_per_attention_unit_per_layer(model) / (compute * hardware.attention_sustained_fraction),
        cp_seconds_per_micro_batch=layers * hardware.cp_seconds_per_layer_pass,
        cp_seconds_per_token=hardware.cp_exposed_fraction * cp_bytes / (t * hardware.cp_bandwidth_bytes_per_second),
        seconds_per_pass=hardware.seconds_per_pass_base + layers * hardware.seconds_per_layer_pass,
    )
    return validate_coefficients(derived, COEFFICIENTS_FIELD)


def hardware_from_fit(model: ModelProfile, fitted: CostModel, tensor_parallel_size: int, peak_bf16_flops: float) -> HardwareProfile:
    """The hardware profile under which `model` at this TP size derives `fitted`: the inverse of
    `derive_cost_model` (the fixed costs all per layer, none per pass alone; the CP traffic as an
    effective bandwidth wholly exposed, the bandwidth the fitted per-token CP term implies). What makes the
    model+hardware path agree with a replay's fit (bench/gpu/replay/report.py calibrates the GPU's
    profile from one model's fit and checks the others against it). Raises InvalidRequestError when
    the fit implies a fraction outside its range (above the peak, say)."""
    t = _checked_tp(tensor_parallel_size)
    layers, compute = model.num_layers, t * peak_bf16_flops
    token_flops = layers * flops_per_token_per_layer(model) + output_flops_per_token(model)
    cp_bytes = layers * cp_bytes_per_token_per_layer(model)
    fastest = 1e13  # HardwareProfile's largest bandwidth: a CP term of 0 is a link that costs nothing
    bandwidth = min(fastest, cp_bytes / (t * fitted.cp_seconds_per_token)) if fitted.cp_seconds_per_token else fastest
    values = dict(
        peak_bf16_flops=peak_bf16_flops,
        sustained_fraction=token_flops / (compute * fitted.seconds_per_token) if fitted.seconds_per_token else 1.0,
        attention_sustained_fraction=(layers * flops_per_attention_unit_per_layer(model) / (compute * fitted.seconds_per_attention_token_pair)
                                      if fitted.seconds_per_attention_token_pair else 1.0),
        cp_bandwidth_bytes_per_second=bandwidth,
        cp_exposed_fraction=1.0 if fitted.cp_seconds_per_token else 0.0,
        seconds_per_layer_pass=fitted.seconds_per_pass / layers,
        seconds_per_pass_base=0.0,
        cp_seconds_per_layer_pass=fitted.cp_seconds_per_micro_batch / layers,
    )
    return HardwareProfile.from_mapping(values, "hardware_from_fit")


def _checked_tp(t: object) -> int:
    if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1024:
        raise InvalidRequestError(f"{TP_FIELD}: got {t!r}; allowed an integer in [1, 1024]", field=TP_FIELD)
    return t


def layer_terms(model: ModelProfile, hardware: HardwareProfile, tensor_parallel_size: int = 1) -> dict[str, float]:
    """Per-token and per-L^2 seconds of ONE layer: what bench/gpu/layer_timing.py measures."""
    compute = tensor_parallel_size * hardware.peak_bf16_flops
    return {
        "seconds_per_token": flops_per_token_per_layer(model) / (compute * hardware.sustained_fraction),
        "seconds_per_attention_token_pair": flops_per_attention_unit_per_layer(model) / (compute * hardware.attention_sustained_fraction),
    }


def cost_model_for_preset(name: str, tensor_parallel_size: int = 1) -> CostModel:
    """A preset's coefficients. The replay's fits and the derived presets divide the matrix work and
    the CP traffic over the TP group (the fixed costs stay): a fit at TP f, at TP t, scales them by
    f / t; the toy engine's calibration is a fixed set measured at TP 1 and ignores it."""
    if name == CALIBRATED_PRESET:
        return TOY_ENGINE_COEFFICIENTS
    if name in REPLAY_PRESETS:
        preset = REPLAY_PRESETS[name]
        scale = preset.tensor_parallel_size / _checked_tp(tensor_parallel_size)
        fitted = preset.coefficients
        return validate_coefficients(dataclasses.replace(
            fitted, seconds_per_token=fitted.seconds_per_token * scale,
            seconds_per_attention_token_pair=fitted.seconds_per_attention_token_pair * scale,
            cp_seconds_per_token=fitted.cp_seconds_per_token * scale,
        ), COEFFICIENTS_FIELD)
    model, hardware = preset_profiles(name)
    return derive_cost_model(model, hardware, tensor_parallel_size)


def resolve_cost_model(spec: CostModelSpec | None, default: CostModel, tensor_parallel_size: int = 1) -> CostModel:
    """A request's cost model for a job of this TP size: its own spec's coefficients, else the
    server's default."""
    if spec is None:
        return default
    if spec.coefficients is not None:
        return spec.coefficients
    if spec.preset:
        return cost_model_for_preset(spec.preset, tensor_parallel_size)
    assert spec.model is not None and spec.hardware is not None
    return derive_cost_model(spec.model, spec.hardware, tensor_parallel_size)
