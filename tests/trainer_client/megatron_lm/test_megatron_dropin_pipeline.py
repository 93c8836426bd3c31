"""The Megatron-LM drop-in (`wrap_data_iterator`) with attention, without and under pipeline
parallelism: four gloo ranks DP2 x CP2 (`forward_backward_no_pipelining`), eight ranks DP2 x CP2 x
PP2, a real planner on loopback, Megatron-Core's own schedules
(`forward_backward_pipelining_without_interleaving`, and with two virtual stages
`forward_backward_pipelining_with_interleaving`), the attention model with RoPE
(tests/support/attention_model.py), and each micro-batch read by Megatron-Core's own
`get_batch_on_this_rank_for_sequence_packing` (tests/support/dropin_attention.py).

Each step, on every stage:
- the drop-in's answer equals Megatron-Core's own `wrap_data_iterator` on the same global batch:
  the micro-batch count, the sums of lengths, and for each (virtual) stage the fields and the
  packed micro-batches, bitwise;
- the loss, its token count and every parameter's gradient (summed over DP x CP, as Megatron-Core
  reduces them) equal the same pipeline run over each whole sample alone at CP1: every sample is
  trained exactly once, with the right CP group, chunks and positions;
- each stage's DPxCP group asked the planner once (the design: docs/megatron-lm.md, "Pipeline
  parallelism"): one rank of each stage got the step's plan from the service and handed it to the
  others, every rank of both stages trains that one plan, and the planner answered one request per
  stage, and one more for a call the asking rank sent again (a busy machine's hedge).

With the contiguous layout (the model's cp_partition_mode; static CP1, DP4 with the dynamic groups),
Megatron-Core cuts contiguous shards and converts them around attention. With MTP (one layer, on the
last stage as upstream places it), the last stage keeps all four fields.
With MoE (expert parallel 2), expert gradients are summed over the expert-data-parallel group.
Stages that read different data refuse the step on every rank, naming it and the stages."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks
from tests.support.reliability_support import assert_requests_of_plans, client_counts, sample_value
from tests.planner_server.test_planner_metrics import scrape

pytestmark = pytest.mark.attention  # CI prints these tests' time (tests/conftest.py)

RANKS_PER_STAGE = 4  # DP2 x CP2
STEPS = 2
JOB = "pipeline-dropin-{case}"

CASES = {
    "pp1": dict(pp=1, vpp=None, mtp=None, experts=None),
    # The contiguous layout (static CP1, as upstream allows it for standard attention: DP4 with the
    # dynamic groups; Megatron-Core converts the shards to zigzag around attention).
    "pp1-contiguous": dict(pp=1, vpp=None, mtp=None, experts=None, layout="contiguous"),
    "pp2": dict(pp=2, vpp=None, mtp=None, experts=None),
    "pp2-vpp2": dict(pp=2, vpp=2, mtp=None, experts=None),
    "pp2-mtp": dict(pp=2, vpp=None, mtp=1, experts=None),
    # MoE: 4 experts, Megatron-Core's alltoall dispatcher, expert parallel 2 (tests/support/moe_on_cpu.py).
    "pp2-moe-ep2": dict(pp=2, vpp=None, mtp=None, experts=4),
}
EXPERT_PARALLEL = 2


def _models(case: dict):
    from megatron.core import parallel_state

    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model

    vpp = case["vpp"]
    overrides = [("pipeline_model_parallel_size", case["pp"]), ("variable_seq_lengths", True), ("calculate_per_token_loss", True)]
    if vpp:
        overrides += [("virtual_pipeline_model_parallel_size", vpp), ("overlap_p2p_comm", True), ("batch_p2p_comm", False),
                      ("microbatch_group_size_per_vp_stage", 2)]
    contiguous = case.get("layout") == "contiguous"
    cfg = AttentionModelConfig(num_layers=2 * (vpp or 1), context_parallel_size=1 if contiguous else 2, mtp_num_layers=case["mtp"],
                               cp_partition_mode=case.get("layout", "zigzag"),
                               num_moe_experts=case["experts"], transformer_overrides=tuple(overrides))
    models = []
    for v in range(vpp or 1):
        kwargs = {"vp_stage": v} if vpp else {}
        models.append(attention_gpt_model(
            cfg, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not vpp, vp_stage=v if vpp else None),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not vpp, vp_stage=v if vpp else None),
            **kwargs))
    return models


def _materialized(iterators, count: int, vpp):
    """The drop-in's iterator(s) read out (count micro-batches each), as lists."""
    if vpp:
        return [[next(it) for _ in range(count)] for it in iterators]
    return [[next(iterators) for _ in range(count)]]


