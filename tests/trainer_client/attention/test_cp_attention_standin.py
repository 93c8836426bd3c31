"""The CPU stand-in for Transformer Engine's THD attention with a CP group
(tests/support/cp_attention_standin.py), on four real gloo ranks with Megatron-Core's parallel_state and
its per-size CP groups: a GPTModel with Megatron-Core's own SelfAttention and RoPE, fed THD shards
cut as Transformer Engine documents them (tests/support/attention_parity.py), gives the loss, each real
token's loss and every parameter's gradient of a single-process run over the whole sequences.

Plans: CP2 and CP4, a micro-batch mixing CP4, CP2 and CP1 groups (dynamic CP), sequence lengths
that need padding to 2 x CP; the zigzag layout, and the contiguous one through Megatron-Core's own
conversion (config.cp_partition_mode="contiguous", dev build); RoPE, and learned absolute positions
(which read position_ids); one MTP layer (its loss sum and token count too; gradients with
mtp_loss_scaling_factor=0, attention_model.py says why). A contiguous shard reaching the stand-in,
as Transformer Engine would silently read it as zigzag, is refused."""

from __future__ import annotations

from functools import partial

import pytest
import torch.distributed as dist

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 4
MIXED = [{(0, 1, 2, 3): [4]}, {(0, 1): [2, 1], (2,): [0, 3], (3,): [5]}, {(2, 3): [6, 7]}]
# (name, layout, AttentionModelConfig fields, micro-batches: each {CP group's ranks: ids of attention_parity.example_samples()})
CASES = [
    ("cp2", "zigzag", {}, [{(0, 1): [0, 1], (2, 3): [2]}, {(0, 1): [3, 7], (2, 3): [4, 5, 6]}]),
    ("cp4", "zigzag", {}, [{(0, 1, 2, 3): [4, 0]}, {(0, 1, 2, 3): [2, 1, 3, 5, 6, 7]}]),
    ("mixed", "zigzag", {}, MIXED),
    ("mixed-learned", "zigzag", {"position_embedding_type": "learned_absolute"}, MIXED),
    ("mixed-mtp", "zigzag", {"mtp_num_layers": 1}, MIXED),
    ("contiguous", "contiguous", {}, [{(0, 1, 2, 3): [4, 0]}, {(0, 1): [2, 1], (2, 3): [3, 5, 6, 7]}]),
]


def run_case(layout: str, fields: dict, micro_batches) -> dict:
    """One case on this rank: its shards of every micro-batch, the packed result and the reference."""
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import example_samples, packed_loss_and_grads, parity_errors, reference_loss_and_grads, shard
    from tests.support.megatron_init import parallel_state_cp_group

    rank = dist.get_rank()
    data = example_samples()
    # contiguous: static CP1, as upstream allows contiguous for standard attention (attention_model.py)
    cfg = AttentionModelConfig(cp_partition_mode=layout, context_parallel_size=2 if layout == "zigzag" else 1, **fields)
    model = attention_gpt_model(cfg)
    reference = reference_loss_and_grads(model, data, parallel_state_cp_group(1))
    shards = []
    for mb in micro_batches:
        for ranks, sample_ids in mb.items():
            if rank in ranks:
                group = parallel_state_cp_group(len(ranks))
                assert dist.get_process_group_ranks(group) == list(ranks), (ranks, dist.get_process_group_ranks(group))
                shards.append(shard(data, sample_ids, group, layout))
    got = packed_loss_and_grads(model, shards, data)
    return {"loss": got.loss, "reference": reference.loss, "mtp": got.mtp_losses, "errors": parity_errors(got, reference, data)}


def _standin_rank(names: list[str], rank: int) -> dict:
    from tests.support.megatron_init import initialize_dpxcp_groups

    initialize_dpxcp_groups(context_parallel_size=2)
    results = {}
    for name, layout, fields, micro_batches in CASES:
        if name in names:
            try:
                results[name] = run_case(layout, fields, micro_batches)
            except Exception as error:  # reported by the test with the rank and the case
                raise RuntimeError(f"case {name}: {type(error).__name__}: {error}") from error
    if "refused" in names:
        results["refused"] = _contiguous_shard_on_zigzag_model()
    return results


def _contiguous_shard_on_zigzag_model() -> str:
    """Contiguous shards, marked as such in PackedSeqParams, fed to a model whose config says
    zigzag: Megatron-Core converts nothing, and the stand-in refuses what TE would misread."""
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import example_samples, packed_loss_and_grads, shard
    from tests.support.megatron_init import parallel_state_cp_group

    data = example_samples()
    model = attention_gpt_model(AttentionModelConfig(cp_partition_mode="zigzag", context_parallel_size=2))
    group = parallel_state_cp_group(4)
    try:
        packed_loss_and_grads(model, [shard(data, [4, 0], group, "contiguous")], data)
    except ValueError as error:
        return str(error)
    return "not refused"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("names", [["cp2", "cp4", "mixed"], ["mixed-learned", "mixed-mtp", "contiguous", "refused"]],
                         ids=["zigzag", "positions-mtp-and-layouts"])
def test_packed_cp_forward_and_backward_equal_the_single_process_reference(tmp_path, names):
    require_dynamic_build()
    per_rank = run_attention_ranks(partial(_standin_rank, names), WORLD, tmp_path)
    assert all("raised" not in r for r in per_rank), per_rank
    for name in (n for n in names if n != "refused"):
        for rank, results in enumerate(per_rank):
            r = results[name]
            assert r["errors"] == [], (name, rank, r)
            assert r["loss"] == pytest.approx(r["reference"], rel=1e-5), (name, rank, r)
    if "refused" in names:
        for results in per_rank:
            assert "cp_partition_mode='contiguous'" in results["refused"], results["refused"]
            assert "config.cp_partition_mode='contiguous'" in results["refused"], results["refused"]
