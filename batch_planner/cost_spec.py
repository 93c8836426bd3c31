"""The cost model's specification, as plain data (docs/cost-model.md).

- `CostModel`: the five coefficients, in seconds, that price a plan (batch_planner/cost.py prices).
- `ModelProfile` and `HardwareProfile`: the decoder's shape and one GPU kind, from which
  batch_planner/cost_derivation.py derives the coefficients; the named ones, and the presets.
- `CostModelSpec`: where one request's cost model comes from (a preset, coefficients, or a model
  and a hardware profile); it travels in every request.

Each is a frozen pydantic dataclass whose fields carry their documentation and allowed range;
unknown fields are refused, and neither a bool nor a string passes for a number. Built in Python,
a bad one raises pydantic's ValidationError (a ValueError). Built from a request's or a trainer's
plain data (`spec_from_mapping`, `ModelProfile.from_mapping`, `cost_model_from_coefficients`), or
checked with `validate_coefficients`, it raises InvalidRequestError naming the field (for example
"cost_model.model.hidden_size"), the value and what is allowed: `_invalid` words every one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, NoReturn, get_args

from annotated_types import Ge, Le
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from batch_planner.errors import InvalidRequestError

SPEC_FIELD = COEFFICIENTS_FIELD = "cost_model"
MODEL_FIELD = "cost_model.model"
HARDWARE_FIELD = "cost_model.hardware"
PRESET_FIELD = "cost_model.preset"

_DATA = ConfigDict(extra="forbid", allow_inf_nan=False)
Count = Annotated[int, Strict()]  # an int: not a bool, a float or a string
Number = Annotated[float, Strict()]  # an int or a float: not a bool or a string
Seconds = Annotated[Number, Field(ge=0)]


def _within(low: float, high: float, doc: str) -> Any:
    """A field's closed range [low, high] and its documentation."""
    return Field(ge=low, le=high, description=doc)


@dataclass(frozen=True, config=_DATA)
class CostModel:
    """Coefficients in seconds. Defaults: the replay's fit of Llama-3-8B at TP 1 on an H100
    (REPLAY_PRESETS["llama3-8b-h100"]: Transformer Engine's kernels measured on one H100, the links
    modeled; docs/gpu-replay.md), what a request that names no cost model is priced with. Absolute
    seconds scale with the model; the ratios between the terms are what rank plans, so a job with
    another model should name its preset or send its own fit. The toy engine's coefficients, the
    defaults before the replay, are TOY_ENGINE_COEFFICIENTS (preset `h200-bench-calibrated`). The
    field order is the order of a feature vector (`COEFFICIENT_NAMES`, batch_planner.cost.unit_features)."""

    seconds_per_token: Annotated[Seconds, Field(description="cost model: seconds per (padded) token per rank")] = 6.827e-05
    seconds_per_attention_token_pair: Annotated[Seconds, Field(description="cost model: seconds per L^2 attention unit per rank")] = 1.386e-09
    cp_seconds_per_micro_batch: Annotated[Seconds, Field(
        description="cost model: fixed seconds per ring step of a pass over a CP group (c - 1 steps a pass; the name predates the ring)")] = 0.03449
    cp_seconds_per_token: Annotated[Seconds, Field(description="cost model: CP communication seconds per token")] = 3.151e-06
    seconds_per_pass: Annotated[
        Seconds, Field(description="cost model: fixed seconds per forward+backward pass over any group (CP1 included)")
    ] = 0.1154


COEFFICIENT_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CostModel))
# A coefficient above its bound is a unit slip (milliseconds for seconds, a whole step per token),
# not a model: the bounds sit orders of magnitude above the largest preset. They hold for the
# coefficients of a request, a derivation and a calibration; the server's own flags only need >= 0.
COEFFICIENT_BOUNDS: dict[str, float] = {
    "seconds_per_token": 1e-1,
    "seconds_per_attention_token_pair": 1e-4,
    "cp_seconds_per_micro_batch": 60.0,
    "cp_seconds_per_token": 1e-1,
    "seconds_per_pass": 60.0,
}
WORK_TERMS = ("seconds_per_token", "seconds_per_attention_token_pair")


def _refuse(field: str, message: str) -> NoReturn:
    """A refusal from a validator: `field` (below the validated object; "" for the object itself)
    and what is wrong, for `_invalid` to put the path in front."""
    raise PydanticCustomError("refused", "{message}", {"field": field, "message": message})


