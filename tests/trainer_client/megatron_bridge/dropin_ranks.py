"""What one rank of the Bridge drop-in tests runs: Bridge's own distributed initialisation, rerun
state machine, `train_step`, `evaluate`, GPT forward step and loss, on a tiny Megatron-Core
GPTModel, with the drop-in enabled and the planner on loopback.

Real: Bridge's ConfigContainer (real sub-configs), `_initialize_distributed`, `init_rerun_state`,
`GlobalState` and timers, `optim.setup_optimizer` (Megatron-Core's `get_megatron_optimizer` and
Bridge's scheduler), `train_step`, `evaluate`, `gpt_step.forward_step`, `masked_next_token_loss`;
Megatron-Core's GPTModel, DistributedDataParallel, `finalize_model_grads`, parallel_state and
`forward_backward_no_pipelining`. On a CPU the loss is Megatron-Core's unfused vocab-parallel cross
entropy, as the GPU-only fusions are off (Bridge's default fuses it with torch.compile, which
compiles C++ with Inductor in every rank here).

CPU stand-ins, each named as such, for what needs CUDA here:
- `tests.support.megatron_init`'s stand-ins for `torch.cuda.current_device` / `synchronize` (group
  creation on the dev build; Megatron-Core's timers synchronize on every start and stop);
- `torch.cuda.current_stream` -> `CpuStandInStream`: the dev build's DDP grad sync asks the current
  stream to wait for CUDA-graph events;
- `torch.cuda.get_rng_state` / `set_rng_state` (empty state, no-op): the rerun state machine saves
  and restores CUDA's RNG state around a rerun;
- the CUDA RNG tracker: Megatron-Core's own inference tracker, whose fork() does nothing (dropout
  is 0, nothing random runs under it);
- `CudaDeviceRequestsOnCpu`: a tensor asked for on CUDA is made on the CPU (Bridge's
  `get_batch_from_iterator` and `evaluate`, DDP's grad buffer, the optimizer's loss scale and grad
  norm, the schedule's token count, the rerun state machine's reductions);
- `torch.cuda.is_current_stream_capturing` (False: no stream captures on a CPU; Megatron-Core's
  pipeline p2p asks it, tests/support/attention_pipeline.py);
- `clip_grad=0`: Megatron-Core's gradient clipping asserts CUDA tensors (the norm is still computed);
- core attention: Megatron-Core's local attention takes no packed THD input with a CP group, only
  Transformer Engine's does. The model's layers are Megatron-Core's own `SelfAttention` (its linear
  layers and, on the dev build, its RoPE over the micro-batch's CP group) with only core attention
  replaced by the CPU stand-in for Transformer Engine's THD/CP attention
  (tests/support/cp_attention_standin.py). Tokens attend to the earlier tokens of their own sequence, so a
  wrong CP group, shard or position changes the loss against the single-process reference over
  whole samples. On the 0.19 release the model uses learned positions: the drop-in refuses RoPE
  there (0.19 rotates over the static CP group).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import warnings
from functools import partial

import torch
import torch.distributed as dist

from tests.support.attention_pipeline import stand_in_for_pipeline_calls_on_cpu
from tests.support.cuda_requests_on_cpu import CpuStandInStream, CudaDeviceRequestsOnCpu  # noqa: F401 (the tests enter it as ranks.CudaDeviceRequestsOnCpu)
from tests.support.launch import init_gloo

VOCAB = 64
HIDDEN = 16
MAX_POSITION = 512
MAX_SEQLEN_PER_RANK = 64
MICRO_BATCHES = 2  # Bridge's num_microbatches: packed micro-batches each DP rank reads per step
LR = 0.5  # SGD
INIT_STD = 0.3
"""Larger than Megatron-Core's 0.02, so that attention at initialisation is far from uniform and a
token that attends to the wrong keys (or at the wrong positions) changes the loss visibly."""


def sequence_lengths(step: int, dp_rank: int, micro_batch: int) -> list[int]:
    """The sequences packed in one micro-batch: long-tail lengths, one past a single rank's budget."""
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro_batch)
    count = 2 + int(torch.randint(0, 3, (1,), generator=g))
    lengths = [int(x) for x in torch.randint(1, 48, (count,), generator=g)]
    if (step + dp_rank + micro_batch) % 3 == 0:
        lengths[0] = 65 + int(torch.randint(0, 60, (1,), generator=g))  # longer than one rank holds: CP2 or more
    return lengths


