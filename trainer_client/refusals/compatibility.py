"""The one table of refusals: what dynamic CP, or a drop-in that runs it, cannot run with.

The core's rows (`RULES`: dynamic CP's and Megatron-Core's own requirements, from the reference PR,
verl #6555, and Megatron-Core: dev: training/arguments.py, transformer_config.py; 0.19:
hybrid_cp_schedule, multi_latent_attention) read what every trainer gives (`CORE_SOURCES`). Each drop-in
registers its own part from its own package (`TableSource`, `register_source`): its source, its rows
and its paths of the core's settings; `table` is the whole, in the order `check` reads it. Where a rule
applies and the tables: docs/trainer-client.md ("Unsupported combinations: one table") and the drop-ins'
pages, generated from what is registered (trainer_client/refusals/refusal_docs.py; tests keep them equal).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from dataclasses import dataclass
from functools import cache, cached_property, partial
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

from batch_planner.precision import MEGATRON_FP8_RECIPES, Precision, rank_row_multiple
from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.errors import ConfigError, InvalidArgumentError, UnsupportedCombinationError, UsageError

# Megatron-Core's `sequence_packing_scheduler` names, and the planner's schedulers they are (the one
# home of these names; a drop-in's rows refuse the schedulers its trainer does not run):
MEGATRON_SCHEDULER_NAMES = {"default_dynamic_cp": SchedulerKind.DYNAMIC_CP, "dp_balanced": SchedulerKind.STATIC_PACKING}
# Those that pack a CP group's samples into one THD micro-batch (Megatron-LM's dev drop-in, Bridge's).
PACKING_SCHEDULERS = tuple(MEGATRON_SCHEDULER_NAMES.values())
MULTIMODAL_BATCH_FIELDS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "multi_modal_inputs")

# Transformer Engine's attention takes a CP group for THD input (cp_comm_type, set_context_parallel_group
# with per-call groups) from this version on; Megatron-Core's TEDotProductAttention checks the same.
MIN_TE_VERSION_FOR_THD_CP = (1, 10)

# What any trainer may hand `check`, by name; a drop-in's own source is known once it is registered
# (`register_source`, which `trainer_client.dropin.register_dropin` calls) and read by its rows only.
CORE_SOURCES = ("engine", "model", "transformer", "planner config", "plan", "batch")
# Position embeddings that rotate queries and keys by position (RoPE and its variants).
ROTARY_EMBEDDINGS = ("rope", "mrope", "yarn")

Build = Literal["release", "dev"]
BUILD_WORDS = {"release": "on a Megatron-Core release (0.19)", "dev": "on a Megatron-Core dev build (dynamic CP groups)"}


@dataclass(frozen=True)
class InstalledMegatron:
    """What the installed Megatron-Core can do that changes the answer."""

    # The dev-branch packing schedulers (data_schedule.DefaultDynamicCPScheduler) align the number
    # of micro-batches to the VPP micro-batch group; 0.19's hybrid CP runs without pipelining only.
    vpp_aware_scheduler: bool
    transformer_engine: tuple[int, ...] | None = None

    @property
    def build(self) -> Build:
        return "dev" if self.vpp_aware_scheduler else "release"

    @classmethod
    def detect(cls) -> InstalledMegatron:
        from batch_planner.schedulers import discover_schedulers

        return cls(
            vpp_aware_scheduler=discover_schedulers()[SchedulerKind.DYNAMIC_CP].available,
            transformer_engine=transformer_engine_version(),
        )


def transformer_engine_version() -> tuple[int, ...] | None:
    """The installed Transformer Engine's (major, minor), or None when it is not installed."""
    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return None


@dataclass(frozen=True)
class Changed:
    """A value a trainer passes each step that must stay the same: `Changed.of` is None while it does."""

    before: Any
    after: Any

    @classmethod
    def of(cls, before: Any, after: Any) -> Changed | None:
        return None if before == after else cls(before, after)

    def __repr__(self) -> str:
        return f"changed from {self.before!r} to {self.after!r}"


ABSENT = object()


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


