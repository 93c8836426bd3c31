"""A tiny Megatron-Core GPTModel whose tokens interact, on one of two engines (`AttentionModelConfig.engine`):

- "cpu-standin": Megatron-Core's own `SelfAttention` (its linear layers and its RoPE code, unfused)
  on its local layer spec, with only core attention replaced by the CPU stand-in for Transformer
  Engine's THD attention (tests/support/cp_attention_standin.py); fp32 on the CPU. Build it inside
  `CudaDeviceRequestsOnCpu()`.
- "transformer-engine": Megatron-Core's Transformer Engine layer spec (`TEDotProductAttention`:
  Transformer Engine's THD/CP kernels and ring; its fused norm and linear layers); bf16 on the
  current CUDA device (tests/trainer_client/transformer_engine).

Build it after `parallel_state.initialize_model_parallel`; every rank of a pipeline stage that builds
it with the same config gets the same weights."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from tests.support.cp_attention_standin import layer_spec_with_standin


Engine = Literal["cpu-standin", "transformer-engine"]


@dataclasses.dataclass(frozen=True)
class AttentionModelConfig:
    engine: Engine = "cpu-standin"
    """Core attention and where the model runs (module docstring)."""
    vocab_size: int = 64
    hidden_size: int = 32
    """Hidden width; 4 attention heads of hidden_size / 4 (Transformer Engine's fused attention takes
    head sizes that are multiples of 8: its models are built 128 wide)."""
    num_layers: int = 2
    max_position: int = 512
    """The longest sequence the model takes (RoPE tables, learned positions)."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """"rope": Megatron-Core's RoPE on THD input ignores position_ids and rotates by each row's
    place in the CP layout; "learned_absolute" reads position_ids."""
    cp_partition_mode: Literal["zigzag", "contiguous"] = "zigzag"
    """The layout of the model's input shards (TransformerConfig.cp_partition_mode, dev build):
    Megatron-Core converts contiguous input to zigzag around attention."""
    context_parallel_size: int = 1
    """parallel_state's static CP size (TransformerConfig.context_parallel_size)."""
    num_moe_experts: int | None = None
    """An MoE MLP of this many experts (Megatron-Core's alltoall token dispatcher, top-2 routing,
    no load-balancing loss, no token dropping: each token's output depends on itself alone);
    the expert-parallel size comes from parallel_state. CPU stand-ins: tests/support/moe_on_cpu.py."""
    mtp_num_layers: int | None = None
    """Multi-token prediction layers (Megatron-Core's MTP block on the same local spec and stand-in),
    on the last pipeline stage as upstream places them without a custom layout. Megatron-Core
    scales each forward's MTP loss by that forward's own token counts (process_mtp_loss), so only
    with mtp_loss_scaling_factor=0 do the gradients equal a whole-sample run's."""
    mtp_loss_scaling_factor: float = 0.0
    init_method_std: float = 0.3
    """Larger than Megatron-Core's 0.02, so that attention at initialisation is far from uniform and
    a token that attends to the wrong keys (or at the wrong positions) changes the loss visibly."""
    seed: int = 1234
    transformer_overrides: tuple[tuple[str, object], ...] = ()
    """Further TransformerConfig fields, as (name, value) pairs (e.g. MTP or MoE settings)."""


def transformer_config(cfg: AttentionModelConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = cfg.engine == "transformer-engine"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    fields = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=4,
        context_parallel_size=cfg.context_parallel_size, use_cpu_initialization=not on_gpu,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=on_gpu, fp16=False,
        init_method_std=cfg.init_method_std,
    )
    has_mode = any(f.name == "cp_partition_mode" for f in dataclasses.fields(TransformerConfig))
    if cfg.cp_partition_mode != "zigzag" and not has_mode:
        raise ValueError("this Megatron-Core build's TransformerConfig has no cp_partition_mode: zigzag only")
    if cfg.num_moe_experts is not None:
        from megatron.core import parallel_state

        fields.update(
            num_moe_experts=cfg.num_moe_experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none", moe_grouped_gemm=False, moe_permute_fusion=False,
            add_bias_linear=False, ffn_hidden_size=cfg.hidden_size,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )
    if cfg.mtp_num_layers is not None:
        fields.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
                      calculate_per_token_loss=True)
    fields.update(dict(cfg.transformer_overrides))
    config = TransformerConfig(**fields)
    if has_mode:
        # Set after the config's checks: contiguous with CP asks for a sequence_packing_scheduler,
        # and with one set the check asks for Transformer Engine >= 2.9, which GPU trainers have and
        # this machine cannot. (With a static CP size > 1 upstream refuses contiguous for standard
        # attention whatever the scheduler: contiguous models here keep context_parallel_size=1,
        # as dynamic CP runs.)
        config.cp_partition_mode = cfg.cp_partition_mode
    return config


def layer_spec(cfg: AttentionModelConfig):
    """The engine's layer spec: the local spec with the attention stand-in, or Transformer Engine's."""
    if cfg.engine == "transformer-engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    return layer_spec_with_standin(cfg.num_moe_experts)


def attention_gpt_model(cfg: AttentionModelConfig = AttentionModelConfig(), *, pre_process: bool = True,
                        post_process: bool = True, **model_kwargs):
    """GPTModel(position_embedding_type=cfg's) on the engine's layer spec (`layer_spec`)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(cfg)
    spec = layer_spec(cfg)
    if cfg.mtp_num_layers is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        model_kwargs.setdefault("mtp_block_spec", get_gpt_mtp_block_spec(
            config, spec, use_transformer_engine=cfg.engine == "transformer-engine", vp_stage=model_kwargs.get("vp_stage")))
    torch.manual_seed(cfg.seed)
    # On the CPU, Megatron-Core's inference RNG tracker: its fork() does nothing (dropout is 0); on a
    # GPU the real CUDA RNG tracker.
    on_cpu = cfg.engine == "cpu-standin"
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed, inference_rng_tracker=on_cpu, force_reset_rng=on_cpu)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position, position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False, pre_process=pre_process, post_process=post_process, **model_kwargs,
    )
