"""The drop-in's single-process parts: planner settings from Megatron's config, packed-sample checks,
the plan in Megatron-Core's shape."""

from __future__ import annotations

import pytest
import torch

from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from tests.dropin_support import megatron_config
from trainer_client.config import ConfigError, PlannerClientConfig
from trainer_client.dropin import check_packed_sample, planner_config_for, sample_id_groups


def test_sizes_and_scheduler_come_from_megatron_and_the_planner_keeps_its_own_settings():
    config = planner_config_for(
        megatron_config(min_dynamic_context_parallel_size=2), SchedulerKind.DYNAMIC_CP, 2,
        {"planner_endpoint": "127.0.0.1:1", "tls": False},
    )
    assert (config.max_seqlen_per_dp_cp_rank, config.context_parallel_size, config.min_cp_size) == (512, 2, 2)
    assert config.scheduler is SchedulerKind.DYNAMIC_CP and config.planner_endpoint == "127.0.0.1:1"
    same = planner_config_for(megatron_config(), SchedulerKind.HYBRID_CP, 2, PlannerClientConfig(
        max_seqlen_per_dp_cp_rank=1, planner_endpoint="127.0.0.1:1", tls=False))
    assert same.max_seqlen_per_dp_cp_rank == 512 and not same.tls


def test_a_size_set_in_both_places_must_agree():
    with pytest.raises(ConfigError, match="context_parallel_size: the planner settings say 4 but Megatron runs 2"):
        planner_config_for(megatron_config(), SchedulerKind.HYBRID_CP, 2, {"context_parallel_size": 4})


def test_settings_file_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "planner.yaml"
    path.write_text("batch_planner:\n  planner_endpoint: 127.0.0.1:5\n  tls: false\n")
    monkeypatch.setenv("BATCH_PLANNER_CONFIG", str(path))
    assert planner_config_for(megatron_config(), SchedulerKind.HYBRID_CP, 2).planner_endpoint == "127.0.0.1:5"


@pytest.mark.parametrize(
    "cu_seqlens, phrase",
    [([1, 5, 10], "must start at 0"), ([0, 6, 4, 10], "decreases at index 2 (6 -> 4)"), ([0, 5, 9], "ends at 9 but field 'tokens' holds 10")],
)
def test_inconsistent_cu_seqlens_are_named(cu_seqlens, phrase):
    sample = {"tokens": torch.arange(10), "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32)}
    assert phrase in check_packed_sample(sample, "packed sample 0")
    assert check_packed_sample({"tokens": torch.arange(10), "cu_seqlens": torch.tensor([0, 4, 10])}, "s") is None


def test_plan_in_megatron_cores_shape():
    plan = plan_batch(PlanRequest.of((3000, 1500, 700, 500, 301, 97, 1000, 64), 2, 2, 1024))
    groups = sample_id_groups(plan)
    assert len(groups) == len(plan.micro_batches) and all(len(mb) == 4 for mb in groups)
    assert sorted(i for mb in groups for ids in {tuple(r) for r in mb} for i in ids) == list(range(8))


def test_virtual_pipeline_parallelism_and_batch_size_ramp_up_are_refused_by_the_refusal_table():
    """wrap_data_iterator refuses VPP before it touches a process group, and a step whose
    num_microbatches changed (batch-size ramp-up); both are rows of the one table."""
    from trainer_client.compatibility import RULES, UnsupportedCombinationError
    from trainer_client.megatron_lm.packing import PackingDropIn, wrap_data_iterator

    with pytest.raises(UnsupportedCombinationError, match="virtual_pipeline_model_parallel_size=2.*one per virtual pipeline stage") as vpp:
        wrap_data_iterator(iter([]), megatron_config(virtual_pipeline_model_parallel_size=2), 2)
    wrapper = PackingDropIn(None, megatron_config(), 2, None, SchedulerKind.DYNAMIC_CP)
    with pytest.raises(UnsupportedCombinationError, match="num_microbatches=changed from 2 to 4.*ramp-up") as ramp_up:
        wrapper.next_step(4)
    assert vpp.value.option == "config.virtual_pipeline_model_parallel_size" and ramp_up.value.option == "num_microbatches"
    assert {id(vpp.value.rule), id(ramp_up.value.rule)} == {id(r) for r in RULES if r.reads("wrap_data_iterator")}
    # Bridge reads the same two rows at its own paths.
    assert {p.path for r in (vpp.value.rule, ramp_up.value.rule) for p in r.places if p.source == "bridge"} == {
        "model.virtual_pipeline_model_parallel_size", "train.rampup_batch_size"}