class Inputs:
    """What one call was given, by source, and the facts the rules read from it."""

    def __init__(self, sources: Mapping[str, Any], installed: InstalledMegatron | None):
        known = known_sources()
        unknown = sorted(set(sources) - set(known))
        if unknown:
            raise InvalidArgumentError(
                f"unknown refusal-table sources {unknown}; allowed: {list(known)} (a drop-in's source is known once "
                "its package is imported, which registers it: trainer_client.dropin.register_dropin)"
            )
        self.sources = {name: sources.get(name) for name in known}
        self.transformer, self.plan, self.batch = self.sources["transformer"], self.sources["plan"], self.sources["batch"]
        self._installed = installed
        # Read at once, so a bad scheduler or layout name fails whatever else is present.
        planner = self.sources["planner config"]
        self.scheduler = _named(SchedulerKind, "scheduler", self.plan, planner)
        self.layout = _named(CpLayout, "cp_layout", self.plan, planner)
        # The model's sizes the rows read (1 where the transformer config is not given).
        self.tp, self.cp = self.tc("tensor_model_parallel_size", 1) or 1, self.tc("context_parallel_size", 1) or 1
        self.vpp, self.group = self.tc("virtual_pipeline_model_parallel_size") or 1, self.tc("microbatch_group_size_per_vp_stage")

    def given(self, source: str) -> bool:
        return self.sources[source] is not None

    def at(self, place: Place, default: Any = None) -> Any:
        """The value at `place`; `default` where the path is absent (a field of another build) or passes through None."""
        value = self.sources[place.source]
        for name in place.path.split("."):
            value = _get(value, name, ABSENT) if value is not None else ABSENT
            if value is ABSENT:
                return default
        return value

    def tc(self, name: str, default: Any = None) -> Any:
        return _get(self.transformer, name, default)


    @cached_property
    def installed(self) -> InstalledMegatron:
        # Detected only when a rule asks: it imports Megatron-Core's schedulers.
        return self._installed or InstalledMegatron.detect()


def _named(kind: type[SchedulerKind] | type[CpLayout], field: str, plan: Any, planner: Any) -> Any:
    """The plan's `field` (else the planner config's) as a `kind`, None where neither sets it; a name
    that is not one of `kind` is refused, naming where it was read, the value and what is allowed
    (the planner config's as a setting: ConfigError; the plan's as an argument: InvalidArgumentError)."""
    for source, value, error in (("plan", _get(plan, field), InvalidArgumentError), ("planner config", _get(planner, field), ConfigError)):
        if value:
            try:
                return kind(value)
            except ValueError:
                raise error(f"{source} {field}: {value!r} is not allowed; allowed: {[k.value for k in kind]}") from None
    return None


class Place(NamedTuple):
    """Where a setting lives: a source handed to `check` and the dotted attribute (or key) path in it."""

    source: str
    path: str


@dataclass(frozen=True)
class Rule:
    """One reason for a refusal: the value at any of `places` is refused when `refused(value, inputs)`.

    A place is read when its source was given, and the rule only when every source in `needs` was
    too (`check` chooses the rules by that). `value` is read at the place (`default` when absent) unless `read` says otherwise (a rule
    with `read` has one place, which names the option). `build` is the Megatron-Core build the rule
    applies to (None: both); `schedulers` the schedulers (empty: any; none known: the rule waits).
    A core row with a `setting` is read at every registered drop-in's places of that setting too
    (`TableSource.places`), after its own (`places_in`)."""

    places: tuple[Place, ...]
    when: str  # the value refused, in words; `refused_when` adds the conditions of the row
    fix: str
    refused: Callable[[Any, Inputs], bool]
    default: Any = None
    read: Callable[[Inputs], Any] | None = None
    needs: tuple[str, ...] = ()
    build: Build | None = None
    schedulers: tuple[SchedulerKind, ...] = ()
    error: type[UnsupportedCombinationError] = UnsupportedCombinationError
    # The name a drop-in gives its own paths of this setting under (a core row's only); None: it has none.
    setting: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.places, Place):
            object.__setattr__(self, "places", (self.places,))
        if self.read is not None and (len(self.places) != 1 or self.setting is not None):
            raise InvalidArgumentError(f"rule for {self.places}: `read` needs exactly one place and no setting")

    def refusal(self, inputs: Inputs) -> UnsupportedCombinationError | None:
        """The error for the first place whose value this rule refuses; None when none is (`check` has asked `needs`)."""
        if self.schedulers and inputs.scheduler not in self.schedulers:
            return None
        for place in self.places_in():
            if not inputs.given(place.source):
                continue
            value = self.read(inputs) if self.read is not None else inputs.at(place, self.default)
            # The build is asked last: detecting it imports Megatron-Core's schedulers.
            if self.refused(value, inputs) and (self.build is None or self.build == inputs.installed.build):
                fix = self.fix.format(value=value, tp=inputs.tp, cp=inputs.cp, group=inputs.group)
                return self.error(place.path, value, fix, self)
        return None

    def places_in(self, sources: Sequence[str] | None = None) -> tuple[Place, ...]:
        """Where the rule reads: its own places, then those of `sources`' drop-ins (default: every
        registered one, in the order they were registered) for its `setting`."""
        return self.places + _supplied_places(self.setting, _registered(sources)) if self.setting else self.places

    @property
    def refused_when(self) -> str:
        """`when` with the row's conditions, as the docs' tables show it."""
        words = [self.when]
        if self.schedulers:
            words.append("with scheduler " + " or ".join(kind.value for kind in self.schedulers))
        if self.build is not None:
            words.append(BUILD_WORDS[self.build])
        words += [f"in {_REGISTERED[source].title}" for source in self.needs if source in _REGISTERED]
        return ", ".join(words)

    def reads(self, source: str) -> bool:
        return source in self.needs or any(place.source == source for place in self.places_in())


