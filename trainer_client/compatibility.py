"""The one place that refuses engine, model and batch features dynamic CP cannot run with.

`check_dynamic_cp_support` is called as each piece of information becomes available (the client
calls it at construction with the configs it was given, and again in `micro_batches()` with the
batch and the plan); every argument is optional and only the rows whose inputs are present are
checked. Configs may be dataclasses, plain objects or dicts; the transformer config is Megatron-Core's
`TransformerConfig` (its attribute names are used as they are).

Each refusal raises `UnsupportedCombinationError` naming the option, its value and what to change.
The rows come from the reference PR (verl #6555) and from Megatron-Core's own requirements for
dynamic CP / sequence packing (megatron/training/arguments.py and transformer_config.py on the
dev branch; hybrid_cp_schedule and multi_latent_attention on 0.19).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from batch_planner.request import CpLayout, SchedulerKind

PACKING_SCHEDULERS = (SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING)
MULTIMODAL_BATCH_FIELDS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "multi_modal_inputs")


class UnsupportedCombinationError(ValueError):
    """A feature dynamic CP cannot run with; `.option` names it."""

    def __init__(self, option: str, value: Any, fix: str):
        self.option, self.value, self.fix = option, value, fix
        super().__init__(f"dynamic CP does not support {option}={value!r}: {fix}")


@dataclass(frozen=True)
class InstalledMegatron:
    """What the installed Megatron-Core can do that changes the answer."""

    # The dev-branch packing schedulers (data_schedule.DefaultDynamicCPScheduler) align the number
    # of micro-batches to the VPP micro-batch group; 0.19's hybrid CP runs without pipelining only.
    vpp_aware_scheduler: bool

    @classmethod
    def detect(cls) -> InstalledMegatron:
        from batch_planner.schedulers import discover_schedulers

        return cls(vpp_aware_scheduler=discover_schedulers()[SchedulerKind.DYNAMIC_CP].available)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


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
    """Raises UnsupportedCombinationError for the first unsupported combination found."""
    scheduler = _get(plan, "scheduler") or _get(planner_config, "scheduler")
    scheduler = SchedulerKind(scheduler) if scheduler is not None else None
    layout = _get(plan, "cp_layout") or _get(planner_config, "cp_layout")
    layout = CpLayout(layout) if layout is not None else None
    _check_engine(engine_config)
    _check_model(engine_config, model_config)
    if transformer_config is not None:
        _check_transformer(transformer_config, scheduler, layout)
        _check_parallel_sizes(transformer_config, planner_config, plan)
        _check_pipeline(transformer_config, planner_config, plan, scheduler, installed)
        _check_attention(transformer_config, plan)
    if batch is not None:
        _check_batch(batch)


def _refuse(option: str, value: Any, fix: str) -> None:
    raise UnsupportedCombinationError(option, value, fix)


def _check_engine(engine: Any) -> None:
    if engine is None:
        return
    if _get(engine, "use_remove_padding", True) is False:
        _refuse("use_remove_padding", False, "dynamic CP packs samples as THD (remove-padding) input; set use_remove_padding=True")
    if _get(engine, "is_value_model", False):
        _refuse("is_value_model", True, "value (critic) models are not supported; run the critic with static CP")
    if _get(engine, "distillation"):
        _refuse("distillation", _get(engine, "distillation"), "distillation is not supported; disable it or use static CP")
    if _get(engine, "use_megatron_fsdp", False):
        _refuse("use_megatron_fsdp", True, "Megatron-Core's dynamic CP does not support Megatron FSDP; use DDP/distributed optimizer")
    fp8 = _get(engine, "fp8")
    if fp8:
        _refuse("fp8", fp8, "FP8 is not supported with dynamic CP; set fp8 to null")


def _check_model(engine: Any, model: Any) -> None:
    if model is None:
        return
    if _get(model, "is_value_model", False):
        _refuse("is_value_model", True, "value (critic) models are not supported; run the critic with static CP")
    vision = _get(model, "vision_config")
    if _get(model, "is_multimodal", False) or vision is not None:
        _refuse(
            "vision_config" if vision is not None else "is_multimodal",
            "set" if vision is not None else True,
            "multimodal models are not supported; use a text-only model or static CP",
        )


def _check_transformer(tc: Any, scheduler: SchedulerKind | None, layout: CpLayout | None) -> None:
    if not _get(tc, "calculate_per_token_loss", False):
        _refuse(
            "calculate_per_token_loss",
            _get(tc, "calculate_per_token_loss", False),
            "Megatron-Core requires a per-token loss with dynamic CP (micro-batches hold different token "
            "counts); set calculate_per_token_loss=True",
        )
    if _get(tc, "fp8") is not None:
        # (fp8_param needs fp8, so this refuses FP8 parameters too.)
        _refuse("fp8", _get(tc, "fp8"), "FP8 is not supported with dynamic CP; set fp8=None (and fp8_param=False)")
    if _get(tc, "enable_cuda_graph", False):
        _refuse("enable_cuda_graph", True, "Megatron-Core does not support CUDA graphs with dynamic CP; set enable_cuda_graph=False")
    if _get(tc, "external_cuda_graph", False):
        _refuse("external_cuda_graph", True, "Megatron-Core does not support CUDA graphs with dynamic CP; set external_cuda_graph=False")
    if _get(tc, "cuda_graph_impl", "none") not in ("none", None):
        _refuse("cuda_graph_impl", _get(tc, "cuda_graph_impl"), "Megatron-Core does not support CUDA graphs with dynamic CP; set cuda_graph_impl='none'")
    if _get(tc, "moe_enable_routing_replay", False) and _get(tc, "moe_router_fusion", False):
        _refuse(
            "moe_router_fusion",
            True,
            "router replay (moe_enable_routing_replay=True) needs the unfused router; set moe_router_fusion=False",
        )
    if _get(tc, "num_moe_experts") and scheduler in PACKING_SCHEDULERS:
        dispatcher = _get(tc, "moe_token_dispatcher_type", "allgather")
        if dispatcher not in ("alltoall", "flex"):
            _refuse(
                "moe_token_dispatcher_type",
                dispatcher,
                "Megatron-Core's sequence packing supports only the 'alltoall' or 'flex' MoE dispatcher; set one of them",
            )
    if _get(tc, "multi_latent_attention", False):
        if scheduler is SchedulerKind.HYBRID_CP:
            _refuse(
                "multi_latent_attention",
                True,
                "Megatron-Core's hybrid CP (0.19) does not support MLA; use scheduler=dynamic_cp with a "
                "dev-branch Megatron-Core, or static CP",
            )
        if layout is CpLayout.CONTIGUOUS:
            _refuse("cp_layout", "contiguous", "Megatron-Core's MLA requires the zigzag CP layout; set cp_layout=zigzag")
    if (
        layout is CpLayout.CONTIGUOUS
        and (_get(tc, "mtp_num_layers") or 0) > 0
        and (_get(tc, "tensor_model_parallel_size", 1) or 1) > 1
        and _get(tc, "sequence_parallel", False)
    ):
        _refuse(
            "cp_layout",
            "contiguous",
            "Megatron-Core refuses multi-token prediction with TP > 1, sequence parallelism and the "
            "contiguous CP layout (a known padding-mask bug); set cp_layout=zigzag",
        )


def _check_parallel_sizes(tc: Any, planner_config: Any, plan: Any) -> None:
    tp = _get(tc, "tensor_model_parallel_size", 1) or 1
    for source, planned in (("planner config", _get(planner_config, "tensor_parallel_size")), ("plan", _get(plan, "tensor_parallel_size"))):
        if planned is not None and planned != tp:
            _refuse(
                "tensor_parallel_size",
                planned,
                f"the {source} pads for TP={planned} but the model runs tensor_model_parallel_size={tp}; "
                f"set tensor_parallel_size={tp} in the planner config",
            )
    cp = _get(tc, "context_parallel_size", 1) or 1
    planned_cp = _get(planner_config, "context_parallel_size")
    if planned_cp is not None and planned_cp != cp:
        _refuse(
            "context_parallel_size",
            planned_cp,
            f"the planner config says CP={planned_cp} but the model runs context_parallel_size={cp}; set them equal",
        )


def _check_pipeline(tc: Any, planner_config: Any, plan: Any, scheduler: SchedulerKind | None, installed: InstalledMegatron | None) -> None:
    pp = _get(tc, "pipeline_model_parallel_size", 1) or 1
    vpp = _get(tc, "virtual_pipeline_model_parallel_size") or 1
    if pp > 1 and scheduler is SchedulerKind.HYBRID_CP:
        _refuse(
            "pipeline_model_parallel_size",
            pp,
            "Megatron-Core's hybrid CP schedule runs without pipelining only; set "
            "pipeline_model_parallel_size=1 or use scheduler=dynamic_cp with a dev-branch Megatron-Core",
        )
    if vpp <= 1:
        return
    installed = installed or InstalledMegatron.detect()
    if not installed.vpp_aware_scheduler:
        _refuse(
            "virtual_pipeline_model_parallel_size",
            vpp,
            "the installed Megatron-Core has no VPP-aware packing scheduler (needs a dev-branch build "
            "with data_schedule.DefaultDynamicCPScheduler); unset virtual pipeline parallelism",
        )
    group = _get(tc, "microbatch_group_size_per_vp_stage")
    planned_group = _get(planner_config, "micro_batch_group_size")
    if planner_config is not None and planned_group != group:
        _refuse(
            "micro_batch_group_size",
            planned_group,
            f"with virtual pipeline parallelism the plan must be made with the model's "
            f"microbatch_group_size_per_vp_stage={group}; set micro_batch_group_size={group} in the planner config",
        )
    if plan is not None and group:
        count = len(plan.micro_batches)
        if count % group:
            _refuse(
                "micro_batch_group_size",
                f"plan with {count} micro-batches",
                f"the plan was not made with micro_batch_group_size={group} (its micro-batch count is not a "
                f"multiple of microbatch_group_size_per_vp_stage); plan with micro_batch_group_size={group}",
            )


def _check_attention(tc: Any, plan: Any) -> None:
    """Packed THD micro-batches with a CP group run through Transformer Engine's attention only."""
    cp_sizes = {g.size for mb in _get(plan, "micro_batches", ()) for g in mb.cp_groups}
    if not cp_sizes or max(cp_sizes) <= 1:
        return
    impl = _get(tc, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        _refuse(
            "transformer_impl",
            impl,
            f"the plan runs CP groups of size {max(cp_sizes)} on packed THD input, which only Transformer "
            "Engine's attention takes; set transformer_impl='transformer_engine' and install the "
            "trainer-gpu extra (transformer-engine[pytorch])",
        )
    from trainer_client.megatron import MIN_TE_VERSION_FOR_THD_CP, transformer_engine_version

    version = transformer_engine_version()
    if version is not None and version < MIN_TE_VERSION_FOR_THD_CP:
        _refuse(
            "transformer_engine",
            ".".join(map(str, version)),
            f"the plan runs CP groups of size {max(cp_sizes)} on packed THD input; Transformer Engine "
            f">= {'.'.join(map(str, MIN_TE_VERSION_FOR_THD_CP))} takes a CP group for THD attention: "
            "install the trainer-gpu extra (transformer-engine[pytorch])",
        )


def _check_batch(batch: Mapping[str, Any]) -> None:
    keys = list(batch.keys())
    if "input_ids" in keys and not getattr(batch["input_ids"], "is_nested", False):
        _refuse(
            "input_ids",
            f"dense tensor {tuple(batch['input_ids'].shape)}",
            "dynamic CP needs remove-padding (THD) input: pass input_ids as a jagged NestedTensor "
            "(torch.nested.nested_tensor(..., layout=torch.jagged))",
        )
    multimodal = [k for k in keys if k in MULTIMODAL_BATCH_FIELDS]
    if multimodal:
        _refuse("batch field", multimodal[0], "multimodal inputs are not supported with dynamic CP; drop them or use static CP")
