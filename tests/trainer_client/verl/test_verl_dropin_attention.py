"""The verl drop-in's micro-batches through a model whose tokens interact, fed as verl's Megatron
engine feeds it, on 4 gloo ranks (DP2 x CP2, the dev build's dynamic-CP groups) with a real planner
on loopback:

- each rank's micro-batches come from `trainer_client.verl.DynamicCPScheduler.schedule` (plans
  served by the planner), with long samples, so that CP groups of several sizes mix in a step;
- each micro-batch's tokens, labels and loss mask are packed and sharded by verl's own
  `preprocess_thd_engine` (verl/models/mcore/util.py, what verl's engine forward calls) with the
  micro-batch's `local_cp_size`: verl takes the CP group from parallel_state's dynamic-CP groups and
  puts it in `packed_seq_params.cp_group`;
- the model is tests/support/attention_model.py's: Megatron-Core's SelfAttention with RoPE, core attention
  the CPU stand-in for Transformer Engine's THD/CP attention.

On the zigzag layout, with lengths that are not multiples of 2 x CP (every CP group pads), the
step's loss, every real token's loss (each reported by one rank only: every sample trained exactly
once) and every parameter's gradient summed over the ranks equal a single-process run over the whole
samples; each micro-batch's padding mask and local token count (what verl's engine hands MoE's router
and its loss) name exactly the rows verl's preprocessing pads on that rank. A plan whose CP groups
are not the ranks that share a sample list, a wrong `local_cp_size`, a sample on the wrong rank or a
neighbour's padding mask fails it.

verl's contiguous layout pads each sequence to a multiple of CP x TP only: verl's engine picks it for
attention that reads contiguous shards itself (DeepSeek-V4's, not run here). Megatron-Core's standard
attention converts contiguous input to zigzag and refuses such a sequence; the contiguous case shows
that refusal with the same lengths, from the route check Megatron-Core's conversion runs first
(`build_thd_cp_partition_route`): no silently wrong step."""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 4
MAX_SEQLEN = 64  # tokens per DPxCP rank: the long samples below need a CP2 group
LENGTHS = (150, 17, 90, 5, 30, 9, 70, 3, 40, 13, 26, 101)
"""None a multiple of 4: every CP group pads (MAX_SEQLEN makes CP1, CP2 and CP4 groups)."""


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

    from tests.support.attention_parity import token_offsets

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
    from verl.utils.dynamic_cp_scheduler import DCP_LOCAL_NUM_TOKENS, DCP_PADDING_MASK

    from tests.support.attention_parity import RankShard

    local_cp_size = tu.get_non_tensor_data(micro_batch, "local_cp_size", None)

    def cut(key):
        rows, params, positions = preprocess(micro_batch[key], pre_process=True, local_cp_size=local_cp_size, cp_layout=layout)
        return rows[0], params, positions[0]

    tokens, params, positions = cut("input_ids")
    token_ids = cut("token_ids_plus_one")[0] - 1
    # The drop-in's padding mask and token count, against the rows verl's preprocessing pads here.
    mask = tu.get_non_tensor_data(micro_batch, DCP_PADDING_MASK, None)
    count = tu.get_non_tensor_data(micro_batch, DCP_LOCAL_NUM_TOKENS, None)
    mask_ok = mask is not None and mask.tolist() == (token_ids < 0).tolist() and count == int((token_ids >= 0).sum())
    return RankShard(tokens, cut("labels")[0], cut("loss_mask")[0], positions, params, token_ids), local_cp_size, mask_ok


