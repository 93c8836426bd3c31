"""Cost-model coefficients from the job's model and hardware (docs/cost-model.md, "Coefficients from
the model and the hardware").

`CostModel` (batch_planner/cost.py) prices a plan with five coefficients. Here a `ModelProfile` (the
decoder's shape) and a `HardwareProfile` (what one GPU sustains, the link between CP ranks, the
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
    cp_seconds_per_micro_batch       = layers * cp_seconds_per_layer_pass

Active parameters of one layer: Q and O projections (hidden x heads*head_dim each), K and V
(hidden x kv_heads*head_dim each), and the MLP: 3 (gated, SwiGLU) or 2 matrices of hidden x FFN
width, where a mixture of experts counts its router (hidden x experts) and top_k experts of
moe_ffn_hidden_size. Norms, rotary embedding and activations do no matrix work: their time is in
the sustained fractions, which are calibrated from timed layers (bench/gpu/layer_timing.py).

Every profile and coefficient set is checked on construction; a bad one raises InvalidRequestError
naming the field (for example "cost_model.model.hidden_size") and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from batch_planner.cost import CostModel
from batch_planner.errors import InvalidRequestError

MODEL_FIELD = "cost_model.model"
HARDWARE_FIELD = "cost_model.hardware"
COEFFICIENTS_FIELD = "cost_model"
PRESET_FIELD = "cost_model.preset"


def _doc(text: str, low: float, high: float, **default: Any) -> Any:
    """A dataclass field with its documentation and allowed closed range [low, high] attached; a
    field with a `default` may be left out of a request."""
    return field(**default, metadata={"doc": text, "range": (low, high), "required": not default})


def _reject(name: str, value: Any, message: str) -> None:
    raise InvalidRequestError(f"{name}: got {value!r}; {message}", field=name)


def _check_number(name: str, value: Any, low: float, high: float, integer: bool) -> None:
    """One value against its range; bool is refused as a number (True would pass for 1)."""
    kind = "an integer" if integer else "a finite number"
    allowed = f"allowed {kind} in [{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _reject(name, value, allowed)
    if integer and not isinstance(value, int):
        _reject(name, value, allowed)
    if not math.isfinite(value) or not low <= value <= high:
        _reject(name, value, allowed)


def _from_mapping(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Build `cls` from a mapping (a request's fields), naming a missing or unknown field."""
    names = [f.name for f in _profile_fields(cls)]
    for key in values:
        if key not in names:
            _reject(f"{prefix}.{key}", values[key], f"unknown field; known: {', '.join(names)}")
    for f in _profile_fields(cls):
        if f.name not in values and f.metadata["required"]:
            low, high = f.metadata["range"]
            raise InvalidRequestError(
                f"{prefix}.{f.name}: missing; allowed [{low:g}, {high:g}]", field=f"{prefix}.{f.name}"
            )
    return cls(**dict(values), field_prefix=prefix)