def _every_coefficient(values: Any) -> Any:
    """A request's own coefficients: all five, none left to CostModel's defaults."""
    if isinstance(values, Mapping):
        for name in COEFFICIENT_NAMES:
            if name not in values:
                _refuse(name, f"missing; allowed [0, {COEFFICIENT_BOUNDS[name]:g}]")
    return values


def _bounded(model: CostModel) -> CostModel:
    """Coefficients within their bounds, under which work costs something (with both work terms 0
    every plan of equal pass count would tie, and the lower bound would be 0)."""
    for name, high in COEFFICIENT_BOUNDS.items():
        value = getattr(model, name)
        if value > high:
            _refuse(name, f"got {value!r}; allowed a finite number in [0, {high:g}]")
    if not any(getattr(model, name) > 0.0 for name in WORK_TERMS):
        allowed = " or ".join(f"{name} in (0, {COEFFICIENT_BOUNDS[name]:g}]" for name in WORK_TERMS)
        _refuse(WORK_TERMS[0], f"got 0.0; every plan would be free; allowed {allowed}")
    return model


# Coefficients as a request, a derivation or a calibration gives them.
Coefficients = Annotated[CostModel, BeforeValidator(_every_coefficient), AfterValidator(_bounded)]


@dataclass(frozen=True, config=_DATA)
class ModelProfile:
    """The decoder's shape: what the FLOPs and the CP traffic are computed from."""

    num_layers: Annotated[Count, _within(1, 1024, "decoder layers (of one pipeline stage, when pipelined)")]
    hidden_size: Annotated[Count, _within(64, 131072, "model width")]
    num_attention_heads: Annotated[Count, _within(1, 1024, "query heads")]
    num_kv_heads: Annotated[Count, _within(1, 1024, "key/value heads (GQA); divides num_attention_heads")]
    head_dim: Annotated[Count, _within(8, 1024, "width of one attention head")]
    ffn_hidden_size: Annotated[Count, _within(0, 1 << 20, "dense MLP width; 0 only for a model whose every MLP is MoE")]
    vocab_size: Annotated[Count, _within(0, 1 << 24, "output vocabulary; 0 counts no output layer (the GPU benchmark's stack)")]
    gated_mlp: Annotated[Count, _within(0, 1, "1: gated MLP (SwiGLU, 3 matrices); 0: plain (GELU, 2 matrices)")]
    num_experts: Annotated[Count, _within(0, 4096, "MoE experts per layer; 0 for a dense model")] = 0
    moe_top_k: Annotated[Count, _within(0, 4096, "experts each token is routed to; 0 for a dense model")] = 0
    moe_ffn_hidden_size: Annotated[Count, _within(0, 1 << 20, "width of one expert's MLP; 0 for a dense model")] = 0
    bytes_per_value: Annotated[Count, _within(1, 8, "bytes of one activation value (bf16: 2)")] = 2

    @model_validator(mode="after")
    def _consistent(self) -> ModelProfile:
        if self.num_attention_heads % self.num_kv_heads:
            _refuse("num_kv_heads", f"got {self.num_kv_heads}; must divide num_attention_heads ({self.num_attention_heads})")
        moe = (self.num_experts, self.moe_top_k, self.moe_ffn_hidden_size)
        if any(moe) and not all(moe):
            _refuse("num_experts", f"got {moe!r}; num_experts, moe_top_k and moe_ffn_hidden_size are all 0 (dense) or all > 0")
        if self.moe_top_k > self.num_experts:
            _refuse("moe_top_k", f"got {self.moe_top_k}; allowed 1..num_experts ({self.num_experts})")
        if not self.is_moe and self.ffn_hidden_size == 0:
            _refuse("ffn_hidden_size", "got 0; a dense model needs an MLP width in [1, 1048576]")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = MODEL_FIELD) -> ModelProfile:
        return _parse(cls, values, prefix)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True, config=_DATA)