def _model_rank(layout: str, rank: int) -> dict:
    from megatron.core import parallel_state as mpu

    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import example_samples, packed_loss_and_grads, parity_errors, reference_loss_and_grads
    from tests.support.megatron_init import initialize_dpxcp_groups, parallel_state_cp_group
    from trainer_client.verl import DynamicCPScheduler, closing_planners

    initialize_dpxcp_groups(2)
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    samples = example_samples(LENGTHS)
    # contiguous: static CP1, as upstream allows contiguous for standard attention (attention_model.py)
    model = attention_gpt_model(AttentionModelConfig(cp_partition_mode=layout, context_parallel_size=2 if layout == "zigzag" else 1))
    reference = reference_loss_and_grads(model, samples, parallel_state_cp_group(1))
    scheduler = DynamicCPScheduler(MAX_SEQLEN, mpu.get_data_parallel_world_size(), mpu.get_context_parallel_world_size())
    with closing_planners():
        micro_batches = scheduler.schedule(_mini_batch(samples), group, tp_size=1, cp_layout=layout)
    preprocess = verl_preprocess_thd_engine()
    shards, cp_sizes, masks_ok = zip(*(_verl_shard(preprocess, mb, layout) for mb in micro_batches)) if micro_batches else ((), (), ())
    padded = sum(int((s.token_ids < 0).sum()) for s, size in zip(shards, cp_sizes) if size > 1)
    if layout == "contiguous":  # what the model's attention would do first: Megatron-Core's own route check, no collective
        from megatron.core.context_parallel_layout.routes import build_thd_cp_partition_route

        refused, unaligned = [], []  # per CP > 1 shard: Megatron-Core's refusal, and whether a sequence is not a multiple of 2 x CP
        for shard, size in zip(shards, cp_sizes):
            if size > 1:
                bounds = shard.packed_seq_params.cu_seqlens_q_padded.tolist()
                unaligned.append(any((b - a) % (2 * size) for a, b in zip(bounds, bounds[1:])))
                try:
                    build_thd_cp_partition_route(shard.packed_seq_params.cu_seqlens_q_padded, size, dist.get_rank(shard.packed_seq_params.cp_group))
                    refused.append(None)
                except ValueError as error:
                    refused.append(str(error))
        return {"refused": refused, "unaligned": unaligned, "cp_sizes": list(cp_sizes), "masks_ok": all(masks_ok), "padded_in_groups": padded}
    got = packed_loss_and_grads(model, list(shards), samples)
    return {"loss": got.loss, "reference": reference.loss, "errors": parity_errors(got, reference, samples), "cp_sizes": list(cp_sizes),
            "masks_ok": all(masks_ok), "padded_in_groups": padded}


@pytest.fixture()
def ranks_of(tmp_path, planner, monkeypatch):
    def run(layout: str) -> list[dict]:
        require_dynamic_build()
        monkeypatch.setenv("BATCH_PLANNER_ENDPOINT", planner.address)
        monkeypatch.delenv("BATCH_PLANNER_CONFIG", raising=False)
        folder = tmp_path / layout
        folder.mkdir()
        per_rank = run_attention_ranks(partial(_model_rank, layout), WORLD, folder)
        assert all("raised" not in r for r in per_rank), per_rank
        return per_rank

    return run


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_verl_shards_of_the_dropins_micro_batches_train_as_whole_samples(ranks_of):
    per_rank = ranks_of("zigzag")
    for rank, record in enumerate(per_rank):
        assert record["masks_ok"], (rank, record)
        assert record["errors"] == [], (rank, record)
        assert record["loss"] == pytest.approx(record["reference"], rel=1e-5), (rank, record)
    sizes = {size for record in per_rank for size in record["cp_sizes"]}
    assert len(sizes) >= 2 and max(sizes) > 1, f"the step should mix CP group sizes to test anything; it has {sorted(sizes)}"
    assert sum(r["padded_in_groups"] for r in per_rank) > 0, "no CP group pads: the lengths test nothing"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_verls_contiguous_padding_is_refused_by_megatron_cores_standard_attention(ranks_of):
    per_rank = ranks_of("contiguous")
    assert all(r["masks_ok"] for r in per_rank), per_rank  # the drop-in's masks are verl's padding still
    # Refused exactly where a sequence is not a multiple of 2 x CP, which the real lengths make happen.
    pairs = [(message, unaligned) for r in per_rank for message, unaligned in zip(r["refused"], r["unaligned"])]
    assert any(unaligned for _, unaligned in pairs), per_rank
    assert all((message is not None) == unaligned for message, unaligned in pairs), per_rank
    assert all("divisible by 2 * cp_size" in message for message, _ in pairs if message is not None), per_rank