@dataclass(frozen=True, eq=False)
class TableSource:
    """A drop-in's part of the table: its source and its rows (`register_source`; a drop-in registers it
    through `trainer_client.dropin.register_dropin`, from its own package)."""

    # The name the drop-in hands its own settings to `check` under ("bridge"); its rows read it.
    source: str
    # The drop-in in words, as a row that needs its source says where it applies ("Megatron-Bridge's drop-in").
    title: str
    # Its own rows, in the order they are checked: after the core's rows of what every trainer gives,
    # before the core's rows read only at the drop-ins' places (`table`). Each reads its source, or
    # the core's sources where it `needs` its own.
    rows: tuple[Rule, ...] = ()
    # Its paths of a core row's `setting`, by setting ("use_megatron_fsdp": ("ddp.use_megatron_fsdp",)):
    # the core's row reads them too.
    places: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


# The drop-ins' parts of the table, by source, in the order they were registered (`register_source`),
# and the package that registered each.
_REGISTERED: dict[str, TableSource] = {}
_REGISTERED_BY: dict[str, str] = {}


def register_source(table_source: TableSource, registered_by: str) -> TableSource:
    """Adds a drop-in's source and rows to the table. A source registered already, or a core source,
    raises UsageError naming it and who registered it; a row reading another drop-in's source, or a
    place of a setting no core row has, raises InvalidArgumentError naming it and what is allowed."""
    name = table_source.source
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"refusal-table source: {name!r} is not allowed; expected the drop-in's name, a non-empty str")
    if name in CORE_SOURCES:
        raise UsageError(f"refusal-table source {name!r} is a core source (what every trainer gives: {list(CORE_SOURCES)}); "
                         "name the drop-in's own source otherwise")
    if name in _REGISTERED:
        raise UsageError(f"refusal-table source {name!r} is registered already, by {_REGISTERED_BY[name]}; "
                         f"{registered_by} must register its drop-in under a name of its own")
    own = (*CORE_SOURCES, name)
    for rule in table_source.rows:
        foreign = sorted({p.source for p in rule.places} - set(own) | set(rule.needs) - set(own))
        if foreign or rule.setting is not None:
            raise InvalidArgumentError(f"{name!r} rule for {rule.places}: reads sources {foreign} or has setting {rule.setting!r}; "
                                       f"a drop-in's row reads {list(own)} only and gives its paths of a core setting as `places`")
    settings = sorted(r.setting for r in RULES if r.setting)
    unknown = sorted(set(table_source.places) - set(settings))
    if unknown:
        raise InvalidArgumentError(f"{name!r} places: settings {unknown} are not a core row's; allowed: {settings}")
    odd = {setting: paths for setting, paths in table_source.places.items()
           if not isinstance(paths, tuple) or not all(isinstance(path, str) and path for path in paths)}
    if odd:
        raise InvalidArgumentError(f"{name!r} places: {odd} are not allowed; expected a tuple of dotted paths per setting")
    _REGISTERED[name], _REGISTERED_BY[name] = table_source, registered_by
    return table_source