class HardwareProfile:
    """One GPU kind and its CP link, with the engine's fixed costs."""

    peak_bf16_flops: Annotated[Number, _within(1e12, 1e17, "peak dense bf16 FLOP/s of one GPU (datasheet)")]
    sustained_fraction: Annotated[Number, _within(1e-3, 1.0, "fraction of the peak a layer's token-wise work sustains")]
    attention_sustained_fraction: Annotated[Number, _within(1e-3, 1.0, "fraction of the peak causal attention sustains (fwd+bwd)")]
    cp_bandwidth_bytes_per_second: Annotated[Number, _within(1e8, 1e13, "bandwidth one rank gets to its CP ring neighbour")]
    cp_exposed_fraction: Annotated[Number, _within(0.0, 1.0, "part of the CP traffic time not hidden behind attention")]
    seconds_per_layer_pass: Annotated[Number, _within(0.0, 0.1, "fixed seconds per layer and forward+backward pass")]
    seconds_per_pass_base: Annotated[Number, _within(0.0, 10.0, "fixed seconds per pass independent of the layer count")]
    cp_seconds_per_layer_pass: Annotated[Number, _within(0.0, 1.0, "extra fixed seconds per layer and ring step of a pass over a CP group (c - 1 steps)")]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = HARDWARE_FIELD) -> HardwareProfile:
        return _parse(cls, values, prefix)


# Model shapes from the models' published configurations. Qwen3-30B-A3B: every layer is MoE
# (128 experts, 8 routed, 768 wide, no shared expert), so it has no dense MLP width.
MODEL_PROFILES: dict[str, ModelProfile] = {
    "llama3-8b": ModelProfile(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128, ffn_hidden_size=14336, vocab_size=128256, gated_mlp=1,
    ),
    "llama3-70b": ModelProfile(
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128, ffn_hidden_size=28672, vocab_size=128256, gated_mlp=1,
    ),
    "qwen3-30b-a3b": ModelProfile(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_kv_heads=4, head_dim=128, ffn_hidden_size=0, vocab_size=151936, gated_mlp=1,
        num_experts=128, moe_top_k=8, moe_ffn_hidden_size=768,
    ),
    # The GPU benchmark's stack (bench/gpu/model.py): 4 layers, GELU MLP 4x, no output layer.
    "bench-4l-2048": ModelProfile(
        num_layers=4, hidden_size=2048, num_attention_heads=16, num_kv_heads=16, head_dim=128, ffn_hidden_size=8192, vocab_size=0, gated_mlp=0,
    ),
}


# Datasheet peak dense bf16 (SXM parts, no sparsity): H100 and H200 share the chip and its rate.
# Calibrated on one H200 from the Llama-3-8B layer alone (bench/gpu/layer_timing.py; the other three
# shapes are held out, docs/cost-model.md): sustained_fraction 0.56 and attention 0.58 are what that
# layer's fitted per-token and per-L^2 terms imply. The fixed costs come from the 2x H200 benchmark's
# fit of a 4-layer stack (docs/gpu-benchmark.md: 1.8 ms per pass, 11 ms per CP pass, over 4 layers).
# cp_exposed_fraction 0.1 is assumed: that fit could not tell a per-token CP term from zero.
_HOPPER = HardwareProfile(
    peak_bf16_flops=989.4e12,
    sustained_fraction=0.56,
    attention_sustained_fraction=0.58,
    cp_bandwidth_bytes_per_second=450e9,  # NVLink 4, one way
    cp_exposed_fraction=0.1,
    seconds_per_layer_pass=0.45e-3,
    seconds_per_pass_base=0.0,
    cp_seconds_per_layer_pass=2.75e-3,
)
# The H100's: calibrated from the replay's Llama-3-8B fit (docs/gpu-benchmark-data/replay/hardware.json,
# `cost_derivation.hardware_from_fit`), so a model without a replay preset derives from Transformer
# Engine's kernels. It derives Llama-3-8B's fit exactly; for Llama-3-70B at TP 8 and Qwen3-30B-A3B it
# lands 9-37% and up to 2.4x off their own fits (hardware.json; docs/gpu-replay.md), which is why
# those two ship their fits as presets. The H200 keeps the profile above (no H200 replay yet).
_H100_REPLAY = HardwareProfile(
    peak_bf16_flops=989.4e12,
    sustained_fraction=0.6666,
    attention_sustained_fraction=0.6691,
    cp_bandwidth_bytes_per_second=124.8e9,
    cp_exposed_fraction=1.0,
    seconds_per_layer_pass=3.606e-3,
    seconds_per_pass_base=0.0,
    cp_seconds_per_layer_pass=1.078e-3,
)
HARDWARE_PROFILES: dict[str, HardwareProfile] = {"h200": _HOPPER, "h100": _H100_REPLAY}

