"""The verl drop-in's micro-batches through a model whose tokens interact, fed as verl's Megatron
engine feeds it, on 4 gloo ranks (DP2 x CP2, the dev build's dynamic-CP groups) with a real planner
on loopback:

- each rank's micro-batches come from `trainer_client.verl.DynamicCPScheduler.schedule` (plans
  served by the planner), with long samples, so that CP groups of several sizes mix in a step;
- each micro-batch's tokens, labels and loss mask are packed and sharded by verl's own
  `preprocess_thd_engine` (verl/models/mcore/util.py, what verl's engine forward calls) with the
  micro-batch's `local_cp_size`: verl takes the CP group from parallel_state's dynamic-CP groups and
  puts it in `packed_seq_params.cp_group`;
- the model is tests/attention_model.py's: Megatron-Core's SelfAttention with RoPE, core attention
  the CPU stand-in for Transformer Engine's THD/CP attention.

On the zigzag and the contiguous layout, the step's loss, every real token's loss (each reported by
one rank only: every sample trained exactly once) and every parameter's gradient summed over the
ranks equal a single-process run over the whole samples. A plan whose CP groups are not the ranks
that share a sample list, a wrong `local_cp_size` or a sample on the wrong rank changes them."""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.attention_ranks import require_dynamic_build, run_attention_ranks

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 4
MAX_SEQLEN = 64  # tokens per DPxCP rank: the long samples below need a CP2 group
LENGTHS = {
    "zigzag": (150, 17, 90, 5, 30, 9, 70, 3, 40, 12, 26, 100),
    # verl's contiguous layout pads each sequence to a multiple of the CP size only (it is meant for
    # attention variants that read a contiguous split, such as DeepSeek-V4's), while Megatron-Core's
    # standard attention converts contiguous input to zigzag and refuses a sequence whose padded
    # length is not a multiple of 2 x CP ("All packed sequence lengths must be divisible by
    # 2 * cp_size ..."). Lengths that are multiples of 8 need no padding for CP up to 4.
    "contiguous": (152, 16, 88, 8, 32, 8, 72, 8, 40, 16, 24, 96),
}


def verl_preprocess_thd_engine():
    """verl's `preprocess_thd_engine`, loaded from verl/models/mcore/util.py itself. Importing it as
    `verl.models.mcore.util` would run the package's `__init__`, which applies verl's Megatron
    patches and parses Megatron-Core's version with `packaging`; the dev build's version
    (`0.19.0+dev.<commit>+<commit>`) is not a PEP 440 version, so that import fails here. The
    module itself imports only Megatron-Core and verl.utils."""
    import verl

    path = Path(verl.__file__).parent / "models" / "mcore" / "util.py"
    spec = importlib.util.spec_from_file_location("verl_mcore_util_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.preprocess_thd_engine


def _mini_batch(samples):
    """The replicated mini-batch verl's engine schedules: jagged tokens, labels, loss mask, and each
    token's global id plus one (0 on the padding rows verl's preprocessing adds)."""
    from tensordict import TensorDict

    from tests.attention_parity import token_offsets

    offsets = token_offsets(samples)

    def jagged(parts):
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)

    return TensorDict(
        {
            "input_ids": jagged([s.tokens for s in samples]),
            "labels": jagged([s.labels for s in samples]),
            "loss_mask": jagged([s.loss_mask for s in samples]),
            "token_ids_plus_one": jagged([torch.arange(len(s)) + offsets[i] + 1 for i, s in enumerate(samples)]),
        },
        batch_size=[len(samples)],
    )


def _verl_shard(preprocess, micro_batch, layout: str):
    """This rank's RankShard of one micro-batch, every field cut by verl's `preprocess_thd_engine`
    as verl's engine cuts the tokens (and, with MTP, the labels and loss mask)."""
    from verl.utils import tensordict_utils as tu

    from tests.attention_parity import RankShard

    local_cp_size = tu.get_non_tensor_data(micro_batch, "local_cp_size", None)

    def cut(key):
        rows, params, positions = preprocess(micro_batch[key], pre_process=True, local_cp_size=local_cp_size, cp_layout=layout)
        return rows[0], params, positions[0]

    tokens, params, positions = cut("input_ids")
    return RankShard(tokens, cut("labels")[0], cut("loss_mask")[0], positions, params, cut("token_ids_plus_one")[0] - 1), local_cp_size


def _model_rank(layout: str, rank: int) -> dict:
    from megatron.core import parallel_state as mpu

    from tests.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.attention_parity import example_samples, packed_loss_and_grads, parity_errors, reference_loss_and_grads
    from tests.megatron_init import initialize_dpxcp_groups, parallel_state_cp_group
    from trainer_client.verl import DynamicCPScheduler, close_planners

    initialize_dpxcp_groups(2)
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    samples = example_samples(LENGTHS[layout])
    # contiguous: static CP1, as upstream allows contiguous for standard attention (attention_model.py)
    model = attention_gpt_model(AttentionModelConfig(cp_partition_mode=layout, context_parallel_size=2 if layout == "zigzag" else 1))
    reference = reference_loss_and_grads(model, samples, parallel_state_cp_group(1))
    scheduler = DynamicCPScheduler(MAX_SEQLEN, mpu.get_data_parallel_world_size(), mpu.get_context_parallel_world_size())
    micro_batches = scheduler.schedule(_mini_batch(samples), group, tp_size=1, cp_layout=layout)
    preprocess = verl_preprocess_thd_engine()
    shards, cp_sizes = zip(*(_verl_shard(preprocess, mb, layout) for mb in micro_batches)) if micro_batches else ((), ())
    got = packed_loss_and_grads(model, list(shards), samples)
    close_planners()
    return {"loss": got.loss, "reference": reference.loss, "errors": parity_errors(got, reference, samples), "cp_sizes": list(cp_sizes)}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_verl_shards_of_the_dropins_micro_batches_train_as_whole_samples(layout, tmp_path, planner, monkeypatch):
    require_dynamic_build()
    monkeypatch.setenv("BATCH_PLANNER_ENDPOINT", planner.address)
    monkeypatch.delenv("BATCH_PLANNER_CONFIG", raising=False)
    per_rank = run_attention_ranks(partial(_model_rank, layout), WORLD, tmp_path)
    for rank, record in enumerate(per_rank):
        assert record["errors"] == [], (layout, rank, record)
        assert record["loss"] == pytest.approx(record["reference"], rel=1e-5), (layout, rank, record)
    sizes = {size for record in per_rank for size in record["cp_sizes"]}
    assert len(sizes) >= 2 and max(sizes) > 1, f"the step should mix CP group sizes to test anything; it has {sorted(sizes)}"
