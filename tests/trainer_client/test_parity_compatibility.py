"""The unsupported-combination rules (trainer_client/refusals/compatibility.py, RULES): every rule any
trainer's configs reach refuses an example of its own, naming the option and the fix (the rows read
only from a drop-in's own source: tests/trainer_client/megatron_lm/test_megatron_dropin_units.py and tests/trainer_client/megatron_bridge); supported
combinations pass (the docs' tables: tests/trainer_client/test_refusal_docs.py). Megatron-Core's real
TransformerConfig (constructed on CPU), plain dicts/objects for the rest."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import PlanRequest, SchedulerKind
from tests.support.megatron_builds import best_local_scheduler
from trainer_client import BatchPlannerClient, PlannerClientConfig
from trainer_client.refusals.compatibility import RULES, InstalledMegatron, UnsupportedCombinationError, check, check_dynamic_cp_support

# Bridge's drop-in registers the `bridge` source (and its places of the FSDP row), which some tests below hand `check`.
import trainer_client.megatron_bridge  # noqa: F401

LENGTHS = (3000, 1500, 700, 500, 301, 97, 1000, 64)


def transformer(**overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

        values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, calculate_per_token_loss=True)
        values.update(overrides)
        return TransformerConfig(**values)


def planner(**overrides):
    return PlannerClientConfig(max_seqlen_per_dp_cp_rank=1024, **overrides)


def batch(**extra):
    fields = {"input_ids": torch.nested.nested_tensor([torch.arange(n) for n in LENGTHS], layout=torch.jagged)}
    fields.update(extra)
    return TensorDict(fields, batch_size=[len(LENGTHS)])


def hybrid_plan():
    return plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024))


def relabelled_plan(scheduler, micro_batches):
    # Only this check's own error handling is under test: a real plan with its scheduler label and
    # micro-batch count changed, since 0.19.2 has no VPP-aware scheduler to make one.
    plan = hybrid_plan()
    return dataclasses.replace(plan, scheduler=scheduler, micro_batches=(plan.micro_batches * 8)[:micro_batches])


VPP = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
           microbatch_group_size_per_vp_stage=4, variable_seq_lengths=True,
           # 0.19's TransformerConfig refuses variable_seq_lengths with its default (allgather) dispatcher.
           moe_token_dispatcher_type="alltoall")
VPP_READY = InstalledMegatron(vpp_aware_scheduler=True)
DYNAMIC = dict(scheduler="dynamic_cp")

# (row id, arguments of check_dynamic_cp_support, (source, option) of the rule that must refuse,
#  a phrase of the fix)
REFUSED = [
    ("remove padding off", lambda: dict(engine_config={"use_remove_padding": False}), ("engine", "use_remove_padding"), "set use_remove_padding=True"),
    ("dense input_ids", lambda: dict(batch=TensorDict({"input_ids": torch.zeros(2, 8)}, batch_size=[2])), ("batch", "input_ids"), "jagged NestedTensor"),
    ("value model (engine)", lambda: dict(engine_config=SimpleNamespace(is_value_model=True)), ("engine", "is_value_model"), "static CP"),
    ("value model (model)", lambda: dict(model_config={"is_value_model": True}), ("model", "is_value_model"), "critic"),
    ("multimodal model", lambda: dict(model_config=SimpleNamespace(vision_config={"depth": 32})), ("model", "vision_config"), "text-only"),
    ("multimodal flag", lambda: dict(model_config={"is_multimodal": True}), ("model", "is_multimodal"), "text-only"),
    ("multimodal batch", lambda: dict(batch=batch(pixel_values=torch.zeros(len(LENGTHS), 3))), ("batch", "batch field"), "multimodal"),
    ("distillation", lambda: dict(engine_config={"distillation": {"teacher": "big"}}), ("engine", "distillation"), "disable it"),
    ("fp8 engine (verl's)", lambda: dict(engine_config={"fp8": "e4m3"}), ("engine", "fp8"), "null"),
    ("fp8 transformer, planner config in bf16", lambda: dict(transformer_config=transformer(fp8="hybrid"), planner_config=planner()),
     ("planner config", "precision"), "delayed -> fp8_delayed"),
    ("fp8 transformer, plan in bf16", lambda: dict(transformer_config=transformer(fp8="e4m3", fp8_recipe="tensorwise"), plan=hybrid_plan()),
     ("plan", "precision"), "tensorwise -> fp8_current"),
    ("fp8 custom recipe", lambda: dict(transformer_config=SimpleNamespace(fp8="e4m3", fp8_recipe="custom", calculate_per_token_loss=True)),
     ("transformer", "fp8_recipe"), "delayed, tensorwise, blockwise, mxfp8"),
    ("nvfp4", lambda: dict(transformer_config=transformer(fp4="e2m1")), ("transformer", "fp4"), "fp4=None"),
    ("fp8, TP 4, sequence parallelism differs from the planner's", lambda: dict(
        transformer_config=transformer(fp8="e4m3", tensor_model_parallel_size=4, sequence_parallel=False),
        planner_config=planner(precision="fp8_delayed", tensor_parallel_size=4, sequence_parallel=True)),
     ("planner config", "sequence_parallel"), "set sequence_parallel to the transformer's"),
    ("mxfp8, TP 2, sequence parallelism differs from the planner's", lambda: dict(
        transformer_config=transformer(fp8="e4m3", fp8_recipe="mxfp8", tensor_model_parallel_size=2, sequence_parallel=True),
        planner_config=planner(precision="mxfp8", tensor_parallel_size=2, sequence_parallel=False)),
     ("planner config", "sequence_parallel"), "32 under MXFP8"),
    ("a planner config dict naming no precision", lambda: dict(transformer_config=transformer(fp8="e4m3"),
                                                              planner_config={"precision": "fp8"}),
     ("planner config", "precision"), "delayed -> fp8_delayed"),
    ("megatron fsdp", lambda: dict(engine_config={"use_megatron_fsdp": True}), ("engine", "use_megatron_fsdp"), "DDP"),
    ("no per-token loss", lambda: dict(transformer_config=transformer(calculate_per_token_loss=False)),
     ("transformer", "calculate_per_token_loss"), "calculate_per_token_loss=True"),
    ("cuda graphs", lambda: dict(transformer_config=transformer(cuda_graph_impl="local")), ("transformer", "cuda_graph_impl"), "cuda_graph_impl='none'"),
    ("cuda graphs (legacy flag)", lambda: dict(transformer_config=transformer(enable_cuda_graph=True)),
     ("transformer", "enable_cuda_graph"), "enable_cuda_graph=False"),
    ("external cuda graphs", lambda: dict(transformer_config={"calculate_per_token_loss": True, "external_cuda_graph": True}),
     ("transformer", "external_cuda_graph"), "external_cuda_graph=False"),
    ("router replay + fused router", lambda: dict(transformer_config=transformer(
        num_moe_experts=4, moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True, moe_router_fusion=True)),
     ("transformer", "moe_router_fusion"), "moe_router_fusion=False"),
    ("MoE allgather dispatcher with packing", lambda: dict(transformer_config=transformer(num_moe_experts=4), planner_config=planner(**DYNAMIC)),
     ("transformer", "moe_token_dispatcher_type"), "'alltoall' or 'flex'"),
    ("MLA on hybrid CP", lambda: dict(transformer_config=transformer(multi_latent_attention=True), plan=hybrid_plan()),
     ("transformer", "multi_latent_attention"), "dynamic_cp"),
    ("MLA contiguous", lambda: dict(transformer_config=transformer(multi_latent_attention=True),
                                    planner_config=planner(cp_layout="contiguous", **DYNAMIC)),
     ("planner config", "cp_layout"), "MLA requires the zigzag"),
    ("MTP + TP + SP contiguous", lambda: dict(transformer_config=transformer(mtp_num_layers=1, tensor_model_parallel_size=2, sequence_parallel=True),
     planner_config=planner(cp_layout="contiguous", tensor_parallel_size=2, **DYNAMIC)), ("planner config", "cp_layout"), "multi-token prediction"),
    ("verl's top-up leaves a zigzag sequence uneven", lambda: dict(planner_config=planner(padding="verl", min_local_rows=5, **DYNAMIC)),
     ("planner config", "min_local_rows"), "multiple of 2 x CP"),
    ("verl's top-up splits unevenly over TP", lambda: dict(planner_config=planner(
        padding="verl", min_local_rows=3, cp_layout="contiguous", tensor_parallel_size=2, **DYNAMIC)),
     ("planner config", "min_local_rows"), "sequence parallelism"),
    ("TP differs from planner", lambda: dict(transformer_config=transformer(tensor_model_parallel_size=2), planner_config=planner()),
     ("planner config", "tensor_parallel_size"), "set tensor_parallel_size=2"),
    ("TP differs from plan", lambda: dict(transformer_config=transformer(tensor_model_parallel_size=2), plan=hybrid_plan()),
     ("plan", "tensor_parallel_size"), "set tensor_parallel_size=2"),
    ("CP differs from planner", lambda: dict(transformer_config=transformer(context_parallel_size=2), planner_config=planner()),
     ("planner config", "context_parallel_size"), "set them equal"),
    ("pipeline with hybrid CP", lambda: dict(transformer_config=transformer(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
     planner_config=planner(scheduler=SchedulerKind.HYBRID_CP)), ("transformer", "pipeline_model_parallel_size"), "pipeline_model_parallel_size=1"),
    ("VPP without a VPP-aware Megatron-Core", lambda: dict(transformer_config=transformer(**VPP), installed=InstalledMegatron(False)),
     ("transformer", "virtual_pipeline_model_parallel_size"), "dev-branch"),
    ("VPP, planner group size differs", lambda: dict(transformer_config=transformer(**VPP), planner_config=planner(micro_batch_group_size=2, **DYNAMIC),
     installed=VPP_READY), ("planner config", "micro_batch_group_size"), "set micro_batch_group_size=4"),
    ("pipeline without variable sequence lengths", lambda: dict(transformer_config=transformer(pipeline_model_parallel_size=2,
     pipeline_dtype=torch.float32), planner_config=planner(**DYNAMIC)), ("transformer", "variable_seq_lengths"),
     "set variable_seq_lengths=True"),
    ("CP plan on Megatron's local attention (no THD with a CP group)", lambda: dict(transformer_config=transformer(
        transformer_impl="local"), plan=hybrid_plan()), ("transformer", "transformer_impl"), "transformer_impl='transformer_engine'"),
    ("CP plan on a Transformer Engine without THD CP", lambda: dict(transformer_config=transformer(), plan=hybrid_plan(),
        installed=InstalledMegatron(True, (1, 9))), ("transformer", "transformer_engine"), "Transformer Engine >= 1.10"),
    ("VPP, plan not made with the group size", lambda: dict(transformer_config=transformer(**VPP), plan=relabelled_plan(SchedulerKind.DYNAMIC_CP, 6),
     installed=VPP_READY), ("plan", "micro_batch_group_size"), "plan with micro_batch_group_size=4"),
]


def refusal(arguments) -> UnsupportedCombinationError:
    with pytest.raises(UnsupportedCombinationError) as caught:
        check_dynamic_cp_support(**arguments())
    return caught.value


@pytest.mark.parametrize("row", REFUSED, ids=[r[0] for r in REFUSED])
def test_each_unsupported_combination_is_refused_naming_the_option_and_the_fix(row):
    _, arguments, (source, option), fix = row
    error = refusal(arguments)
    assert (source, option) in error.rule.places and error.option == option
    assert fix in str(error) and option in str(error)


def test_every_rule_refuses_an_example():
    """Every core row with a place of its own (the others are read at a drop-in's places only)."""
    fired = {id(refusal(arguments).rule) for _, arguments, _, _ in REFUSED}
    untested = [(rule.places, rule.when) for rule in RULES if rule.places and id(rule) not in fired]
    assert not untested, f"rules without a refusing example: {untested}"


def test_a_rule_written_once_reads_every_place_of_its_setting():
    """The FSDP rule reads the engine config and both of Bridge's places, and names the one it refused."""
    from types import SimpleNamespace as Config

    engine = refusal(lambda: dict(engine_config={"use_megatron_fsdp": True}))
    for path in ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp"):
        section, name = path.split(".")
        bridge = Config(ddp=Config(use_megatron_fsdp=False), dist=Config(use_megatron_fsdp=False))
        setattr(getattr(bridge, section), name, True)
        with pytest.raises(UnsupportedCombinationError) as caught:
            check({"bridge": bridge})
        assert caught.value.rule is engine.rule and caught.value.option == path and "=True" in str(caught.value)
    with pytest.raises(ValueError, match="unknown refusal-table sources.*'engine_config'"):
        check({"engine_config": {}})


def test_a_rows_build_schedulers_and_sources_decide_where_it_applies():
    """Bridge's release-only rows on a release and a dev build, for dynamic CP and static packing, and
    Bridge's layout row with and without Bridge's config (no Bridge needed: its config as plain objects)."""
    from types import SimpleNamespace as Config

    def first_refused(installed, scheduler, bridge=True, **planner_settings):
        sources = {"planner config": planner(scheduler=scheduler, **planner_settings)}
        if bridge:
            sources["bridge"] = Config(model=Config(hybrid_context_parallel=False, position_embedding_type="rope", max_seqlen_per_dp_cp_rank=4096))
        try:
            check(sources, installed)
        except UnsupportedCombinationError as refused:
            return refused.option
        return None

    release, dev = InstalledMegatron(False), VPP_READY
    assert first_refused(release, "dynamic_cp") == "model.hybrid_context_parallel"
    assert first_refused(release, "static_packing") == "model.position_embedding_type"
    assert first_refused(dev, "dynamic_cp") is None
    assert first_refused(release, "static_packing", cp_layout="contiguous") == "cp_layout"
    assert first_refused(dev, "static_packing", cp_layout="contiguous") is None
    assert first_refused(release, "static_packing", bridge=False, cp_layout="contiguous") is None


ACCEPTED = [
    ("nothing known yet", lambda: dict()),
    ("verl-like engine + text model", lambda: dict(engine_config={"use_remove_padding": True, "fp8": None}, model_config={"vision_config": None})),
    ("dense transformer, hybrid plan, jagged batch",
     lambda: dict(transformer_config=transformer(), planner_config=planner(), plan=hybrid_plan(), batch=batch())),
    ("MoE alltoall + router replay unfused, dynamic CP", lambda: dict(transformer_config=transformer(
        num_moe_experts=4, moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True), planner_config=planner(**DYNAMIC))),
    ("MoE allgather on hybrid CP", lambda: dict(transformer_config=transformer(num_moe_experts=4), planner_config=planner(scheduler=SchedulerKind.HYBRID_CP))),
    ("fp8 transformer, planner config and plan padded for it", lambda: dict(
        transformer_config=transformer(fp8="e4m3", fp8_recipe="blockwise", tensor_model_parallel_size=2, sequence_parallel=True),
        planner_config=planner(precision="fp8_block", tensor_parallel_size=2),
        plan=plan_batch(PlanRequest.of(LENGTHS, 4, 1, 1024, precision=Precision.FP8_BLOCK, tensor_parallel_size=2)))),
    ("fp8 with TP 2: sequence parallelism changes no multiple (8 x 2 = 16 either way)", lambda: dict(
        transformer_config=transformer(fp8="e4m3", tensor_model_parallel_size=2, sequence_parallel=False),
        planner_config=planner(precision="fp8_delayed", tensor_parallel_size=2, sequence_parallel=True))),
    ("MLA zigzag on dynamic CP", lambda: dict(transformer_config=transformer(multi_latent_attention=True), planner_config=planner(**DYNAMIC))),
    ("VPP with matching group size on a VPP-aware Megatron-Core", lambda: dict(
        transformer_config=transformer(**VPP), planner_config=planner(micro_batch_group_size=4, **DYNAMIC),
        plan=relabelled_plan(SchedulerKind.DYNAMIC_CP, 8), installed=VPP_READY)),
]


@pytest.mark.parametrize("row", ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_supported_combinations_pass(row):
    check_dynamic_cp_support(**row[1]())


def test_installed_megatron_core_vpp_support_follows_scheduler_discovery():
    from batch_planner.schedulers import discover_schedulers

    dynamic = discover_schedulers()[SchedulerKind.DYNAMIC_CP].available
    assert InstalledMegatron.detect().vpp_aware_scheduler is dynamic
    if not dynamic:  # 0.19.x: VPP is refused without being told what is installed
        with pytest.raises(UnsupportedCombinationError, match="virtual_pipeline_model_parallel_size=2"):
            check_dynamic_cp_support(transformer_config=transformer(**VPP))


def test_client_checks_configs_at_construction_and_batches_when_applying():
    with pytest.raises(UnsupportedCombinationError, match="calculate_per_token_loss"):
        BatchPlannerClient(planner(), dp_cp_size=4, transformer_config=transformer(calculate_per_token_loss=False))
    with pytest.raises(UnsupportedCombinationError, match="use_remove_padding"):
        BatchPlannerClient(planner(), dp_cp_size=4, engine_config={"use_remove_padding": False})
    client = BatchPlannerClient(
        planner(scheduler=best_local_scheduler()), dp_cp_size=4, transformer_config=transformer(),
        engine_config={"use_remove_padding": True},
    )
    try:
        plan = client.plan_step(0, LENGTHS)
        assert client.micro_batches(plan, batch())  # a supported batch applies
        with pytest.raises(UnsupportedCombinationError, match="multimodal"):
            client.micro_batches(plan, batch(image_grid_thw=torch.ones(len(LENGTHS), 3)))
    finally:
        client.close()