@dataclass(frozen=True)
class ModelProfile:
    """The decoder's shape: what the FLOPs and the CP traffic are computed from."""

    num_layers: int = _doc("decoder layers (of one pipeline stage, when pipelined)", 1, 1024)
    hidden_size: int = _doc("model width", 64, 131072)
    num_attention_heads: int = _doc("query heads", 1, 1024)
    num_kv_heads: int = _doc("key/value heads (GQA); divides num_attention_heads", 1, 1024)
    head_dim: int = _doc("width of one attention head", 8, 1024)
    ffn_hidden_size: int = _doc("dense MLP width; 0 only for a model whose every MLP is MoE", 0, 1 << 20)
    vocab_size: int = _doc("output vocabulary; 0 counts no output layer (the GPU benchmark's stack)", 0, 1 << 24)
    gated_mlp: int = _doc("1: gated MLP (SwiGLU, 3 matrices); 0: plain (GELU, 2 matrices)", 0, 1)
    num_experts: int = _doc("MoE experts per layer; 0 for a dense model", 0, 4096, default=0)
    moe_top_k: int = _doc("experts each token is routed to; 0 for a dense model", 0, 4096, default=0)
    moe_ffn_hidden_size: int = _doc("width of one expert's MLP; 0 for a dense model", 0, 1 << 20, default=0)
    bytes_per_value: int = _doc("bytes of one activation value (bf16: 2)", 1, 8, default=2)
    field_prefix: str = field(default=MODEL_FIELD, compare=False, repr=False, metadata={"range": None})

    def __post_init__(self) -> None:
        _check_fields_of(self)
        self._check_relations()

    def _check_relations(self) -> None:
        p = self.field_prefix
        if self.num_attention_heads % self.num_kv_heads:
            _reject(
                f"{p}.num_kv_heads", self.num_kv_heads, f"must divide num_attention_heads ({self.num_attention_heads})"
            )
        moe = (self.num_experts, self.moe_top_k, self.moe_ffn_hidden_size)
        if any(moe) and not all(moe):
            _reject(
                f"{p}.num_experts", moe, "num_experts, moe_top_k and moe_ffn_hidden_size are all 0 (dense) or all > 0"
            )
        if self.moe_top_k > self.num_experts:
            _reject(f"{p}.moe_top_k", self.moe_top_k, f"allowed 1..num_experts ({self.num_experts})")
        if not self.is_moe and self.ffn_hidden_size == 0:
            _reject(f"{p}.ffn_hidden_size", 0, "a dense model needs an MLP width in [1, 1048576]")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = MODEL_FIELD) -> ModelProfile:
        return _from_mapping(cls, values, prefix)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def matmul_params_per_layer(self) -> int:
        """Parameters one token multiplies through in one layer (its active parameters)."""
        h = self.hidden_size
        attention = 2 * h * self.num_attention_heads * self.head_dim + 2 * h * self.num_kv_heads * self.head_dim
        matrices = 3 if self.gated_mlp else 2
        if self.is_moe:
            mlp = h * self.num_experts + matrices * h * self.moe_top_k * self.moe_ffn_hidden_size
        else:
            mlp = matrices * h * self.ffn_hidden_size
        return attention + mlp

    def flops_per_token_per_layer(self) -> float:
        return 6.0 * self.matmul_params_per_layer()

    def flops_per_attention_unit_per_layer(self) -> float:
        """FLOPs per unit of L^2 (causal: L^2/2 pairs), forward + backward."""
        return 7.0 * self.num_attention_heads * self.head_dim

    def output_flops_per_token(self) -> float:
        return 6.0 * self.hidden_size * self.vocab_size

    def cp_bytes_per_token_per_layer(self) -> float:
        """Bytes a ring-attention rank receives per token of the other ranks' shards, fwd + bwd."""
        kv = 2 * self.num_kv_heads * self.head_dim * self.bytes_per_value
        return 3.0 * kv


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU kind and its CP link, with the engine's fixed costs."""

    peak_bf16_flops: float = _doc("peak dense bf16 FLOP/s of one GPU (datasheet)", 1e12, 1e17)
    sustained_fraction: float = _doc("fraction of the peak a layer's token-wise work sustains", 1e-3, 1.0)
    attention_sustained_fraction: float = _doc("fraction of the peak causal attention sustains (fwd+bwd)", 1e-3, 1.0)
    cp_bandwidth_bytes_per_second: float = _doc("bandwidth one rank gets to its CP ring neighbour", 1e8, 1e13)
    cp_exposed_fraction: float = _doc("part of the CP traffic time not hidden behind attention", 0.0, 1.0)
    seconds_per_layer_pass: float = _doc("fixed seconds per layer and forward+backward pass", 0.0, 0.1)
    seconds_per_pass_base: float = _doc("fixed seconds per pass independent of the layer count", 0.0, 10.0)
    cp_seconds_per_layer_pass: float = _doc("extra fixed seconds per layer and pass over a CP group (c > 1)", 0.0, 1.0)
    field_prefix: str = field(default=HARDWARE_FIELD, compare=False, repr=False, metadata={"range": None})

    def __post_init__(self) -> None:
        _check_fields_of(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = HARDWARE_FIELD) -> HardwareProfile:
        return _from_mapping(cls, values, prefix)


def _profile_fields(obj: Any) -> list:
    return [f for f in fields(obj) if f.metadata.get("range") is not None]


