"""The one table of refusals (`RULES`): what dynamic CP, or a drop-in that runs it, cannot run with.

Its sources, where a rule applies and the table itself: docs/trainer-client.md ("Unsupported
combinations: one table"; tests keep it equal to `RULES`) and docs/megatron-bridge.md. The rows come
from the reference PR (verl #6555), Megatron-Core's own requirements for dynamic CP / sequence packing
(dev: training/arguments.py, transformer_config.py; 0.19: hybrid_cp_schedule, multi_latent_attention)
and what the drop-ins hand the trainer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache, cached_property, partial
from typing import Any, Callable, Literal, Mapping, NamedTuple

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.errors import ConfigError, InvalidArgumentError, UnrunnablePlanError, UnsupportedCombinationError

# The schedulers each drop-in's trainer runs (the one home of these allow-lists; the rows below refuse
# the others). Megatron-Core's `sequence_packing_scheduler` names, and the planner's schedulers they are:
MEGATRON_SCHEDULER_NAMES = {"default_dynamic_cp": SchedulerKind.DYNAMIC_CP, "dp_balanced": SchedulerKind.STATIC_PACKING}
# Those that pack a CP group's samples into one THD micro-batch (Megatron-LM's dev drop-in, Bridge's).
PACKING_SCHEDULERS = tuple(MEGATRON_SCHEDULER_NAMES.values())
# Bridge's loop runs one packed forward pass per planned micro-batch: the packing schedulers only.
BRIDGE_SCHEDULERS = PACKING_SCHEDULERS
# verl's engine runs the dynamic-CP contract: dynamic CP, or auto choosing among these only.
VERL_SCHEDULERS = (SchedulerKind.DYNAMIC_CP,)
MULTIMODAL_BATCH_FIELDS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "multi_modal_inputs")

# What a caller may hand `check`, by name; a drop-in's own source is read by its rows only.
SOURCES = ("engine", "model", "transformer", "planner config", "plan", "batch", "bridge", "megatron_lm", "verl")
DROP_IN_SOURCES = {"bridge": "Megatron-Bridge's drop-in", "megatron_lm": "Megatron-LM's drop-ins", "verl": "verl's drop-in"}
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
        from trainer_client.megatron import transformer_engine_version

        return cls(
            vpp_aware_scheduler=discover_schedulers()[SchedulerKind.DYNAMIC_CP].available,
            transformer_engine=transformer_engine_version(),
        )


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


_ABSENT = object()


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


class Inputs:
    """What one call was given, by source, and the facts the rules read from it."""

    def __init__(self, sources: Mapping[str, Any], installed: InstalledMegatron | None):
        unknown = sorted(set(sources) - set(SOURCES))
        if unknown:
            raise InvalidArgumentError(f"unknown refusal-table sources {unknown}; allowed: {list(SOURCES)}")
        self.sources = {name: sources.get(name) for name in SOURCES}
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
            value = _get(value, name, _ABSENT) if value is not None else _ABSENT
            if value is _ABSENT:
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
    applies to (None: both); `schedulers` the schedulers (empty: any; none known: the rule waits)."""

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

    def __post_init__(self) -> None:
        if isinstance(self.places, Place):
            object.__setattr__(self, "places", (self.places,))
        unknown = [p.source for p in self.places if p.source not in SOURCES] + [s for s in self.needs if s not in SOURCES]
        if unknown or (self.read is not None and len(self.places) != 1):
            raise InvalidArgumentError(f"rule for {self.places}: unknown sources {unknown}, or `read` with several places")

    def refusal(self, inputs: Inputs) -> UnsupportedCombinationError | None:
        """The error for the first place whose value this rule refuses; None when none is (`check` has asked `needs`)."""
        if self.schedulers and inputs.scheduler not in self.schedulers:
            return None
        for place in self.places:
            if not inputs.given(place.source):
                continue
            value = self.read(inputs) if self.read is not None else inputs.at(place, self.default)
            # The build is asked last: detecting it imports Megatron-Core's schedulers.
            if self.refused(value, inputs) and self.build in (None, inputs.installed.build):
                fix = self.fix.format(value=value, tp=inputs.tp, cp=inputs.cp, group=inputs.group)
                return self.error(place.path, value, fix, self)
        return None

    @property
    def refused_when(self) -> str:
        """`when` with the row's conditions, as the docs' tables show it."""
        words = [self.when]
        if self.schedulers:
            words.append("with scheduler " + " or ".join(kind.value for kind in self.schedulers))
        if self.build is not None:
            words.append(BUILD_WORDS[self.build])
        words += [f"in {DROP_IN_SOURCES[source]}" for source in self.needs if source in DROP_IN_SOURCES]
        return ", ".join(words)

    def reads(self, source: str) -> bool:
        return source in self.needs or any(place.source == source for place in self.places)