def registered_by(package: str) -> tuple[str, ...]:
    """The sources `package` registered, in the order it did."""
    return tuple(source for source, by in _REGISTERED_BY.items() if by == package)


def known_sources() -> tuple[str, ...]:
    """What `check` takes: the core sources, then every registered drop-in's."""
    return (*CORE_SOURCES, *_REGISTERED)


def _registered(sources: Sequence[str] | None) -> tuple[TableSource, ...]:
    """The registered parts of `sources` (default: all, in registration order); an unknown one raises."""
    if sources is None:
        return tuple(_REGISTERED.values())
    unknown = [s for s in sources if s not in _REGISTERED]
    if unknown:
        raise InvalidArgumentError(f"refusal-table sources {unknown} are not registered; registered: {list(_REGISTERED)}")
    return tuple(_REGISTERED[s] for s in sources)


@cache
def _supplied_places(setting: str, parts: tuple[TableSource, ...]) -> tuple[Place, ...]:
    return tuple(Place(part.source, path) for part in parts for path in part.places.get(setting, ()))


def table(sources: Sequence[str] | None = None) -> tuple[Rule, ...]:
    """The table in the order `check` reads it: the core's rows with a place of their own (`RULES`), the
    rows of `sources`' drop-ins (default: every registered one, in registration order), then the
    core's rows read only at the drop-ins' places."""
    return _table(_registered(sources))


def rules_of(source: str) -> tuple[Rule, ...]:
    """The rows that read a registered drop-in's `source`, in table order: its own, and the core's it gives places of."""
    return tuple(rule for rule in table([source]) if rule.reads(source))


@cache
def _table(parts: tuple[TableSource, ...]) -> tuple[Rule, ...]:
    return (*(r for r in RULES if r.places), *(r for part in parts for r in part.rows), *(r for r in RULES if not r.places))


def is_set(value: Any, _: Inputs) -> bool:
    return bool(value)


def is_false(value: Any, _: Inputs) -> bool:
    return value is False


def _above_one(value: Any, _: Inputs) -> bool:
    return (value or 1) > 1


def _vision(inputs: Inputs) -> str | None:
    return "set" if _get(inputs.sources["model"], "vision_config") is not None else None


def _dense_input_ids(inputs: Inputs) -> str | None:
    input_ids = inputs.batch["input_ids"] if "input_ids" in inputs.batch.keys() else None
    if input_ids is None or getattr(input_ids, "is_nested", False):
        return None
    return f"dense tensor {tuple(input_ids.shape)}"


def _first_multimodal_field(inputs: Inputs) -> str | None:
    return next((k for k in inputs.batch.keys() if k in MULTIMODAL_BATCH_FIELDS), None)


def layout_name(inputs: Inputs) -> str | None:
    return inputs.layout.value if inputs.layout is not None else None


def _plan_micro_batches(inputs: Inputs) -> str:
    return f"plan with {len(inputs.plan.micro_batches)} micro-batches"


def _mtp_with_tp_and_sp(inputs: Inputs) -> bool:
    return (inputs.tc("mtp_num_layers") or 0) > 0 and inputs.tp > 1 and bool(inputs.tc("sequence_parallel", False))


def _uneven_top_up(value: Any, inputs: Inputs) -> bool:
    """verl's min_local_rows top-up (the last sequence of a CP group padded until the group holds CP x
    min_local_rows rows) leaves each rank min_local_rows rows, which sequence parallelism splits over
    TP, and in the zigzag layout a last sequence that is a multiple of 2 x CP only when
    min_local_rows is even."""
    tp = _get(inputs.sources["planner config"], "tensor_parallel_size", 1) or 1
    multiple = math.lcm(2, tp) if (inputs.layout or CpLayout.ZIGZAG) is CpLayout.ZIGZAG else tp  # zigzag: the default
    return value is not None and value % multiple != 0


def _plan_not_grouped(_: Any, inputs: Inputs) -> bool:
    return inputs.vpp > 1 and bool(inputs.group) and len(inputs.plan.micro_batches) % inputs.group != 0


def _plan_cp(inputs: Inputs) -> int:
    return max((g.size for mb in _get(inputs.plan, "micro_batches", ()) for g in mb.cp_groups), default=1)


def _transformer_engine(inputs: Inputs) -> str | None:
    version = inputs.installed.transformer_engine if _plan_cp(inputs) > 1 else None
    return ".".join(map(str, version)) if version is not None else None