def _check_fields_of(obj: Any) -> None:
    for f in _profile_fields(obj):
        low, high = f.metadata["range"]
        name = f"{obj.field_prefix}.{f.name}"
        _check_number(name, getattr(obj, f.name), low, high, f.type in ("int", int))


# A coefficient above its bound is a unit slip (milliseconds for seconds, a whole step per token),
# not a model: the bounds sit orders of magnitude above the largest preset.
COEFFICIENT_BOUNDS: dict[str, float] = {
    "seconds_per_token": 1e-1,
    "seconds_per_attention_token_pair": 1e-4,
    "cp_seconds_per_micro_batch": 60.0,
    "cp_seconds_per_token": 1e-1,
    "seconds_per_pass": 60.0,
}
WORK_TERMS = ("seconds_per_token", "seconds_per_attention_token_pair")


def validate_coefficients(model: CostModel, prefix: str = COEFFICIENTS_FIELD) -> CostModel:
    """Reject coefficients out of range, and a model under which work costs nothing (every plan of
    equal pass count would tie, and the lower bound would be 0)."""
    for name, high in COEFFICIENT_BOUNDS.items():
        _check_number(f"{prefix}.{name}", getattr(model, name), 0.0, high, integer=False)
    if not any(getattr(model, name) > 0.0 for name in WORK_TERMS):
        allowed = " or ".join(f"{name} in (0, {COEFFICIENT_BOUNDS[name]:g}]" for name in WORK_TERMS)
        _reject(f"{prefix}.{WORK_TERMS[0]}", 0.0, f"every plan would be free; allowed {allowed}")
    return model


def cost_model_from_coefficients(values: Mapping[str, Any], prefix: str = COEFFICIENTS_FIELD) -> CostModel:
    """A CostModel from raw coefficients (a request's own), every one required and checked first,
    so a bad value is an InvalidRequestError naming its field rather than CostModel's ValueError."""
    names = [f.name for f in fields(CostModel)]
    for key in values:
        if key not in names:
            _reject(f"{prefix}.{key}", values[key], f"unknown coefficient; known: {', '.join(names)}")
    for name in names:
        if name not in values:
            raise InvalidRequestError(
                f"{prefix}.{name}: missing; allowed [0, {COEFFICIENT_BOUNDS[name]:g}]", field=f"{prefix}.{name}"
            )
        _check_number(f"{prefix}.{name}", values[name], 0.0, COEFFICIENT_BOUNDS[name], integer=False)
    return validate_coefficients(CostModel(**{name: float(values[name]) for name in names}), prefix)


def derive_cost_model(model: ModelProfile, hardware: HardwareProfile, tensor_parallel_size: int = 1) -> CostModel:
    """The five coefficients by the formulas of this module's docstring."""
    _check_number("layout.tensor_parallel_size", tensor_parallel_size, 1, 1024, integer=True)
    t, layers = tensor_parallel_size, model.num_layers
    compute = t * hardware.peak_bf16_flops
    token_flops = layers * model.flops_per_token_per_layer() + model.output_flops_per_token()
    cp_bytes = layers * model.cp_bytes_per_token_per_layer()
    derived = CostModel(
        seconds_per_token=token_flops / (compute * hardware.sustained_fraction),
        seconds_per_attention_token_pair=layers
        * model.flops_per_attention_unit_per_layer()
        / (compute * hardware.attention_sustained_fraction),
        cp_seconds_per_micro_batch=layers * hardware.cp_seconds_per_layer_pass,
        cp_seconds_per_token=hardware.cp_exposed_fraction * cp_bytes / (t * hardware.cp_bandwidth_bytes_per_second),
        seconds_per_pass=hardware.seconds_per_pass_base + layers * hardware.seconds_per_layer_pass,
    )
    return validate_coefficients(derived, COEFFICIENTS_FIELD)


# Model shapes from the models' published configurations. Qwen3-30B-A3B: every layer is MoE
# (128 experts, 8 routed, 768 wide, no shared expert), so it has no dense MLP width.
MODEL_PROFILES: dict[str, ModelProfile] = {
    "llama3-8b": ModelProfile(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=14336,
        vocab_size=128256,
        gated_mlp=1,
    ),
    "llama3-70b": ModelProfile(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=28672,
        vocab_size=128256,
        gated_mlp=1,
    ),
    "qwen3-30b-a3b": ModelProfile(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=0,
        vocab_size=151936,
        gated_mlp=1,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
    ),
    # The GPU benchmark's stack (bench/gpu/model.py): 4 layers, GELU MLP 4x, no output layer.
    "bench-4l-2048": ModelProfile(
        num_layers=4,
        hidden_size=2048,
        num_attention_heads=16,
        num_kv_heads=16,
        head_dim=128,
        ffn_hidden_size=8192,
        vocab_size=0,
        gated_mlp=0,
    ),
}


