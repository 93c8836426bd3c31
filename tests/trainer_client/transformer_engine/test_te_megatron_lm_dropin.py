"""Plans from the Megatron-LM drop-in (`trainer_client.megatron_lm.wrap_data_iterator`, planned
in-process) through Transformer Engine on a GPU: Megatron-Core's GPTModel on its Transformer Engine
layer spec (`TEDotProductAttention`: Transformer Engine's THD/CP kernels and ring) in bf16, each
micro-batch read by Megatron-Core's own `get_batch_on_this_rank_for_sequence_packing` (Transformer
Engine's `thd_get_partitioned_indices` cuts the CP shards) and run by Megatron-Core's own schedules,
several ranks on one GPU over gloo (point-to-point staged through the CPU:
tests/trainer_client/transformer_engine/staged_p2p.py). The same steps as the CPU test
tests/trainer_client/megatron_lm/test_megatron_dropin_pipeline.py runs on the stand-in (tests/support/dropin_attention.py's data:
long and short samples, lengths that are not multiples of 2 x CP, padded by the dataset).

- DP2 x CP2 (4 ranks, `forward_backward_no_pipelining`), and DP2 x CP2 x PP2 (8 ranks,
  `forward_backward_pipelining_without_interleaving`, activations exchanged between the stages);
- a step with CP1 and CP2 units (on the H100 run: the first step CP1, CP2 and CP4, the second CP2 and
  CP4; docs/gpu-benchmark-data/transformer-engine);
- the loss summed over the ranks and every parameter's gradient summed over DP x CP equal the same
  pipeline over each whole sample alone at CP1, within the bf16 tolerance (support.py);
- planted: Transformer Engine's partitioned indices asked for the next rank of the CP group (every
  CP shard rotated by one rank): the gradients miss the tolerance."""

from __future__ import annotations

from functools import partial
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import run_attention_ranks
from tests.trainer_client.transformer_engine.support import DEADLINE_SECONDS, TOLERANCE, record_measurements, require_transformer_engine

pytestmark = [pytest.mark.attention, pytest.mark.timeout(2 * DEADLINE_SECONDS + 60)]  # the fixture runs the ranks twice

RANKS_PER_STAGE = 4  # DP2 x CP2
STEPS = 2
PLANNER = {"scheduler_implementation": "upstream"}  # in-process, Megatron-Core's own code (no compile per rank)


def _models(pp: int, engine: str):
    from megatron.core import parallel_state

    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model

    overrides = (("pipeline_model_parallel_size", pp), ("variable_seq_lengths", True), ("calculate_per_token_loss", True))
    cfg = AttentionModelConfig(engine=engine, hidden_size=128 if engine == "transformer-engine" else 32, num_layers=2,
                               context_parallel_size=2, transformer_overrides=overrides)
    return [attention_gpt_model(cfg, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage())]


def _worst_gradient(got: dict, want: dict, group) -> tuple[float, str | None, float]:
    """The gradients summed over `group` against the reference's: the worst relative L2 difference,
    its parameter, and the worst largest-entry difference (tests/support/attention_parity.worst_differences)."""
    from tests.support.attention_parity import relative_l2

    worst, name_of_worst, largest_entry = 0.0, None, 0.0
    for name, reference in want.items():
        summed = got[name].clone()
        dist.all_reduce(summed, group=group)
        relative = relative_l2(summed, reference)
        if relative > worst:
            worst, name_of_worst = relative, name
        scale = float(reference.abs().max())
        if scale:
            largest_entry = max(largest_entry, float((summed - reference).abs().max()) / scale)
    return worst, name_of_worst, largest_entry


def dropin_rank(pp: int, plants: list[str], engine: str, rank: int) -> dict:
    """One rank: for each plant, STEPS steps of the drop-in's plans and of whole samples (records by plant)."""
    from megatron.core import parallel_state

    from tests.support.attention_pipeline import stand_in_for_pipeline_calls_on_cpu
    from tests.support.dropin_attention import stand_in_for_te_partitioning_on_cpu

    stand_in_for_pipeline_calls_on_cpu()  # each a no-op where CUDA is (the GPU tests)
    stand_in_for_te_partitioning_on_cpu()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=2, dynamic_context_parallel=True)
    from tests.support.attention_parity import Fp32Grads

    models = _models(pp, engine)
    grads = Fp32Grads(models)
    records = {plant: _steps(models, grads, plant) for plant in plants}
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(), "last_stage": parallel_state.is_pipeline_last_stage(), **records}