def micro_batch(step: int, dp_rank: int, index: int) -> dict[str, torch.Tensor]:
    """One of Bridge's packed micro-batches ([1, T] fields, `cu_seqlens` padded with -1 as Bridge's
    packed datasets pad it, `cu_seqlens_argmin`). Every token id is drawn from the sample's own
    seed, so each sample is recognisable by its tokens."""
    lengths = sequence_lengths(step, dp_rank, index)
    tokens, labels, masks, positions = [], [], [], []
    for k, n in enumerate(lengths):
        g = torch.Generator().manual_seed(hash((step, dp_rank, index, k)) % (2**31))
        tokens.append(torch.randint(0, VOCAB, (n,), generator=g))
        labels.append(torch.randint(0, VOCAB, (n,), generator=g))
        mask = torch.ones(n)
        mask[-1] = 0.0  # the last token of each sequence has no next token
        masks.append(mask)
        positions.append(torch.arange(n))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded_cu = torch.cat([cu, torch.full((2,), -1, dtype=torch.int32)])
    return {
        "tokens": torch.cat(tokens)[None], "labels": torch.cat(labels)[None], "loss_mask": torch.cat(masks)[None],
        "position_ids": torch.cat(positions)[None], "attention_mask": None,
        "cu_seqlens": padded_cu[None], "cu_seqlens_argmin": torch.tensor(len(cu)), "max_seqlen": torch.tensor(max(lengths)),
    }


def global_samples(step: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """The step's samples by global id (DP rank order, as the drop-in numbers them), unpacked."""
    from trainer_client.megatron_bridge import unpack_micro_batch

    return [s for d in range(dp_size) for m in range(MICRO_BATCHES) for s in unpack_micro_batch(micro_batch(step, d, m), m)]


class CountingIterator:
    """The user's data iterator: counts each micro-batch read, so a test sees what was read twice."""

    def __init__(self, dp_rank: int, steps: int, first_step: int = 0):
        self.items = [(s, dp_rank, m) for s in range(first_step, first_step + steps) for m in range(MICRO_BATCHES)]
        self.reads: list[tuple[int, int, int]] = []

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.reads) == len(self.items):
            raise StopIteration
        item = self.items[len(self.reads)]
        self.reads.append(item)
        return micro_batch(*item)


def stand_in_for_cuda_calls_on_cpu() -> None:
    """The CUDA calls of the module docstring, stood in where CUDA is not available."""
    if torch.cuda.is_available():
        return
    from tests.support import megatron_init

    megatron_init._stand_in_for_cuda_calls_on_cpu()
    stand_in_for_pipeline_calls_on_cpu()
    torch.cuda.current_stream = lambda *args, **kwargs: CpuStandInStream()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None