# Datasheet peak dense bf16 (SXM parts, no sparsity): H100 and H200 share the chip and its rate.
# Calibrated on one H200 from the Llama-3-8B layer alone (bench/gpu/layer_timing.py; the other three
# shapes are held out, docs/cost-model.md): sustained_fraction 0.56 and attention 0.58 are what that
# layer's fitted per-token and per-L^2 terms imply. The fixed costs come from the 2x H200 benchmark's
# fit of a 4-layer stack (docs/gpu-benchmark.md: 1.8 ms per pass, 11 ms per CP pass, over 4 layers).
# cp_exposed_fraction 0.1 is assumed: that fit could not tell a per-token CP term from zero.
# The H100 profile is the H200's with the same fractions, NOT measured (no H100 was lent): its lower
# memory bandwidth (3.35 against 4.8 TB/s) slows the memory-bound part (norms, activations), so
# expect its real per-token term a few percent higher.
_HOPPER_PEAK = 989.4e12
_NVLINK4_ONE_WAY = 450e9
_HOPPER: dict[str, Any] = {
    "peak_bf16_flops": _HOPPER_PEAK,
    "sustained_fraction": 0.56,
    "attention_sustained_fraction": 0.58,
    "cp_bandwidth_bytes_per_second": _NVLINK4_ONE_WAY,
    "cp_exposed_fraction": 0.1,
    "seconds_per_layer_pass": 0.45e-3,
    "seconds_per_pass_base": 0.0,
    "cp_seconds_per_layer_pass": 2.75e-3,
}
HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "h200": HardwareProfile(**_HOPPER),
    "h100": HardwareProfile(**_HOPPER),
}


def preset_hardware(name: str) -> HardwareProfile:
    return _lookup(HARDWARE_PROFILES, name, HARDWARE_FIELD)


def _lookup(registry: Mapping[str, Any], name: str, field_name: str) -> Any:
    if name not in registry:
        raise InvalidRequestError(
            f"{field_name}: unknown name {name!r}; known: {', '.join(sorted(registry))}", field=field_name
        )
    return registry[name]


def layer_terms(model: ModelProfile, hardware: HardwareProfile, tensor_parallel_size: int = 1) -> dict[str, float]:
    """Per-token and per-L^2 seconds of ONE layer: what bench/gpu/layer_timing.py measures."""
    compute = tensor_parallel_size * hardware.peak_bf16_flops
    return {
        "seconds_per_token": model.flops_per_token_per_layer() / (compute * hardware.sustained_fraction),
        "seconds_per_attention_token_pair": model.flops_per_attention_unit_per_layer()
        / (compute * hardware.attention_sustained_fraction),
    }


# The measured calibration the server has always defaulted to: CostModel()'s own coefficients.
CALIBRATED_PRESET = "h200-bench-calibrated"
DEFAULT_PRESET = CALIBRATED_PRESET


def preset_names() -> tuple[str, ...]:
    """Every preset: "<model>-<hardware>" for each model and hardware profile, and the calibration."""
    derived = (f"{m}-{h}" for m in MODEL_PROFILES for h in HARDWARE_PROFILES)
    return (CALIBRATED_PRESET, *derived)


def preset_profiles(name: str) -> tuple[ModelProfile, HardwareProfile]:
    """The profiles behind a derived preset's name."""
    for model_name, model in MODEL_PROFILES.items():
        for hardware_name, hardware in HARDWARE_PROFILES.items():
            if name == f"{model_name}-{hardware_name}":
                return model, hardware
    raise InvalidRequestError(
        f"{PRESET_FIELD}: unknown preset {name!r}; known: {', '.join(preset_names())}", field=PRESET_FIELD
    )