def _steps(models, grads, plant: str) -> list[dict]:
    from megatron.core import parallel_state
    from megatron.core.datasets import data_schedule_utils

    from tests.support.attention_parity import model_device
    from tests.support.attention_pipeline import _forward_step, run_pipeline, whole_sample_shards
    from tests.support.dropin_attention import SAMPLES_PER_DP_RANK, dp_rank_items, packed_forward_step, packing_config, step_samples
    from tests.support.megatron_init import parallel_state_cp_group
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator

    config = packing_config(models[0].config)
    device = model_device(models[0])
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_stage = parallel_state.is_pipeline_last_stage()
    data = iter(dp_rank_items(STEPS, dp_rank, dp_size))
    partition = data_schedule_utils.get_thd_partitioned_indices
    rotated = (lambda cu, total, cp, r: partition(cu, total, cp, (r + 1) % cp)) if plant == "rotated" else partition
    steps = []
    with closing_wrapped():
        for step in range(STEPS):
            iterator, count, _, _ = wrap_data_iterator(data, config, SAMPLES_PER_DP_RANK, planner=PLANNER)
            planned = last_planned_step(data)
            micro_batches = [next(iterator) for _ in range(count)]
            grads.reset()
            with mock.patch.object(data_schedule_utils, "get_thd_partitioned_indices", rotated):
                loss, tokens, _ = run_pipeline(models, [iter(micro_batches)], count, packed_forward_step(config, None))
            got = grads.read()
            reference = [s.to(device) for s in whole_sample_shards(step_samples(step, dp_size), parallel_state_cp_group(1))]
            grads.reset()
            want_loss, want_tokens, _ = run_pipeline(models, [iter(reference)], len(reference), _forward_step)
            want = grads.read()
            summed = torch.tensor([loss, tokens], device=device)
            dist.all_reduce(summed, group=dp_cp)
            worst, worst_name, largest_entry = _worst_gradient(got, want, dp_cp)
            steps.append({
                "loss": float(summed[0]), "tokens": float(summed[1]), "reference": want_loss, "reference_tokens": want_tokens,
                "loss_difference": abs(float(summed[0]) - want_loss) / abs(want_loss) if last_stage else 0.0,
                "gradients": worst, "worst_gradient": worst_name, "gradients_largest_entry": largest_entry, "params": len(want),
                "cp_sizes": sorted({g.size for mb in planned.plan.micro_batches for g in mb.cp_groups}),
                "micro_batches": count, "source": planned.source,
            })
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each layout's ranks' records: "dp2-cp2" (unplanted and rotated) and "dp2-cp2-pp2" (unplanted)."""
    require_transformer_engine()
    out = {}
    for name, pp, plants in (("dp2-cp2", 1, ["none", "rotated"]), ("dp2-cp2-pp2", 2, ["none"])):
        per_rank = run_attention_ranks(partial(dropin_rank, pp, plants, "transformer-engine"), RANKS_PER_STAGE * pp,
                                       tmp_path_factory.mktemp(name), DEADLINE_SECONDS, on_gpu=True)
        record_measurements(f"megatron_lm_dropin-{name}", per_rank)
        out[name] = per_rank
    return out


@pytest.mark.parametrize("name", ["dp2-cp2", "dp2-cp2-pp2"])
def test_dropin_plans_through_transformer_engine_train_as_whole_samples(runs, name):
    per_rank = runs[name]
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    pp = 2 if name.endswith("pp2") else 1
    assert sorted(r["stage"] for r in per_rank) == sorted(list(range(pp)) * RANKS_PER_STAGE)
    for r in per_rank:
        assert len(r["none"]) == STEPS, r
        assert any({1, 2} <= set(step["cp_sizes"]) for step in r["none"]), r  # a step with CP1 and CP2 units
        for step in r["none"]:
            assert step["params"] > 0 and step["gradients"] <= TOLERANCE, (r["stage"], step)
            if r["last_stage"]:
                assert step["tokens"] == step["reference_tokens"] > 0, step
                assert step["loss_difference"] <= TOLERANCE, step


def test_cp_shards_rotated_by_one_rank_miss_the_tolerance(runs):
    per_rank = runs["dp2-cp2"]
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    for r in per_rank:  # the step's loss sums hundreds of tokens' errors, which partly cancel: the gradients tell
        assert all(step["gradients"] > TOLERANCE for step in r["rotated"]), r