def _old_transformer_engine(value: Any, inputs: Inputs) -> bool:
    return value is not None and tuple(int(p) for p in value.split(".")) < MIN_TE_VERSION_FOR_THD_CP


def kind_name(value: Any) -> Any:
    return getattr(value, "value", value)


def model_precision(inputs: Inputs) -> Precision | None:
    """The precision the transformer config's fp8 and fp8_recipe run (None: a recipe the planner has no
    alignment for, which the fp8_recipe row refuses)."""
    if inputs.tc("fp8") is None:
        return Precision.BF16
    return MEGATRON_FP8_RECIPES.get(kind_name(inputs.tc("fp8_recipe") or "delayed"))


def _precision_differs(value: Any, inputs: Inputs) -> bool:
    runs = model_precision(inputs)
    try:
        asked = Precision(kind_name(value or "bf16"))
    except ValueError:
        return True  # no precision at all (a plain dict's): refused, naming it
    return runs is not None and asked is not runs


def _sequence_parallel_differs(value: Any, inputs: Inputs) -> bool:
    runs = model_precision(inputs)
    if runs is None or runs is Precision.BF16 or value is None:
        return False
    model = bool(inputs.tc("sequence_parallel", False))
    return rank_row_multiple(runs, inputs.tp, bool(value)) != rank_row_multiple(runs, inputs.tp, model)


def packing_scheduler_name(model: Any) -> Any:
    """The packing scheduler a Megatron-Core model config names (`dynamic_context_parallel=True` says
    default_dynamic_cp); only for a build that has the field (a release has neither)."""
    name = model.sequence_packing_scheduler
    return "default_dynamic_cp" if name is None and getattr(model, "dynamic_context_parallel", False) else name


# The places of each source, by path.
_engine, _model, _transformer, _planner = (partial(Place, source) for source in ("engine", "model", "transformer", "planner config"))


_THD_CP = "the plan runs CP groups on packed THD input, which only Transformer Engine's attention takes; "
_NO_CUDA_GRAPHS = "Megatron-Core does not support CUDA graphs with dynamic CP; "
_NOT_VALUE_MODEL = "value (critic) models are not supported; run the critic with static CP"
_PRECISION_FIX = ("the {what} pads each pass's rows for its precision, which must be the one the model runs (bf16 without fp8; "
                  "fp8_recipe " + ", ".join(f"{name} -> {p.value}" for name, p in MEGATRON_FP8_RECIPES.items()) + "), else "
                  "Transformer Engine's FP8 GEMMs refuse the rows; set precision to it in the planner config (the Megatron-LM "
                  "and Bridge drop-ins derive it)")