def _is_set(value: Any, _: Inputs) -> bool:
    return bool(value)


def _is_false(value: Any, _: Inputs) -> bool:
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


def _layout(inputs: Inputs) -> str | None:
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
    from trainer_client.megatron import MIN_TE_VERSION_FOR_THD_CP

    return value is not None and tuple(int(p) for p in value.split(".")) < MIN_TE_VERSION_FOR_THD_CP


def _kind_name(value: Any) -> Any:
    return getattr(value, "value", value)


def packing_scheduler_name(model: Any) -> Any:
    """The packing scheduler a Megatron-Core model config names (`dynamic_context_parallel=True` says
    default_dynamic_cp); only for a build that has the field (a release has neither)."""
    name = model.sequence_packing_scheduler
    return "default_dynamic_cp" if name is None and getattr(model, "dynamic_context_parallel", False) else name


def _bridge_scheduler_name(inputs: Inputs) -> Any:
    model = inputs.at(Place("bridge", "model"))
    return packing_scheduler_name(model) if hasattr(model, "sequence_packing_scheduler") else _ABSENT


def _other_auto_schedulers(inputs: Inputs) -> list[str] | None:
    wanted = [_kind_name(k) for k in _get(inputs.sources["planner config"], "auto_schedulers") or ()]
    return [name for name in wanted if name not in [k.value for k in VERL_SCHEDULERS]] or None


def _ranks_without_sample(inputs: Inputs) -> str | None:
    empty = [(i, [r for g in mb.cp_groups if not g.sample_ids for r in range(g.first_rank, g.first_rank + g.size)])
             for i, mb in enumerate(inputs.plan.micro_batches)]
    return next((f"micro-batch {i}: DPxCP ranks {ranks} have no sample" for i, ranks in empty if ranks), None)


def _unaligned_group(inputs: Inputs) -> str | None:
    groups = (g for mb in inputs.plan.micro_batches for g in mb.cp_groups if g.first_rank % g.size)
    return next((f"CP group of ranks {list(range(g.first_rank, g.first_rank + g.size))} (sample ids {list(g.sample_ids)}), "
                 f"first rank {g.first_rank}" for g in groups), None)


# The places of each source, by path.
_engine, _model, _transformer, _planner, _bridge, _megatron_lm = (
    partial(Place, source) for source in ("engine", "model", "transformer", "planner config", "bridge", "megatron_lm")
)


_THD_CP = "the plan runs CP groups on packed THD input, which only Transformer Engine's attention takes; "
_NO_CUDA_GRAPHS = "Megatron-Core does not support CUDA graphs with dynamic CP; "
_NOT_VALUE_MODEL = "value (critic) models are not supported; run the critic with static CP"
_FP8 = "FP8 is not supported with dynamic CP; "
_NO_DPXCP_GROUPS = "Bridge then builds no DPxCP group of each CP size for the plan's CP groups; "