def cost_model_for_preset(name: str, tensor_parallel_size: int = 1) -> CostModel:
    """A preset's coefficients. Derived presets divide the matrix work and the CP traffic over the
    TP group (the fixed costs stay); the calibration is a fixed set measured at TP 1 and ignores it."""
    if name == CALIBRATED_PRESET:
        return CostModel()
    model, hardware = preset_profiles(name)
    return derive_cost_model(model, hardware, tensor_parallel_size)


SPEC_FIELD = "cost_model"


@dataclass(frozen=True)
class CostModelSpec:
    """Where one request's cost model comes from: exactly one of a preset name, raw coefficients
    (measured or fitted by the job, trainer_client's calibration), or a model and a hardware
    profile. The server keeps no per-job state: the spec travels in every request."""

    preset: str = ""
    coefficients: CostModel | None = None
    model: ModelProfile | None = None
    hardware: HardwareProfile | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("preset", "coefficients", "model") if getattr(self, name)]
        if (self.model is None) != (self.hardware is None):
            missing = "hardware" if self.hardware is None else "model"
            raise InvalidRequestError(
                f"{SPEC_FIELD}.{missing}: missing; a model profile needs a hardware profile and back", field=f"{SPEC_FIELD}.{missing}"
            )
        if len(given) != 1:
            raise InvalidRequestError(
                f"{SPEC_FIELD}: set exactly one of preset, coefficients, or model and hardware; got "
                f"{', '.join(given) or 'none'}",
                field=SPEC_FIELD,
            )
        if self.preset and self.preset not in preset_names():
            raise InvalidRequestError(
                f"{PRESET_FIELD}: unknown preset {self.preset!r}; known: {', '.join(preset_names())}", field=PRESET_FIELD
            )
        if self.coefficients is not None:
            validate_coefficients(self.coefficients, f"{SPEC_FIELD}.coefficients")

    def resolve(self, tensor_parallel_size: int = 1) -> CostModel:
        """The coefficients this spec stands for, for a job of this TP size."""
        if self.coefficients is not None:
            return self.coefficients
        if self.preset:
            return cost_model_for_preset(self.preset, tensor_parallel_size)
        assert self.model is not None and self.hardware is not None
        return derive_cost_model(self.model, self.hardware, tensor_parallel_size)

    def canonical(self) -> dict[str, Any]:
        """Plain values (what a plan id and the ranks' digest hash)."""
        def plain(obj: Any) -> Any:
            return None if obj is None else {f.name: getattr(obj, f.name) for f in fields(obj) if f.name != "field_prefix"}

        return {"preset": self.preset, "coefficients": plain(self.coefficients), "model": plain(self.model),
                "hardware": plain(self.hardware)}


def resolve_cost_model(spec: CostModelSpec | None, default: CostModel, tensor_parallel_size: int = 1) -> CostModel:
    """A request's cost model: its own spec's, else the server's default."""
    return default if spec is None else spec.resolve(tensor_parallel_size)


def spec_from_mapping(values: Any, prefix: str = SPEC_FIELD) -> CostModelSpec:
    """A spec from plain data (a trainer's YAML, a request's fields): a preset name as a string, or
    a mapping with exactly one of `preset`, `coefficients`, or `model` and `hardware`."""
    if isinstance(values, CostModelSpec):
        return values
    if isinstance(values, str):
        return CostModelSpec(preset=values)
    if not isinstance(values, Mapping):
        raise InvalidRequestError(f"{prefix}: got {values!r}; expected a preset name or a mapping", field=prefix)
    unknown = sorted(set(values) - {"preset", "coefficients", "model", "hardware"})
    if unknown:
        _reject(f"{prefix}.{unknown[0]}", values[unknown[0]], "unknown; known: preset, coefficients, model, hardware")
    coefficients = values.get("coefficients")
    model, hardware = values.get("model"), values.get("hardware")
    return CostModelSpec(
        preset=values.get("preset") or "",
        coefficients=None if coefficients is None else cost_model_from_coefficients(coefficients, f"{prefix}.coefficients"),
        model=None if model is None else ModelProfile.from_mapping(model, f"{prefix}.model"),
        hardware=None if hardware is None else HardwareProfile.from_mapping(hardware, f"{prefix}.hardware"),
    )