RULES: tuple[Rule, ...] = (
    Rule(_engine("use_remove_padding"), "false",
         "dynamic CP packs samples as THD (remove-padding) input; set use_remove_padding=True", is_false, default=True),
    Rule(_engine("is_value_model"), "true", _NOT_VALUE_MODEL, is_set),
    Rule(_engine("distillation"), "set", "distillation is not supported; disable it or use static CP", is_set),
    Rule(_engine("use_megatron_fsdp"), "true",
         "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP or the distributed optimizer (Bridge "
         "copies dist.use_megatron_fsdp to ddp later: leave both False)", is_set, setting="use_megatron_fsdp"),
    # The engine config is verl's (the reference PR's), whose dynamic CP runs bf16 only (verl's docs: no
    # FP8); the Megatron-LM and Bridge drop-ins hand no engine config and run FP8 (the `precision` rows).
    Rule(_engine("fp8"), "set", "verl's engine runs dynamic CP in bf16 only (verl's docs: no FP8); set fp8 to null", is_set),
    Rule(_model("is_value_model"), "true", _NOT_VALUE_MODEL, is_set),
    Rule(_model("vision_config"), "set", "multimodal models are not supported; use a text-only model or static CP",
         is_set, read=_vision),
    Rule(_model("is_multimodal"), "true", "multimodal models are not supported; use a text-only model or static CP", is_set),
    Rule(_transformer("calculate_per_token_loss"), "false",
         "Megatron-Core requires a per-token loss with dynamic CP (micro-batches hold different token "
         "counts); set calculate_per_token_loss=True", lambda v, _: not v, default=False),
    # FP8 runs with dynamic CP where every pass is padded for it (batch_planner/precision.py): the plan
    # must be made for the precision the model runs (the Megatron drop-ins derive it), and the recipe
    # must be one the planner aligns rows for. NVFP4 has no alignment in the planner.
    Rule(_transformer("fp8_recipe"), "'custom' (or another recipe the planner has no row alignment for) with fp8 set",
         "the planner pads each pass's rows for " + ", ".join(MEGATRON_FP8_RECIPES) + " only (batch_planner/precision.py); "
         "use one of them, or fp8=None", lambda v, i: i.tc("fp8") is not None and kind_name(v or "delayed") not in MEGATRON_FP8_RECIPES),
    Rule(_transformer("fp4"), "set (NVFP4)",
         "the planner has no row alignment for NVFP4 (not measured: its GEMMs' row multiples are unknown to the planner), so a "
         "plan's passes would reach Transformer Engine unaligned; set fp4=None (FP8 recipes are supported)", lambda v, _: v is not None),
    Rule(_planner("precision"), "differs from the precision the transformer's fp8 and fp8_recipe run",
         _PRECISION_FIX.format(what="planner config"), lambda v, i: _precision_differs(v, i), needs=("transformer",)),
    Rule(Place("plan", "precision"), "differs from the precision the transformer's fp8 and fp8_recipe run",
         _PRECISION_FIX.format(what="plan"), lambda v, i: _precision_differs(v, i), needs=("transformer",)),
    Rule(_planner("sequence_parallel"), "differs from the transformer's sequence_parallel, with FP8, where that changes the rows' multiple "
         "(FP8 at TP > 2, MXFP8 at TP > 1)",
         "under FP8 each TP rank's sequence-parallel shard must be a multiple of 8 rows (32 under MXFP8; rank_row_multiple), so the plan pads "
         "for the model's sequence parallelism; set sequence_parallel to the transformer's in the planner config",
         lambda v, i: _sequence_parallel_differs(v, i), needs=("transformer",)),
    Rule(_transformer("enable_cuda_graph"), "true", _NO_CUDA_GRAPHS + "set enable_cuda_graph=False", is_set),
    Rule(_transformer("external_cuda_graph"), "true", _NO_CUDA_GRAPHS + "set external_cuda_graph=False", is_set),
    Rule(_transformer("cuda_graph_impl"), "not 'none'", _NO_CUDA_GRAPHS + "set cuda_graph_impl='none'",
         lambda v, _: v not in ("none", None), default="none"),
    Rule(_transformer("moe_router_fusion"), "true with moe_enable_routing_replay",
         "router replay (moe_enable_routing_replay=True) needs the unfused router; set moe_router_fusion=False",
         lambda v, i: bool(i.tc("moe_enable_routing_replay", False)) and bool(v)),
    Rule(_transformer("moe_token_dispatcher_type"), "not 'alltoall'/'flex' with MoE",
         "Megatron-Core's sequence packing supports only the 'alltoall' or 'flex' MoE dispatcher; set one of them",
         lambda v, i: bool(i.tc("num_moe_experts")) and v not in ("alltoall", "flex"), default="allgather",
         schedulers=PACKING_SCHEDULERS),
    Rule(_transformer("multi_latent_attention"), "true",
         "Megatron-Core's hybrid CP (0.19) does not support MLA; use scheduler=dynamic_cp with a "
         "dev-branch Megatron-Core, or static CP", is_set, schedulers=(SchedulerKind.HYBRID_CP,)),
    Rule(_planner("cp_layout"), "'contiguous' (planner config or plan) with multi_latent_attention",
         "Megatron-Core's MLA requires the zigzag CP layout; set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and bool(i.tc("multi_latent_attention", False)), read=layout_name, needs=("transformer",)),
    Rule(_planner("cp_layout"), "'contiguous' (planner config or plan) with MTP, TP > 1 and sequence parallelism",
         "Megatron-Core refuses multi-token prediction with TP > 1, sequence parallelism and the "
         "contiguous CP layout (a known padding-mask bug); set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and _mtp_with_tp_and_sp(i), read=layout_name, needs=("transformer",)),
    Rule(_planner("tensor_parallel_size"), "differs from the transformer's tensor_model_parallel_size",
         "the planner config pads for TP={value} but the model runs tensor_model_parallel_size={tp}; "
         "set tensor_parallel_size={tp} in the planner config",
         lambda v, i: v is not None and v != i.tp, needs=("transformer",)),
    Rule(Place("plan", "tensor_parallel_size"), "differs from the transformer's tensor_model_parallel_size",
         "the plan pads for TP={value} but the model runs tensor_model_parallel_size={tp}; "
         "set tensor_parallel_size={tp} in the planner config",
         lambda v, i: v is not None and v != i.tp, needs=("transformer",)),
    Rule(_planner("context_parallel_size"), "differs from the transformer's context_parallel_size",
         "the planner config says CP={value} but the model runs context_parallel_size={cp}; set them equal",
         lambda v, i: v is not None and v != i.cp, needs=("transformer",)),
    Rule(_transformer("pipeline_model_parallel_size"), "> 1",
         "Megatron-Core's hybrid CP schedule runs without pipelining only; set "
         "pipeline_model_parallel_size=1 or use scheduler=dynamic_cp with a dev-branch Megatron-Core",
         _above_one, default=1, schedulers=(SchedulerKind.HYBRID_CP,)),
    Rule(_transformer("virtual_pipeline_model_parallel_size"), "> 1",
         "the installed Megatron-Core has no VPP-aware packing scheduler (needs a dev-branch build "
         "with data_schedule.DefaultDynamicCPScheduler); unset virtual pipeline parallelism",
         _above_one, build="release"),
    Rule(_planner("micro_batch_group_size"), "differs from microbatch_group_size_per_vp_stage under VPP",
         "with virtual pipeline parallelism the plan must be made with the model's "
         "microbatch_group_size_per_vp_stage={group}; set micro_batch_group_size={group} in the planner config",
         lambda v, i: i.vpp > 1 and v != i.group, needs=("transformer",)),
    Rule(Place("plan", "micro_batch_group_size"), "micro-batch count not a multiple of microbatch_group_size_per_vp_stage under VPP",
         "the plan was not made with micro_batch_group_size={group} (its micro-batch count is not a "
         "multiple of microbatch_group_size_per_vp_stage); plan with micro_batch_group_size={group}",
         _plan_not_grouped, read=_plan_micro_batches, needs=("transformer",)),
    Rule(_transformer("variable_seq_lengths"), "false with pipeline_model_parallel_size > 1",
         "planned micro-batches hold different token counts, so pipeline stages must exchange each one's shape "
         "(Megatron-Core sets it with a sequence_packing_scheduler); set variable_seq_lengths=True",
         lambda v, i: not v and (i.tc("pipeline_model_parallel_size", 1) or 1) > 1, default=False),
    Rule(_transformer("transformer_impl"), "not 'transformer_engine' with a plan of CP groups > 1",
         _THD_CP + "set transformer_impl='transformer_engine' and install the trainer-gpu extra (transformer-engine[pytorch])",
         lambda v, i: v != "transformer_engine" and _plan_cp(i) > 1, default="transformer_engine", needs=("plan",)),
    Rule(_transformer("transformer_engine"), "installed older than 1.10 with a plan of CP groups > 1",
         _THD_CP + "Transformer Engine >= 1.10 takes a CP group for THD attention: install the trainer-gpu extra "
         "(transformer-engine[pytorch])",
         _old_transformer_engine, read=_transformer_engine, needs=("plan",)),
    Rule(Place("batch", "input_ids"), "a dense tensor",
         "dynamic CP needs remove-padding (THD) input: pass input_ids as a jagged NestedTensor "
         "(torch.nested.nested_tensor(..., layout=torch.jagged))",
         lambda v, _: v is not None, read=_dense_input_ids),
    Rule(Place("batch", "batch field"), "one of " + ", ".join(MULTIMODAL_BATCH_FIELDS),
         "multimodal inputs are not supported with dynamic CP; drop them or use static CP",
         lambda v, _: v is not None, read=_first_multimodal_field),
    Rule(_planner("min_local_rows"), "not a multiple of tensor_parallel_size (and, with the zigzag layout, of 2)",
         "verl pads a CP group's last sequence until every rank holds min_local_rows rows, which sequence parallelism "
         "splits over the TP ranks; in the zigzag layout that sequence must also stay a multiple of 2 x CP (Transformer "
         "Engine's THD attention cuts it into 2 x CP chunks): set min_local_rows to a multiple of the tensor parallel size "
         "(and of 2 with zigzag; verl's engine pairs min_local_rows with the contiguous layout)",
         _uneven_top_up),
    # The rows read only at the drop-ins' places of their setting (`TableSource.places`); `table` checks
    # them after the drop-ins' own rows. Megatron's batch-size ramp-up, which a drop-in that reads ahead
    # cannot follow:
    Rule((), "changed between steps (num_microbatches), or set (rampup_batch_size)",
         "the drop-in reads one global batch ahead with the micro-batch count in force; batch-size ramp-up "
         "changes it between steps: turn ramp-up off (unset rampup_batch_size)", is_set, setting="batch_size_rampup"),
    # Read by every drop-in that runs plans of CP groups other than the static one on a release (verl's
    # dynamic CP needs the dev build's per-size DPxCP groups, so it has no release route).
    Rule((), "rope, mrope or yarn",
         "0.19's attention rotates THD input over the static CP group (transformer/attention.py), not the "
         "micro-batch's, so positions are wrong in CP groups of another size: the model would train silently "
         "wrong. Run the trainer on the Megatron-LM dev build (deps/megatron-core.env; it rotates over the "
         "micro-batch's group: Megatron-LM with --sequence-packing-scheduler default_dynamic_cp), or use static CP",
         lambda v, _: v in ROTARY_EMBEDDINGS, build="release", setting="position_embedding_type"),
    Rule((), "set",
         "0.19's multi-token prediction rolls packed THD tokens and labels over the static CP group "
         "(transformer/multi_token_prediction.py, roll_tensor), not the micro-batch's, so in CP groups of "
         "another size its ranks exchange boundary tokens with ranks that hold other samples: the step hangs "
         "or trains wrong. Run the trainer on the Megatron-LM dev build (deps/megatron-core.env; it rolls "
         "within the micro-batch's group), or unset mtp_num_layers", is_set, build="release", setting="mtp_num_layers"),
)


def check(sources: Mapping[str, Any], installed: InstalledMegatron | None = None) -> None:
    """Raises UnsupportedCombinationError for the first rule of the table (`table`) that refuses what
    `sources` (by name, from `known_sources`) hold; `installed` is detected when a rule needs it."""
    inputs = Inputs(sources, installed)
    for rule in _rules_reading(frozenset(name for name in inputs.sources if inputs.given(name)), _registered(None)):
        error = rule.refusal(inputs)
        if error is not None:
            raise error


@cache
def _rules_reading(given: frozenset[str], parts: tuple[TableSource, ...]) -> tuple[Rule, ...]:
    """The rules, in table order, with a place in `given` and all they need there (a drop-in checks
    its own source on every step: this keeps that to its own rows)."""
    return tuple(r for r in _table(parts) if set(r.needs) <= given and any(p.source in given for p in r.places_in()))


def check_dynamic_cp_support(
    *,
    engine_config: Any = None,
    model_config: Any = None,
    transformer_config: Any = None,
    planner_config: Any = None,
    batch: Mapping[str, Any] | None = None,
    plan: Any = None,
    installed: InstalledMegatron | None = None,
) -> None:
    """Raises UnsupportedCombinationError for the first rule of `RULES` that refuses what any trainer
    gives; every argument is optional and only the rules whose sources are present are checked."""
    check({"engine": engine_config, "model": model_config, "transformer": transformer_config,
           "planner config": planner_config, "plan": plan, "batch": batch}, installed)


CONCRETE_SCHEDULERS = (SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING)


def schedulers_the_trainer_runs(planner_config: Any, **configs: Any) -> tuple[SchedulerKind, ...]:
    """The schedulers whose plans this trainer's configs can run, for auto's `auto_schedulers`
    (empty: every one), so that auto never serves a plan the trainer refuses. Raises the first
    refusal when none is left."""
    runs: list[SchedulerKind] = []
    refusals: list[UnsupportedCombinationError] = []
    for kind in CONCRETE_SCHEDULERS:
        try:
            check_dynamic_cp_support(planner_config=dataclasses.replace(planner_config, scheduler=kind), **configs)
            runs.append(kind)
        except UnsupportedCombinationError as refused:
            refusals.append(refused)
    if not runs:
        raise refusals[0]
    return () if len(runs) == len(CONCRETE_SCHEDULERS) else tuple(runs)