RULES: tuple[Rule, ...] = (
    Rule(_engine("use_remove_padding"), "false",
         "dynamic CP packs samples as THD (remove-padding) input; set use_remove_padding=True", _is_false, default=True),
    Rule(_engine("is_value_model"), "true", _NOT_VALUE_MODEL, _is_set),
    Rule(_engine("distillation"), "set", "distillation is not supported; disable it or use static CP", _is_set),
    Rule((_engine("use_megatron_fsdp"), _bridge("ddp.use_megatron_fsdp"), _bridge("dist.use_megatron_fsdp")), "true",
         "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP or the distributed optimizer (Bridge "
         "copies dist.use_megatron_fsdp to ddp later: leave both False)", _is_set),
    Rule(_engine("fp8"), "set", _FP8 + "set fp8 to null", _is_set),
    Rule(_model("is_value_model"), "true", _NOT_VALUE_MODEL, _is_set),
    Rule(_model("vision_config"), "set", "multimodal models are not supported; use a text-only model or static CP",
         _is_set, read=_vision),
    Rule(_model("is_multimodal"), "true", "multimodal models are not supported; use a text-only model or static CP", _is_set),
    Rule(_transformer("calculate_per_token_loss"), "false",
         "Megatron-Core requires a per-token loss with dynamic CP (micro-batches hold different token "
         "counts); set calculate_per_token_loss=True", lambda v, _: not v, default=False),
    # (fp8_param needs fp8, so this refuses FP8 parameters too.)
    Rule(_transformer("fp8"), "set", _FP8 + "set fp8=None (and fp8_param=False)", lambda v, _: v is not None),
    Rule(_transformer("enable_cuda_graph"), "true", _NO_CUDA_GRAPHS + "set enable_cuda_graph=False", _is_set),
    Rule(_transformer("external_cuda_graph"), "true", _NO_CUDA_GRAPHS + "set external_cuda_graph=False", _is_set),
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
         "dev-branch Megatron-Core, or static CP", _is_set, schedulers=(SchedulerKind.HYBRID_CP,)),
    Rule(_planner("cp_layout"), "'contiguous' (planner config or plan) with multi_latent_attention",
         "Megatron-Core's MLA requires the zigzag CP layout; set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and bool(i.tc("multi_latent_attention", False)), read=_layout, needs=("transformer",)),
    Rule(_planner("cp_layout"), "'contiguous' (planner config or plan) with MTP, TP > 1 and sequence parallelism",
         "Megatron-Core refuses multi-token prediction with TP > 1, sequence parallelism and the "
         "contiguous CP layout (a known padding-mask bug); set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and _mtp_with_tp_and_sp(i), read=_layout, needs=("transformer",)),
    Rule(_planner("cp_layout"), "'contiguous'",
         "0.19's PackedSeqParams has no cp_partition_mode, so its attention takes every CP shard as zigzag; "
         "set cp_layout=zigzag in the planner settings",
         lambda v, _: v == "contiguous", read=_layout, needs=("bridge",), build="release"),
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
    Rule(_bridge("model.pipeline_model_parallel_size"), "> 2",
         "Bridge builds data iterators on the first and last pipeline stages only "
         "(data/utils.is_dataset_built_on_rank), so a middle stage cannot read the step it must plan and "
         "agree on; set pipeline_model_parallel_size to 1 or 2", lambda v, _: (v or 1) > 2),
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
    Rule((_megatron_lm("num_microbatches"), _bridge("train.rampup_batch_size")), "changed between steps (num_microbatches), or set (rampup_batch_size)",
         "the drop-in reads one global batch ahead with the micro-batch count in force; batch-size ramp-up "
         "changes it between steps: turn ramp-up off (unset rampup_batch_size)", _is_set),
    Rule(_bridge("dataset.dataloader_type"), "'batch' or 'external'",
         "'batch' re-batches each step after the plan is made (prepare_finetuning_batch), 'external' hands "
         "over a list of iterators; use dataloader_type='single' (or 'cyclic')", lambda v, _: v in ("batch", "external")),
    Rule(_bridge("dataset.skip_getting_attention_mask_from_dataset"), "false",
         "the dataset's own attention mask does not travel into packed THD micro-batches (THD attention "
         "reads cu_seqlens); pack documents with cu_seqlens and leave it True", _is_false),
    Rule(_bridge("train.iterations_to_skip"), "set",
         "a skipped iteration reads its micro-batches past the drop-in, which has read that step ahead "
         "already; unset iterations_to_skip", _is_set),
    Rule(_bridge("model.is_hybrid_model"), "true",
         "hybrid (Mamba) models need per-sequence state indices the planned THD micro-batches do not carry; "
         "use a transformer model", _is_set),
    Rule(_bridge("model.moe_expert_rank_capacity_factor"), "set",
         "Bridge then re-runs iterations through PagedStashRunner, around the planned schedule; unset "
         "moe_expert_rank_capacity_factor", lambda v, _: v is not None),
    Rule(_bridge("model.overlap_moe_expert_parallel_comm"), "true",
         "Bridge's forward step then builds a schedule plan without the micro-batch's PackedSeqParams; unset "
         "overlap_moe_expert_parallel_comm", _is_set),
    Rule(_bridge("dist.use_decentralized_pg"), "true",
         "dynamic CP runs on parallel_state's per-size DPxCP groups, which decentralized process groups "
         "do not build; set use_decentralized_pg=False", _is_set),
    Rule(_bridge("model.dynamic_context_parallel"), "false",
         _NO_DPXCP_GROUPS + "set cfg.model.dynamic_context_parallel=True", _is_false,
         build="dev", schedulers=(SchedulerKind.DYNAMIC_CP,)),
    Rule(_bridge("model.hybrid_context_parallel"), "false",
         _NO_DPXCP_GROUPS + "on 0.19 set cfg.model.hybrid_context_parallel=True (the plans still come from dynamic CP)",
         _is_false, build="release", schedulers=(SchedulerKind.DYNAMIC_CP,)),
    Rule(_megatron_lm("sequence_packing_scheduler"), "not one of " + ", ".join(map(repr, MEGATRON_SCHEDULER_NAMES)), "wrap_data_iterator's "
         "drop-in plans with Megatron-Core's packing schedulers: set --sequence-packing-scheduler default_dynamic_cp (dynamic CP) or "
         "dp_balanced (static packing)", lambda v, _: v is not _ABSENT and v not in MEGATRON_SCHEDULER_NAMES, default=_ABSENT),
    Rule(_bridge("model.sequence_packing_scheduler"), "not one of " + ", ".join(map(repr, MEGATRON_SCHEDULER_NAMES)),
         "the drop-in plans with Megatron-Core's packing schedulers: set cfg.model.dynamic_context_parallel=True "
         "(dynamic CP) or cfg.model.sequence_packing_scheduler='dp_balanced' (static packing)",
         lambda v, _: v is not _ABSENT and v not in MEGATRON_SCHEDULER_NAMES, read=_bridge_scheduler_name),
    Rule(_planner("scheduler"), "not " + " or ".join(k.value for k in BRIDGE_SCHEDULERS), "each planned micro-batch is one packed "
         "forward pass of Bridge's loop: set scheduler to " + " or ".join(k.value for k in BRIDGE_SCHEDULERS) + " in the planner settings "
         "(a Megatron-Core release has no sequence_packing_scheduler to say it)",
         lambda v, _: v is not None and _kind_name(v) not in [k.value for k in BRIDGE_SCHEDULERS], needs=("bridge",)),
    Rule(_planner("scheduler"), "not dynamic_cp or auto", "verl's engine runs the dynamic-CP contract (docs/verl.md): set scheduler to "
         "dynamic_cp or auto", lambda v, _: _kind_name(v) not in [k.value for k in (*VERL_SCHEDULERS, SchedulerKind.AUTO)], needs=("verl",)),
    Rule(_planner("auto_schedulers"), "names a scheduler other than dynamic_cp", "auto may choose only plans verl's engine runs: set "
         "auto_schedulers to [dynamic_cp] or leave it unset", lambda v, _: v is not None, read=_other_auto_schedulers, needs=("verl",)),
    Rule(Place("plan", "micro_batches"), "a micro-batch in which a DPxCP rank runs no sample",
         "verl's engine runs every rank of the DPxCP group on a sample in every micro-batch; plan with dynamic_cp "
         "(its groups cover every rank)", lambda v, _: v is not None, read=_ranks_without_sample, needs=("verl",),
         error=UnrunnablePlanError),
    Rule(Place("plan", "cp_groups"), "a CP group whose first rank is not a multiple of its size",
         "verl's engine runs CP groups of aligned ranks only (its per-size DPxCP groups); plan with dynamic_cp",
         lambda v, _: v is not None, read=_unaligned_group, needs=("verl",), error=UnrunnablePlanError),
    # One row each for every drop-in that runs plans of CP groups other than the static one on a
    # release (verl's dynamic CP needs the dev build's per-size DPxCP groups, so it has no release route).
    Rule((_megatron_lm("position_embedding_type"), _bridge("model.position_embedding_type")), "rope, mrope or yarn",
         "0.19's attention rotates THD input over the static CP group (transformer/attention.py), not the "
         "micro-batch's, so positions are wrong in CP groups of another size: the model would train silently "
         "wrong. Run the trainer on the Megatron-LM dev build (deps/megatron-core.env; it rotates over the "
         "micro-batch's group: Megatron-LM with --sequence-packing-scheduler default_dynamic_cp), or use static CP",
         lambda v, _: v in ROTARY_EMBEDDINGS, build="release"),
    Rule((_megatron_lm("mtp_num_layers"), _bridge("model.mtp_num_layers")), "set",
         "0.19's multi-token prediction rolls packed THD tokens and labels over the static CP group "
         "(transformer/multi_token_prediction.py, roll_tensor), not the micro-batch's, so in CP groups of "
         "another size its ranks exchange boundary tokens with ranks that hold other samples: the step hangs "
         "or trains wrong. Run the trainer on the Megatron-LM dev build (deps/megatron-core.env; it rolls "
         "within the micro-batch's group), or unset mtp_num_layers", _is_set, build="release"),
    Rule(_bridge("model.max_seqlen_per_dp_cp_rank"), "not set",
         "dynamic CP plans each rank's tokens against it: set cfg.model.max_seqlen_per_dp_cp_rank "
         "(e.g. seq_length // context_parallel_size)", lambda v, _: v is None),
)


def check(sources: Mapping[str, Any], installed: InstalledMegatron | None = None) -> None:
    """Raises UnsupportedCombinationError for the first rule of `RULES` that refuses what `sources`
    (by name, from `SOURCES`) hold; `installed` is detected when a rule needs it."""
    inputs = Inputs(sources, installed)
    for rule in _rules_reading(frozenset(name for name in SOURCES if inputs.given(name))):
        error = rule.refusal(inputs)
        if error is not None:
            raise error


@cache
def _rules_reading(given: frozenset[str]) -> tuple[Rule, ...]:
    """The rules, in table order, with a place in `given` and all they need there (a drop-in checks
    its own source on every step: this keeps that to its own rows)."""
    return tuple(r for r in RULES if set(r.needs) <= given and any(p.source in given for p in r.places))


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
