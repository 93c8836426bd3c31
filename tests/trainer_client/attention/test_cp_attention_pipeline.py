"""The attention stand-in (tests/support/cp_attention_standin.py) under pipeline parallelism: four gloo
ranks, PP2 x CP2 (dynamic-CP groups), through Megatron-Core's own
`forward_backward_pipelining_without_interleaving` and, with two virtual stages,
`forward_backward_pipelining_with_interleaving`, with variable sequence lengths. Packed CP2
micro-batches give, on every stage, the loss and the gradients of the same pipeline run over each
whole sample alone at CP1 (tests/support/attention_pipeline.py).

The interleaved case runs with Megatron-LM's own p2p settings for virtual stages
(overlap_p2p_comm=True, batch_p2p_comm=False): with batch_p2p_comm=True and PP2, the shape
exchange of a send to the previous and to the next stage (one and the same rank) pairs the wrong
messages once the micro-batches' token counts differ, and backward fails on a shape mismatch."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

WORLD = 4
MICRO_BATCHES = ([4, 0], [2, 1], [3, 5], [6, 7])  # packed CP2 micro-batches (ids of attention_parity.example_samples())


def _pipeline_rank(virtual_stages: int, rank: int) -> dict:
    from megatron.core import parallel_state

    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import example_samples, shard
    from tests.support.attention_pipeline import pipeline_loss_and_grads, stand_in_for_pipeline_calls_on_cpu, whole_sample_shards
    from tests.support.megatron_init import parallel_state_cp_group

    stand_in_for_pipeline_calls_on_cpu()
    vpp = virtual_stages if virtual_stages > 1 else None
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, context_parallel_size=2, virtual_pipeline_model_parallel_size=vpp,
        dynamic_context_parallel=True,
    )
    overrides = [("pipeline_model_parallel_size", 2), ("variable_seq_lengths", True), ("calculate_per_token_loss", True)]
    if vpp:
        overrides += [("virtual_pipeline_model_parallel_size", vpp), ("overlap_p2p_comm", True), ("batch_p2p_comm", False)]
    cfg = AttentionModelConfig(num_layers=2 * virtual_stages, context_parallel_size=2, transformer_overrides=tuple(overrides))
    models = []
    for v in range(virtual_stages):
        kwargs = {"vp_stage": v} if vpp else {}
        models.append(attention_gpt_model(
            cfg, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not vpp, vp_stage=v if vpp else None),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not vpp, vp_stage=v if vpp else None),
            **kwargs))
    data = example_samples()
    reference_loss, reference_grads = pipeline_loss_and_grads(models, whole_sample_shards(data, parallel_state_cp_group(1)))
    cp_group = parallel_state_cp_group(2)
    loss, grads = pipeline_loss_and_grads(models, [shard(data, ids, cp_group) for ids in MICRO_BATCHES])
    summed = torch.tensor([loss])
    dist.all_reduce(summed, group=cp_group)
    errors = []
    for name, want in reference_grads.items():
        got = grads[name].clone()
        dist.all_reduce(got, group=cp_group)  # Megatron-Core reduces gradients over DP x CP
        scale = float(want.abs().max())
        if float((got - want).abs().max()) > 1e-6 + 1e-4 * scale:
            errors.append(f"gradient of {name} differs by {float((got - want).abs().max()):.3g} (largest {scale:.3g})")
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "cp_group": dist.get_process_group_ranks(cp_group), "loss": float(summed), "reference": reference_loss,
        "params": len(reference_grads), "errors": errors,
    }


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("virtual_stages", [1, 2], ids=["pp2-cp2", "pp2-vpp2-cp2"])
def test_packed_cp_micro_batches_through_megatron_pipeline_schedules_equal_whole_samples(tmp_path, virtual_stages):
    require_dynamic_build()
    per_rank = run_attention_ranks(partial(_pipeline_rank, virtual_stages), WORLD, tmp_path)
    assert all("raised" not in r for r in per_rank), per_rank
    assert sorted(r["stage"] for r in per_rank) == [0, 0, 1, 1], per_rank
    for r in per_rank:
        assert r["errors"] == [] and r["params"] > 0, r
        if r["stage"] == 1:  # the last stage reports the loss
            assert r["loss"] == pytest.approx(r["reference"], rel=1e-5), r
            assert r["reference"] > 0, r