# The toy engine's coefficients, the defaults before the replay (history, docs/gpu-benchmark.md): three
# runs on 2x H200 of a 4-layer, 2048-wide decoder whose CP was PyTorch's ring attention, one ring call
# per sequence and layer (hence 11 ms per CP pass). A request that names this preset still gets them.
CALIBRATED_PRESET = "h200-bench-calibrated"
TOY_ENGINE_COEFFICIENTS = CostModel(
    seconds_per_token=2.22e-6,
    seconds_per_attention_token_pair=8.7e-11,
    cp_seconds_per_micro_batch=1.1e-2,
    cp_seconds_per_token=0.0,
    seconds_per_pass=1.8e-3,
)


@dataclass(frozen=True, config=_DATA)
class ReplayPreset:
    """Coefficients fitted to the replay (docs/gpu-replay.md) at one TP size: at another, the work
    terms and the CP traffic scale by fitted TP / TP, the fixed terms stay."""

    tensor_parallel_size: Annotated[Count, _within(1, 1024, "the TP size the replay ran the model at")]
    coefficients: CostModel


# "<model>-<gpu>": the replay's fits, as bench/gpu/replay/report.py writes them to
# docs/gpu-benchmark-data/replay/fitted.json (tests/batch_planner/test_cost_profiles.py holds these to
# that file): Transformer Engine 2.20's kernels on one H100 at each model's production shapes, the
# links modeled. A name here takes the place of the derived preset of the same name.
REPLAY_PRESETS: dict[str, ReplayPreset] = {
    "llama3-8b-h100": ReplayPreset(1, CostModel(
        seconds_per_token=6.827e-05, seconds_per_attention_token_pair=1.386e-09, cp_seconds_per_micro_batch=0.03449,
        cp_seconds_per_token=3.151e-06, seconds_per_pass=0.1154)),
    "llama3-70b-h100": ReplayPreset(8, CostModel(
        seconds_per_token=8.648e-05, seconds_per_attention_token_pair=1.183e-09, cp_seconds_per_micro_batch=0.1066,
        cp_seconds_per_token=4.763e-07, seconds_per_pass=0.3754)),
    "qwen3-30b-a3b-h100": ReplayPreset(1, CostModel(
        seconds_per_token=1.168e-05, seconds_per_attention_token_pair=2.248e-09, cp_seconds_per_micro_batch=0.04543,
        cp_seconds_per_token=2.562e-06, seconds_per_pass=1.576)),
}
# What a request that names no cost model gets: CostModel()'s defaults, this preset.
DEFAULT_PRESET = "llama3-8b-h100"


def preset_names() -> tuple[str, ...]:
    """Every preset: the replay's fits, "<model>-<hardware>" derived for each other model and
    hardware profile, and the toy engine's calibration."""
    derived = (f"{m}-{h}" for m in MODEL_PROFILES for h in HARDWARE_PROFILES)
    return (CALIBRATED_PRESET, *REPLAY_PRESETS, *(d for d in derived if d not in REPLAY_PRESETS))


def preset_profiles(name: str) -> tuple[ModelProfile, HardwareProfile]:
    """The profiles behind a derived preset's name."""
    for model_name, model in MODEL_PROFILES.items():
        for hardware_name, hardware in HARDWARE_PROFILES.items():
            if name == f"{model_name}-{hardware_name}":
                return model, hardware
    raise InvalidRequestError(f"{PRESET_FIELD}: unknown preset {name!r}; known: {', '.join(preset_names())}", field=PRESET_FIELD)


def preset_hardware(name: str) -> HardwareProfile:
    if name not in HARDWARE_PROFILES:
        known = ", ".join(sorted(HARDWARE_PROFILES))
        raise InvalidRequestError(f"{HARDWARE_FIELD}: unknown name {name!r}; known: {known}", field=HARDWARE_FIELD)
    return HARDWARE_PROFILES[name]


@dataclass(frozen=True, config=_DATA)
class CostModelSpec:
    """Where one request's cost model comes from: exactly one of a preset name, raw coefficients
    (measured or fitted by the job, trainer_client's calibration), or a model and a hardware
    profile. The server keeps no per-job state: the spec travels in every request;
    batch_planner.cost_derivation.resolve_cost_model turns it into coefficients."""

    preset: str = ""
    coefficients: Coefficients | None = None
    model: ModelProfile | None = None
    hardware: HardwareProfile | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CostModelSpec:
        if (self.model is None) != (self.hardware is None):
            _refuse("hardware" if self.hardware is None else "model", "missing; a model profile needs a hardware profile and back")
        given = [name for name in ("preset", "coefficients", "model") if getattr(self, name)]
        if len(given) != 1:
            _refuse("", f"set exactly one of preset, coefficients, or model and hardware; got {', '.join(given) or 'none'}")
        if self.preset and self.preset not in preset_names():
            _refuse("preset", f"unknown preset {self.preset!r}; known: {', '.join(preset_names())}")
        return self

    def canonical(self) -> dict[str, Any]:
        """Plain values (what a plan id and the ranks' digest hash)."""

        def plain(obj: Any) -> Any:
            return None if obj is None else dataclasses.asdict(obj)

        return {"preset": self.preset, "coefficients": plain(self.coefficients), "model": plain(self.model), "hardware": plain(self.hardware)}