def _pipeline_dropin_rank(name: str, endpoint: str, rank: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.datasets.data_schedule import wrap_data_iterator as upstream_wrap_data_iterator

    from tests.support.attention_parity import example_samples  # noqa: F401 - imported before the ranks fork
    from tests.support.attention_pipeline import run_pipeline, stand_in_for_pipeline_calls_on_cpu, whole_sample_shards, _forward_step
    from tests.support.dropin_attention import (SAMPLES_PER_DP_RANK, dp_rank_items, expert_sums, grad_errors, packed_forward_step, packing_config,
                                        same_micro_batches, stand_in_for_te_partitioning_on_cpu, step_samples)
    from tests.support.megatron_init import parallel_state_cp_group
    from tests.support.moe_on_cpu import stand_in_for_moe_calls_on_cpu
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator
    from trainer_client.megatron_lm.packing import _wrappers

    case = CASES[name]
    vpp = case["vpp"]
    stand_in_for_pipeline_calls_on_cpu()
    stand_in_for_te_partitioning_on_cpu()
    stand_in_for_moe_calls_on_cpu()
    experts = EXPERT_PARALLEL if case["experts"] else 1
    static_cp = 1 if case.get("layout") == "contiguous" else 2
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=case["pp"], context_parallel_size=static_cp, expert_model_parallel_size=experts,
                                             virtual_pipeline_model_parallel_size=vpp, dynamic_context_parallel=True)
    models = _models(case)
    config = packing_config(models[0].config)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    ours_source = iter(dp_rank_items(STEPS, dp_rank, dp_size))
    theirs_source = iter(dp_rank_items(STEPS, dp_rank, dp_size))
    ours_in = [ours_source] * vpp if vpp else ours_source
    theirs_in = [theirs_source] * vpp if vpp else theirs_source
    planner = {"planner_endpoint": endpoint, "tls": False, "deadline_seconds": 30.0, "job": JOB.format(case=name),
               "fallback_cooldown_seconds": 0.0}
    steps = []
    with closing_wrapped():
        for step in range(STEPS):
            ours = wrap_data_iterator(ours_in, config, SAMPLES_PER_DP_RANK, planner=planner)
            theirs = upstream_wrap_data_iterator(theirs_in, config, SAMPLES_PER_DP_RANK)
            count = ours[1]
            mine, upstream = _materialized(ours[0], count, vpp), _materialized(theirs[0], theirs[1], vpp)
            problems = [] if ours[1:] == theirs[1:] else [f"count and sums {ours[1:]} != upstream {theirs[1:]}"]
            problems += [f"virtual stage {v}: {p}" for v, (a, b) in enumerate(zip(mine, upstream)) for p in same_micro_batches(a, b)]
            planned = last_planned_step(ours_in)
            fields = [sorted(micro_batches[0]) if micro_batches else [] for micro_batches in mine]  # before the model reads them
            loss, tokens, grads = run_pipeline(models, [iter(m) for m in mine], count, packed_forward_step(config, vpp))
            samples = step_samples(step, dp_size)
            reference = whole_sample_shards(samples, parallel_state_cp_group(1))
            want_loss, want_tokens, want_grads = run_pipeline(models, [iter(list(reference)) for _ in models], len(reference), _forward_step)
            summed = torch.tensor([loss, tokens])
            dist.all_reduce(summed, group=dp_cp)
            steps.append({
                "problems": problems, "count": count, "loss": float(summed[0]), "tokens": float(summed[1]),
                "reference": want_loss, "reference_tokens": want_tokens, "grad_errors": grad_errors(grads, want_grads, dp_cp, expert_sums(models, experts)),
                "params": len(want_grads), "source": planned.source, "plan_id": planned.plan.plan_id,
                "sample_ids": sorted({i for mb in planned.sample_id_groups for ids in mb for i in ids}),
                "samples": len(samples), "fields": fields,
            })
        counts = client_counts(_wrappers.find(ours_in).planner.client.metrics)
    return {"stage": stage, "dp_rank": dp_rank, "steps": steps, **counts}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_stages_train_the_planned_steps_as_whole_samples_and_as_upstream_packs_them(tmp_path, planner, name):
    require_dynamic_build()
    job = JOB.format(case=name)
    before = sample_value(scrape(planner.metrics_url), "batch_planner_requests_total", scheduler="dynamic_cp", code="OK", training_job=job) or 0
    pp, vpp, mtp = CASES[name]["pp"], CASES[name]["vpp"], CASES[name]["mtp"]
    per_rank = run_attention_ranks(partial(_pipeline_dropin_rank, name, planner.address), RANKS_PER_STAGE * pp, tmp_path)
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    assert sorted(r["stage"] for r in per_rank) == sorted(list(range(pp)) * RANKS_PER_STAGE)
    last = pp - 1
    for r in per_rank:
        assert len(r["steps"]) == STEPS, r
        for step in r["steps"]:
            assert step["problems"] == [], (r["stage"], step["problems"])
            assert step["grad_errors"] == [] and step["params"] > 0, (r["stage"], step["grad_errors"])
            assert step["sample_ids"] == list(range(step["samples"])), step  # every sample planned, once per micro-batch group
            assert step["source"] in ("service", None), step  # None: a rank that was handed the plan
            if r["stage"] == last:  # the last stage reports the loss
                assert step["loss"] == pytest.approx(step["reference"], rel=1e-5), step
                assert step["tokens"] == step["reference_tokens"] > 0, step
            # The fields each (virtual) stage reads, as upstream keeps them.
            keeps_all = mtp and r["stage"] == last
            if vpp:
                assert len(step["fields"]) == vpp
            has = {k for fields in step["fields"] for k in fields}
            assert ("tokens" in has) == (r["stage"] == 0 or bool(keeps_all)), (r["stage"], step["fields"])
            assert ("labels" in has) == (r["stage"] == last), (r["stage"], step["fields"])
    # Each stage's DPxCP group asked once a step: one rank of the stage got the plan from the service
    # (the client's 30 s deadline: a busy machine's slow answer is waited for, never planned in
    # process), the others were handed it, and every rank of every stage trains that one plan.
    for step in range(STEPS):
        assert len({r["steps"][step]["plan_id"] for r in per_rank}) == 1, (step, [r["steps"][step]["plan_id"] for r in per_rank])
        for stage in range(pp):
            sources = sorted(str(r["steps"][step]["source"]) for r in per_rank if r["stage"] == stage)
            assert sources == ["None"] * (RANKS_PER_STAGE - 1) + ["service"], (stage, step, sources)
    assert sum(r["service_plans"] for r in per_rank) == pp * STEPS, [r["service_plans"] for r in per_rank]  # no plan asked for and not used
    # The planner answered one request per stage and step, plus one for each call sent again.
    after = sample_value(scrape(planner.metrics_url), "batch_planner_requests_total", scheduler="dynamic_cp", code="OK", training_job=job)
    assert_requests_of_plans(after - before, pp * STEPS, sum(r["sent_again"] for r in per_rank))


