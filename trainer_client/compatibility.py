"""The one place that refuses engine, model and batch features dynamic CP cannot run with.

`RULES` is the table of refusals, one `Rule` (source, option, condition, fix) per row; the table
"Unsupported combinations" in docs/trainer-client.md is the same table, and a test keeps the two
equal. `check_dynamic_cp_support` is called as each piece of information becomes available (the
client calls it at construction with the configs it was given, and again in `micro_batches()` with
the batch and the plan); every argument is optional and only the rules whose inputs are present
are checked, in table order. Configs may be dataclasses, plain objects or dicts; the transformer
config is Megatron-Core's `TransformerConfig` (its attribute names are used as they are).

Each refusal raises `UnsupportedCombinationError` naming the option, its value and what to change.
The rows come from the reference PR (verl #6555) and from Megatron-Core's own requirements for
dynamic CP / sequence packing (megatron/training/arguments.py and transformer_config.py on the
dev branch; hybrid_cp_schedule and multi_latent_attention on 0.19).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.errors import UnsupportedCombinationError

PACKING_SCHEDULERS = (SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING)
MULTIMODAL_BATCH_FIELDS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "multi_modal_inputs")


@dataclass(frozen=True)
class InstalledMegatron:
    """What the installed Megatron-Core can do that changes the answer."""

    # The dev-branch packing schedulers (data_schedule.DefaultDynamicCPScheduler) align the number
    # of micro-batches to the VPP micro-batch group; 0.19's hybrid CP runs without pipelining only.
    vpp_aware_scheduler: bool
    # The installed Transformer Engine's (major, minor); None when it is not installed.
    transformer_engine: tuple[int, ...] | None = None

    @classmethod
    def detect(cls) -> InstalledMegatron:
        from batch_planner.schedulers import discover_schedulers
        from trainer_client.megatron import transformer_engine_version

        return cls(
            vpp_aware_scheduler=discover_schedulers()[SchedulerKind.DYNAMIC_CP].available,
            transformer_engine=transformer_engine_version(),
        )


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


class Inputs:
    """What one call was given, and the facts the rules read from it."""

    def __init__(self, *, engine: Any, model: Any, transformer: Any, planner: Any, plan: Any,
                 batch: Mapping[str, Any] | None, installed: InstalledMegatron | None):
        self.sources: dict[str, Any] = {
            "engine": engine, "model": model, "transformer": transformer,
            "planner config": planner, "plan": plan, "batch": batch,
        }
        self.transformer, self.plan, self.batch, self._installed = transformer, plan, batch, installed
        # Read at once, so a bad scheduler or layout name fails whatever else is present.
        scheduler = _get(plan, "scheduler") or _get(planner, "scheduler")
        self.scheduler = SchedulerKind(scheduler) if scheduler is not None else None
        layout = _get(plan, "cp_layout") or _get(planner, "cp_layout")
        self.layout = CpLayout(layout) if layout is not None else None

    def tc(self, name: str, default: Any = None) -> Any:
        return _get(self.transformer, name, default)

    @property
    def tp(self) -> int:
        return self.tc("tensor_model_parallel_size", 1) or 1

    @property
    def cp(self) -> int:
        return self.tc("context_parallel_size", 1) or 1

    @property
    def vpp(self) -> int:
        return self.tc("virtual_pipeline_model_parallel_size") or 1

    @property
    def group(self) -> int | None:
        return self.tc("microbatch_group_size_per_vp_stage")

    @cached_property
    def installed(self) -> InstalledMegatron:
        # Detected only when a rule asks (VPP in use): it imports Megatron-Core's schedulers.
        return self._installed or InstalledMegatron.detect()


@dataclass(frozen=True)
class Rule:
    """One refusal: `option` of `source` is refused when `refused(value, inputs)` holds.

    The rule is checked only when every input in `needs` (default: the source) was given. `value`
    is the option read from the source (`default` when absent) unless `read` says otherwise.
    `fix` may name {value}, {tp}, {cp} and {group} (the transformer's sizes)."""

    source: str
    option: str
    when: str  # the condition in words, as docs/trainer-client.md shows it
    fix: str
    refused: Callable[[Any, Inputs], bool]
    default: Any = None
    read: Callable[[Inputs], Any] | None = None
    also_needs: tuple[str, ...] = ()

    def value(self, inputs: Inputs) -> Any:
        if self.read is not None:
            return self.read(inputs)
        return _get(inputs.sources[self.source], self.option, self.default)

    def applies(self, inputs: Inputs) -> bool:
        return all(inputs.sources[name] is not None for name in (self.source, *self.also_needs))

    def error(self, value: Any, inputs: Inputs) -> UnsupportedCombinationError:
        fix = self.fix.format(value=value, tp=inputs.tp, cp=inputs.cp, group=inputs.group)
        return UnsupportedCombinationError(self.option, value, fix, self)


def _is_set(value: Any, _: Inputs) -> bool:
    return bool(value)


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


def _packing_moe_dispatcher(value: Any, inputs: Inputs) -> bool:
    return bool(inputs.tc("num_moe_experts")) and inputs.scheduler in PACKING_SCHEDULERS and value not in ("alltoall", "flex")


def _plan_not_grouped(_: Any, inputs: Inputs) -> bool:
    return inputs.vpp > 1 and bool(inputs.group) and len(inputs.plan.micro_batches) % inputs.group != 0


def _plan_cp(inputs: Inputs) -> int:
    """The largest CP group of the plan (1 when it has none larger)."""
    return max((g.size for mb in _get(inputs.plan, "micro_batches", ()) for g in mb.cp_groups), default=1)


def _transformer_engine(inputs: Inputs) -> str | None:
    version = inputs.installed.transformer_engine if _plan_cp(inputs) > 1 else None
    return ".".join(map(str, version)) if version is not None else None


def _old_transformer_engine(value: Any, inputs: Inputs) -> bool:
    from trainer_client.megatron import MIN_TE_VERSION_FOR_THD_CP

    return value is not None and tuple(int(p) for p in value.split(".")) < MIN_TE_VERSION_FOR_THD_CP


_THD_CP = "the plan runs CP groups on packed THD input, which only Transformer Engine's attention takes; "
_NO_CUDA_GRAPHS = "Megatron-Core does not support CUDA graphs with dynamic CP; "
_NOT_VALUE_MODEL = "value (critic) models are not supported; run the critic with static CP"
_FP8 = "FP8 is not supported with dynamic CP; "

RULES: tuple[Rule, ...] = (
    Rule("engine", "use_remove_padding", "false",
         "dynamic CP packs samples as THD (remove-padding) input; set use_remove_padding=True",
         lambda v, _: v is False, default=True),
    Rule("engine", "is_value_model", "true", _NOT_VALUE_MODEL, _is_set),
    Rule("engine", "distillation", "set", "distillation is not supported; disable it or use static CP", _is_set),
    Rule("engine", "use_megatron_fsdp", "true",
         "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP/distributed optimizer", _is_set),
    Rule("engine", "fp8", "set", _FP8 + "set fp8 to null", _is_set),
    Rule("model", "is_value_model", "true", _NOT_VALUE_MODEL, _is_set),
    Rule("model", "vision_config", "set", "multimodal models are not supported; use a text-only model or static CP",
         _is_set, read=_vision),
    Rule("model", "is_multimodal", "true", "multimodal models are not supported; use a text-only model or static CP", _is_set),
    Rule("transformer", "calculate_per_token_loss", "false",
         "Megatron-Core requires a per-token loss with dynamic CP (micro-batches hold different token "
         "counts); set calculate_per_token_loss=True", lambda v, _: not v, default=False),
    # (fp8_param needs fp8, so this refuses FP8 parameters too.)
    Rule("transformer", "fp8", "set", _FP8 + "set fp8=None (and fp8_param=False)", lambda v, _: v is not None),
    Rule("transformer", "enable_cuda_graph", "true", _NO_CUDA_GRAPHS + "set enable_cuda_graph=False", _is_set),
    Rule("transformer", "external_cuda_graph", "true", _NO_CUDA_GRAPHS + "set external_cuda_graph=False", _is_set),
    Rule("transformer", "cuda_graph_impl", "not 'none'", _NO_CUDA_GRAPHS + "set cuda_graph_impl='none'",
         lambda v, _: v not in ("none", None), default="none"),
    Rule("transformer", "moe_router_fusion", "true with moe_enable_routing_replay",
         "router replay (moe_enable_routing_replay=True) needs the unfused router; set moe_router_fusion=False",
         lambda v, i: bool(i.tc("moe_enable_routing_replay", False)) and bool(v)),
    Rule("transformer", "moe_token_dispatcher_type", "not 'alltoall'/'flex' with MoE and a packing scheduler",
         "Megatron-Core's sequence packing supports only the 'alltoall' or 'flex' MoE dispatcher; set one of them",
         _packing_moe_dispatcher, default="allgather"),
    Rule("transformer", "multi_latent_attention", "true with hybrid CP",
         "Megatron-Core's hybrid CP (0.19) does not support MLA; use scheduler=dynamic_cp with a "
         "dev-branch Megatron-Core, or static CP",
         lambda v, i: bool(v) and i.scheduler is SchedulerKind.HYBRID_CP),
    Rule("planner config", "cp_layout", "'contiguous' (planner config or plan) with multi_latent_attention",
         "Megatron-Core's MLA requires the zigzag CP layout; set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and bool(i.tc("multi_latent_attention", False)),
         read=_layout, also_needs=("transformer",)),
    Rule("planner config", "cp_layout", "'contiguous' (planner config or plan) with MTP, TP > 1 and sequence parallelism",
         "Megatron-Core refuses multi-token prediction with TP > 1, sequence parallelism and the "
         "contiguous CP layout (a known padding-mask bug); set cp_layout=zigzag",
         lambda v, i: v == "contiguous" and _mtp_with_tp_and_sp(i), read=_layout, also_needs=("transformer",)),
    Rule("planner config", "tensor_parallel_size", "differs from the transformer's tensor_model_parallel_size",
         "the planner config pads for TP={value} but the model runs tensor_model_parallel_size={tp}; "
         "set tensor_parallel_size={tp} in the planner config",
         lambda v, i: v is not None and v != i.tp, also_needs=("transformer",)),
    Rule("plan", "tensor_parallel_size", "differs from the transformer's tensor_model_parallel_size",
         "the plan pads for TP={value} but the model runs tensor_model_parallel_size={tp}; "
         "set tensor_parallel_size={tp} in the planner config",
         lambda v, i: v is not None and v != i.tp, also_needs=("transformer",)),
    Rule("planner config", "context_parallel_size", "differs from the transformer's context_parallel_size",
         "the planner config says CP={value} but the model runs context_parallel_size={cp}; set them equal",
         lambda v, i: v is not None and v != i.cp, also_needs=("transformer",)),
    Rule("transformer", "pipeline_model_parallel_size", "> 1 with hybrid CP",
         "Megatron-Core's hybrid CP schedule runs without pipelining only; set "
         "pipeline_model_parallel_size=1 or use scheduler=dynamic_cp with a dev-branch Megatron-Core",
         lambda v, i: (v or 1) > 1 and i.scheduler is SchedulerKind.HYBRID_CP, default=1),
    Rule("transformer", "virtual_pipeline_model_parallel_size", "> 1 on a Megatron-Core without a VPP-aware packing scheduler",
         "the installed Megatron-Core has no VPP-aware packing scheduler (needs a dev-branch build "
         "with data_schedule.DefaultDynamicCPScheduler); unset virtual pipeline parallelism",
         lambda v, i: (v or 1) > 1 and not i.installed.vpp_aware_scheduler),
    Rule("planner config", "micro_batch_group_size", "differs from microbatch_group_size_per_vp_stage under VPP",
         "with virtual pipeline parallelism the plan must be made with the model's "
         "microbatch_group_size_per_vp_stage={group}; set micro_batch_group_size={group} in the planner config",
         lambda v, i: i.vpp > 1 and v != i.group, also_needs=("transformer",)),
    Rule("plan", "micro_batch_group_size", "micro-batch count not a multiple of microbatch_group_size_per_vp_stage under VPP",
         "the plan was not made with micro_batch_group_size={group} (its micro-batch count is not a "
         "multiple of microbatch_group_size_per_vp_stage); plan with micro_batch_group_size={group}",
         _plan_not_grouped, read=_plan_micro_batches, also_needs=("transformer",)),
    Rule("transformer", "transformer_impl", "not 'transformer_engine' with a plan of CP groups > 1",
         _THD_CP + "set transformer_impl='transformer_engine' and install the trainer-gpu extra (transformer-engine[pytorch])",
         lambda v, i: v != "transformer_engine" and _plan_cp(i) > 1, default="transformer_engine", also_needs=("plan",)),
    Rule("transformer", "transformer_engine", "installed older than 1.10 with a plan of CP groups > 1",
         _THD_CP + "Transformer Engine >= 1.10 takes a CP group for THD attention: install the trainer-gpu extra "
         "(transformer-engine[pytorch])",
         _old_transformer_engine, read=_transformer_engine, also_needs=("plan",)),
    Rule("batch", "input_ids", "a dense tensor",
         "dynamic CP needs remove-padding (THD) input: pass input_ids as a jagged NestedTensor "
         "(torch.nested.nested_tensor(..., layout=torch.jagged))",
         lambda v, _: v is not None, read=_dense_input_ids),
    Rule("batch", "batch field", "one of " + ", ".join(MULTIMODAL_BATCH_FIELDS),
         "multimodal inputs are not supported with dynamic CP; drop them or use static CP",
         lambda v, _: v is not None, read=_first_multimodal_field),
)


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
    """Raises UnsupportedCombinationError for the first rule of `RULES` that refuses."""
    inputs = Inputs(engine=engine_config, model=model_config, transformer=transformer_config,
                    planner=planner_config, plan=plan, batch=batch, installed=installed)
    for rule in RULES:
        if not rule.applies(inputs):
            continue
        value = rule.value(inputs)
        if rule.refused(value, inputs):
            raise rule.error(value, inputs)


CONCRETE_SCHEDULERS = (SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING)


def schedulers_the_trainer_runs(planner_config: Any, **configs: Any) -> tuple[SchedulerKind, ...]:
    """The schedulers whose plans this trainer's configs can run, for auto's `auto_schedulers`
    (empty: every one), so that auto never serves a plan the trainer refuses. Raises the first
    refusal when none is left."""
    runs: list[SchedulerKind] = []
    first: UnsupportedCombinationError | None = None
    for kind in CONCRETE_SCHEDULERS:
        try:
            check_dynamic_cp_support(planner_config=dataclasses.replace(planner_config, scheduler=kind), **configs)
            runs.append(kind)
        except UnsupportedCombinationError as refused:
            first = first or refused
    if not runs:
        assert first is not None
        raise first
    return () if len(runs) == len(CONCRETE_SCHEDULERS) else tuple(runs)