def spec_from_mapping(values: Any, prefix: str = SPEC_FIELD) -> CostModelSpec:
    """A spec from plain data (a trainer's YAML, a request's fields): a preset name as a string, or
    a mapping with exactly one of `preset`, `coefficients`, or `model` and `hardware`."""
    if isinstance(values, CostModelSpec):
        return values
    if isinstance(values, str):
        values = {"preset": values}
    if not isinstance(values, Mapping):
        raise InvalidRequestError(f"{prefix}: got {values!r}; expected a preset name or a mapping", field=prefix)
    return _parse(CostModelSpec, values, prefix)


def cost_model_from_coefficients(values: Mapping[str, Any], prefix: str = COEFFICIENTS_FIELD) -> CostModel:
    """A CostModel from raw coefficients (a request's own): every one required and in its bounds."""
    return _parse(Coefficients, values, prefix)


def validate_coefficients(model: CostModel, prefix: str = COEFFICIENTS_FIELD) -> CostModel:
    """`model` if its coefficients are within their bounds and price work, else InvalidRequestError."""
    return _parse(Coefficients, model, prefix)


@cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


def _parse(kind: Any, values: Any, prefix: str) -> Any:
    try:
        return _adapter(kind).validate_python(values)
    except ValidationError as error:
        raise _invalid(error, kind, prefix) from None


def _invalid(error: ValidationError, kind: Any, prefix: str) -> InvalidRequestError:
    """Pydantic's first error as the project's: "<field path>: got <value>; <what is allowed>"."""
    first = error.errors(include_url=False)[0]
    loc = tuple(str(part) for part in first["loc"])
    ctx, value = first.get("ctx") or {}, first["input"]
    if first["type"] == "refused":
        loc += (ctx["field"],) if ctx["field"] else ()
        return _named(prefix, loc, ctx["message"])
    owner = _dataclass_at(kind, loc[:-1])
    if first["type"] == "unexpected_keyword_argument" and owner is not None:
        return _named(prefix, loc, f"got {value!r}; unknown field; known: {', '.join(owner.__pydantic_fields__)}")
    info = owner.__pydantic_fields__.get(loc[-1]) if owner is not None and loc else None
    if info is None or info.annotation not in (int, float):
        return _named(prefix, loc, f"got {value!r}; expected {first['msg'].removeprefix('Input should be ')}")
    low = next((m.ge for m in info.metadata if isinstance(m, Ge)), 0)
    # A coefficient's upper bound is the request's (COEFFICIENT_BOUNDS); CostModel itself needs >= 0.
    high = next((m.le for m in info.metadata if isinstance(m, Le)), COEFFICIENT_BOUNDS.get(loc[-1], float("inf")))
    if first["type"] == "missing":
        return _named(prefix, loc, f"missing; allowed [{low:g}, {high:g}]")
    kind_of = "an integer" if info.annotation is int else "a finite number"
    return _named(prefix, loc, f"got {value!r}; allowed {kind_of} in [{low:g}, {high:g}]")


def _named(prefix: str, loc: tuple[str, ...], message: str) -> InvalidRequestError:
    name = ".".join((prefix, *loc))
    return InvalidRequestError(f"{name}: {message}", field=name)


def _dataclass_at(kind: Any, loc: tuple[str, ...]) -> Any:
    """The dataclass whose field `loc` names the last part of (None past a plain value)."""
    found = _dataclass_in(kind)
    for part in loc:
        if found is None or part not in found.__pydantic_fields__:
            return None
        found = _dataclass_in(found.__pydantic_fields__[part].annotation)
    return found


def _dataclass_in(annotation: Any) -> Any:
    if hasattr(annotation, "__pydantic_fields__"):
        return annotation
    return next((found for arg in get_args(annotation) if (found := _dataclass_in(arg)) is not None), None)