def _disagreeing_stages_rank(rank: int) -> dict:
    """PP2 x CP2 on 4 ranks, planning in-process: at step 1, stage 1's iterator yields other samples
    than stage 0's."""
    from megatron.core import parallel_state

    from tests.support.dropin_attention import SAMPLES_PER_DP_RANK, dp_rank_items, packing_config
    from tests.support.attention_model import AttentionModelConfig, transformer_config
    from trainer_client.megatron_lm import closing_wrapped, wrap_data_iterator

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, context_parallel_size=2, dynamic_context_parallel=True)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    config = packing_config(transformer_config(AttentionModelConfig(
        context_parallel_size=2, transformer_overrides=(("calculate_per_token_loss", True),))))
    config.max_seqlen_per_dp_cp_rank = 64  # DPxCP 2: room for the longest sample
    items = dp_rank_items(2, 0, 1)
    if stage == 1:
        items[SAMPLES_PER_DP_RANK:] = list(reversed(dp_rank_items(3, 0, 1)[2 * SAMPLES_PER_DP_RANK:]))
    data = iter(items)
    outcomes = []
    with closing_wrapped():
        for _ in range(2):
            try:
                outcomes.append(wrap_data_iterator(data, config, SAMPLES_PER_DP_RANK, planner={})[1])
            except Exception as error:  # noqa: BLE001 - the test compares what every rank raised
                outcomes.append(f"{type(error).__name__}: {error}")
                break
    return {"stage": stage, "outcomes": outcomes}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_pipeline_stages_that_hold_different_plans_refuse_the_step_on_every_rank(tmp_path):
    require_dynamic_build()
    per_rank = run_attention_ranks(_disagreeing_stages_rank, 4, tmp_path)
    assert all("raised" not in r for r in per_rank), per_rank
    assert all(len(r["outcomes"]) == 2 for r in per_rank), per_rank
    first, second = {r["outcomes"][0] for r in per_rank}, {r["outcomes"][1] for r in per_rank}
    assert len(first) == 1 and isinstance(first.pop(), int), per_rank  # step 0: the same data, one plan
    assert len(second) == 1, per_rank  # every rank raises the same error
    error = second.pop()
    assert error.startswith("PlanMismatchError: the pipeline stages hold different plans for this step (step 1): "), error
    assert "pipeline stage 0: " in error and "pipeline stage 1: " in error, error