def bridge_config(tp: int, cp: int, world: int, pp: int = 1, vpp: int | None = None, **overrides):
    """Bridge's ConfigContainer for the tiny model (real config classes): one layer per pipeline
    stage (and virtual stage); with several stages, variable sequence lengths (the planned
    micro-batches' token counts differ, so the stages exchange shapes); with virtual stages,
    Megatron-LM's p2p settings for them (overlap_p2p_comm, no batched p2p)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        MockGPTDatasetConfig, OptimizerConfig, RerunStateMachineConfig, SchedulerConfig, TokenizerConfig, TrainingConfig,
        ValidationConfig,
    )

    dp = world // (tp * cp * pp)
    model_fields = dict(
        num_layers=pp * (vpp or 1), pipeline_model_parallel_size=pp, variable_seq_lengths=pp > 1,
        virtual_pipeline_model_parallel_size=vpp, **({"overlap_p2p_comm": True, "batch_p2p_comm": False} if vpp else {}),
        # 0.19's config check refuses variable sequence lengths with the default (allgather) MoE
        # dispatcher even for a dense model; the dev build checks only MoE models.
        moe_token_dispatcher_type="alltoall", hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB, seq_length=MAX_POSITION,
        tensor_model_parallel_size=tp, context_parallel_size=cp, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        position_embedding_type=position_embedding_type(), share_embeddings_and_output_weights=False,
        bf16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        # Bridge's default fuses the loss with torch.compile: on a CPU, Inductor compiles C++ in every
        # rank (~20 s of CPU each); there, Megatron-Core's unfused vocab-parallel cross entropy.
        cross_entropy_loss_fusion=torch.cuda.is_available(),
        init_method_std=INIT_STD,
    )
    model_fields.update(overrides.pop("model", {}))
    cfg = ConfigContainer(
        model=GPTModelProvider(**model_fields),
        train=TrainingConfig(micro_batch_size=1, global_batch_size=MICRO_BATCHES * dp, train_iters=10, **overrides.pop("train", {})),
        optimizer=OptimizerConfig(optimizer="sgd", lr=LR, min_lr=LR, clip_grad=0.0, use_distributed_optimizer=False,
                                  **overrides.pop("optimizer", {})),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.0, end_weight_decay=0.0,
                                  weight_decay_incr_style="constant"),
        dataset=MockGPTDatasetConfig(random_seed=0, seq_length=MAX_POSITION, **overrides.pop("dataset", {})),
        logger=LoggerConfig(), tokenizer=TokenizerConfig(), checkpoint=CheckpointConfig(),
        ddp=DistributedDataParallelConfig(**overrides.pop("ddp", {})),
        dist=DistributedInitConfig(distributed_backend="gloo", **overrides.pop("dist", {})),
        rerun_state_machine=RerunStateMachineConfig(**overrides.pop("rerun_state_machine", {})),
        validation=ValidationConfig(eval_iters=1, eval_global_batch_size=MICRO_BATCHES * dp, eval_micro_batch_size=1),
    )
    assert not overrides, overrides
    for part in (cfg.model, cfg.optimizer, cfg.ddp):
        part.finalize()  # Bridge's deferred Megatron-Core post-init, as its cfg.validate() runs it
    cfg._calculate_scheduler_steps()  # the scheduler's step counts, as Bridge's cfg.validate() derives them
    # Set after it: with a packing scheduler, Megatron-Core's config check asks for Transformer
    # Engine >= 2.9, which GPU trainers install and this machine cannot.
    setattr(cfg.model, "dynamic_context_parallel" if _has_dynamic_cp() else "hybrid_context_parallel", True)
    cfg.data_parallel_size = dp
    return cfg


def _has_dynamic_cp() -> bool:
    from megatron.core.model_parallel_config import ModelParallelConfig

    return any(f.name == "dynamic_context_parallel" for f in dataclasses.fields(ModelParallelConfig))


def position_embedding_type() -> str:
    """RoPE where the drop-in runs it (the dev build); learned positions on 0.19, which it refuses RoPE on."""
    return "rope" if _has_dynamic_cp() else "learned_absolute"


def tiny_model(cfg, vp_stage: int | None = None, engine: str = "cpu-standin") -> torch.nn.Module:
    """This pipeline stage's (or virtual stage's) GPTModel with the attention stand-in (see the
    module docstring), or on a GPU with Transformer Engine's layer spec (`engine`
    "transformer-engine", tests/trainer_client/transformer_engine), seeded alike on every rank of the stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from tests.support.attention_model import AttentionModelConfig, layer_spec

    virtual = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
    spec = layer_spec(AttentionModelConfig(engine=engine))
    extra: dict = {"vp_stage": vp_stage} if vp_stage is not None else {}
    if cfg.model.mtp_num_layers:  # Megatron-Core's MTP block (on the last stage) on the same spec and attention
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(cfg.model, spec, use_transformer_engine=engine == "transformer-engine",
                                                         vp_stage=vp_stage)
    torch.manual_seed(1234 + (vp_stage or 0))
    return GPTModel(config=cfg.model, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=MAX_POSITION, position_embedding_type=cfg.model.position_embedding_type,
                    share_embeddings_and_output_weights=False, pre_process=parallel_state.is_pipeline_first_stage(**virtual),
                    post_process=parallel_state.is_pipeline_last_stage(**virtual), **extra)


