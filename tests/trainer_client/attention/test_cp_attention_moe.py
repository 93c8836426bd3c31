"""A tiny MoE model (4 experts, Megatron-Core's alltoall token dispatcher, expert parallel 2) with
the attention stand-in, on two gloo ranks that are both one CP2 group and one EP2 group: packed
micro-batches mixing CP2 and CP1 give the loss, each real token's loss and every gradient of the
whole samples run one at a time (tests/support/attention_parity.py). CPU stand-ins for the dispatcher:
tests/support/moe_on_cpu.py.

The reference runs every sample on both ranks (the experts' all-to-all needs both in every
forward), so each expert sees every token twice there: its reference gradient is halved. In the
packed run the expert gradients are not summed over ranks (expert-data-parallel size 1)."""

from __future__ import annotations

import pytest

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 2
# micro-batches: each {CP group's ranks: ids of attention_parity.example_samples()}
MICRO_BATCHES = [{(0, 1): [4, 0]}, {(0,): [2, 1], (1,): [3]}, {(0, 1): [5, 6, 7]}]


def _moe_rank(rank: int) -> dict:
    from megatron.core import parallel_state

    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import example_samples, packed_loss_and_grads, parity_errors, reference_loss_and_grads, shard
    from tests.support.megatron_init import parallel_state_cp_group
    from tests.support.moe_on_cpu import stand_in_for_moe_calls_on_cpu

    stand_in_for_moe_calls_on_cpu()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, context_parallel_size=2, dynamic_context_parallel=True)
    model = attention_gpt_model(AttentionModelConfig(
        num_moe_experts=4, context_parallel_size=2, transformer_overrides=(("variable_seq_lengths", True),)))
    experts = {n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False}
    data = example_samples()
    reference = reference_loss_and_grads(model, data, parallel_state_cp_group(1))
    for name in experts:
        reference.grads[name] = reference.grads[name] / 2
    shards = [shard(data, ids, parallel_state_cp_group(len(ranks))) for mb in MICRO_BATCHES for ranks, ids in mb.items() if rank in ranks]
    got = packed_loss_and_grads(model, shards, data)
    return {"experts": len(experts), "loss": got.loss, "reference": reference.loss, "errors": parity_errors(got, reference, data)}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_moe_with_expert_parallel_2_on_packed_cp_micro_batches_equals_whole_samples(tmp_path):
    require_dynamic_build()
    for rank, r in enumerate(run_attention_ranks(_moe_rank, WORLD, tmp_path)):
        assert "raised" not in r, (rank, r)
        assert r["experts"] > 0 and r["errors"] == [], (rank, r)
        assert r["loss"] == pytest.approx(r["reference"], rel=1e-5), (rank, r)