def reference_loss(model: torch.nn.Module, samples: list[dict[str, torch.Tensor]]) -> float:
    """Single pass over the unsharded samples, one at a time, each a THD sequence of its own at CP1:
    sum of masked token losses / real tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    solo = solo_group()
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for s in samples:
            n = int(s["tokens"].shape[0])
            cu = torch.tensor([0, n], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                     cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n, local_cp_size=1,
                                     cp_group=solo)
            losses = model(input_ids=s["tokens"][None], position_ids=s["position_ids"][None], attention_mask=None,
                           labels=s["labels"][None], packed_seq_params=params)
            total += float((losses.view(-1).double() * s["loss_mask"].double()).sum())
            tokens += float(s["loss_mask"].sum())
    return total / tokens


_SOLO_GROUPS: list = []


def solo_group():
    """A process group of this rank alone, for the CP1 reference: parallel_state's own where it built
    one (the dev build), else one made here once (every rank makes every rank's, in the same order,
    as torch.distributed.new_group asks; parallel_state builds none with a minimum CP size of 2, and
    0.19 builds none)."""
    from tests.support.megatron_init import is_dynamic_build, parallel_state_cp_group

    if is_dynamic_build():
        try:
            return parallel_state_cp_group(1)
        except KeyError:
            pass
    if not _SOLO_GROUPS:
        _SOLO_GROUPS.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
    return _SOLO_GROUPS[dist.get_rank()]


def pipeline_reference_loss(modules: list[torch.nn.Module], samples: list[dict[str, torch.Tensor]]) -> float:
    """The same over the pipeline (this stage's model chunks, Megatron-Core's schedule, forward
    only), at CP1: with one chunk each whole sample is a micro-batch of its own; with virtual stages
    the samples are packed, whole, into two micro-batches (the interleaved schedule takes a multiple
    of the micro-batch group). Every stage calls it; the last stage's value is the loss, the others' 0.0."""
    from tests.support.attention_parity import Sample, shard
    from tests.support.attention_pipeline import _forward_step, run_pipeline

    whole = [Sample(s["tokens"], s["labels"], s["loss_mask"]) for s in samples]
    solo = solo_group()
    if len(modules) == 1:
        groups = [[i] for i in range(len(whole))]
    else:
        half = (len(whole) + 1) // 2
        groups = [list(range(half)), list(range(half, len(whole)))]
    shards = [shard(whole, ids, solo) for ids in groups]
    with torch.no_grad():
        loss, tokens, _ = run_pipeline(modules, [iter(list(shards)) for _ in modules], len(shards), _forward_step, forward_only=True)
    return loss / tokens if tokens else 0.0


def start_rank(rank: int, world: int, store_path: str, tp: int, cp: int, pp: int = 1, vpp: int | None = None,
               engine: str = "cpu-standin", **overrides):
    """gloo (unless the caller started it), then Bridge's own distributed initialisation, rerun state
    machine and optimizer setup; returns what train_step needs: (cfg, state, model list, optimizer,
    scheduler, pg_collection, p2p). On the CPU, call it, and run the steps, inside
    `CudaDeviceRequestsOnCpu()`; `engine` "transformer-engine": the model of `tiny_model` on a GPU."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    stand_in_for_cuda_calls_on_cpu()
    if not dist.is_initialized():
        init_gloo(rank, world, store_path)
    from megatron.bridge.training.initialize import _initialize_distributed, init_rerun_state
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.state import GlobalState
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    cfg = bridge_config(tp, cp, world, pp, vpp, **overrides)
    pg_collection = _initialize_distributed(cfg.model, cfg.dist, 1, None, None)
    init_rerun_state(cfg.rerun_state_machine)
    init_num_microbatches_calculator(rank, None, cfg.train.global_batch_size, 1, cfg.data_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    state = GlobalState()
    state.cfg = cfg
    chunks = [tiny_model(cfg, v, engine) for v in range(vpp)] if vpp else [tiny_model(cfg, engine=engine)]
    model = [  # as Megatron-LM and Bridge wrap model chunks: buckets for the first chunk only
        DistributedDataParallel(config=cfg.model, ddp_config=cfg.ddp, module=chunk, pg_collection=pg_collection,
                                disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    cfg.optimizer.timers = state.timers
    optimizer, scheduler = setup_optimizer(cfg.optimizer, cfg.scheduler, model, use_gloo_process_groups=False,
                                           pg_collection=pg_collection,
                                           optimizer_config_override_provider=cfg.optimizer_config_override_provider)
    # As Bridge's setup does: the schedule finalises (all-reduces and scales) the grads over DP x CP.
    cfg.model.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)
    cfg.model.grad_scale_func = optimizer.scale_loss
    return cfg, state, model, optimizer, scheduler, pg_collection, P2PCommunicator(pp_group=pg_collection.pp, config=cfg.model)


def forward_step(state):
    """Bridge's own GPT forward step, bound to the state as Bridge's train loop binds it."""
    from megatron.bridge.training.gpt_step import forward_step as bridge_forward_step

    return partial(bridge_forward_step, state)


def unit_record(unit) -> dict:
    """What a test compares of one planned unit on this rank."""
    return {
        "sample_ids": list(unit.sample_ids), "tokens": unit.token_fields["tokens"].tolist(),
        "positions": unit.token_fields["position_ids"].tolist(), "cp_size": unit.local_cp_size,
        "cp_group": dist.get_process_group_ranks(unit.cp_group) if unit.cp_group is not None else [dist.get_rank()],
        "cp_rank": unit.cp_rank, "cu_seqlens": unit.cu_seqlens.tolist(), "cu_seqlens_padded": unit.cu_seqlens_padded.tolist(),
    }


def params_record(params) -> dict | None:
    """What a test compares of the PackedSeqParams a forward pass was given."""
    if params is None:
        return None
    return {
        "cp_group": dist.get_process_group_ranks(params.cp_group) if params.cp_group is not None else [dist.get_rank()],
        "local_cp_size": params.local_cp_size, "cu_seqlens_q": params.cu_seqlens_q.tolist(),
        "cu_seqlens_q_padded": params.cu_seqlens_q_padded.tolist(),
    }


def stop_planner(pid: int, port: int) -> None:
    """Kills the planner's session and returns once its port refuses connections."""
    import socket

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except OSError:
            return


def full_batch(samples: list[dict[str, torch.Tensor]]):
    """The oracle: the whole step as one GlobalBatch (what every rank would hold without routing)."""
    from trainer_client.plans.batch import GlobalBatch, JaggedField

    lengths = tuple(int(s["tokens"].shape[0]) for s in samples)
    starts = tuple(int(x) for x in torch.tensor((0, *lengths[:-1])).cumsum(0))
    fields = {name: JaggedField(torch.cat([s[name] for s in samples]), starts) for name in samples[0]}
    return GlobalBatch(lengths, fields, {})
