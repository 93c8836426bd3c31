"""The drop-in's single-process parts: planner settings from Megatron's config, packed-sample checks,
the plan in Megatron-Core's shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from tests.support.dropin_support import megatron_config
from trainer_client.service.config import ConfigError, PlannerClientConfig
from trainer_client.dropin import check_packed_sample, sample_id_groups
from trainer_client.megatron_lm.checks import megatron_planner_config as planner_config_for


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


def test_the_layout_is_the_models_own_where_the_build_has_one():
    """The dev build's cp_partition_mode decides the planner's cp_layout (Megatron-Core cuts and reads
    the shards in it, and the Bridge drop-in shards in it); a planner setting that says otherwise is
    refused, naming both; 0.19's config has none, and the setting stands."""
    contiguous = planner_config_for(megatron_config(cp_partition_mode="contiguous"), SchedulerKind.DYNAMIC_CP, 2)
    assert contiguous.cp_layout.value == "contiguous"
    with pytest.raises(ConfigError, match="cp_layout: the planner settings say 'zigzag' but Megatron runs 'contiguous'"):
        planner_config_for(megatron_config(cp_partition_mode="contiguous"), SchedulerKind.DYNAMIC_CP, 2, {"cp_layout": "zigzag"})
    assert planner_config_for(megatron_config(), SchedulerKind.HYBRID_CP, 2, {"cp_layout": "contiguous"}).cp_layout.value == "contiguous"


def test_the_megatron_drop_ins_pad_by_megatron_cores_rule():
    """verl's padding or its top-up in a Megatron drop-in's settings is refused, naming both values:
    Megatron-Core reads the shards, so the plan must count its padding."""
    assert planner_config_for(megatron_config(), SchedulerKind.DYNAMIC_CP, 2).padding.value == "megatron_core"
    with pytest.raises(ConfigError, match="padding: the planner settings say 'verl' but Megatron runs 'megatron_core'"):
        planner_config_for(megatron_config(), SchedulerKind.DYNAMIC_CP, 2, {"padding": "verl"})
    with pytest.raises(ConfigError, match="min_local_rows: the planner settings say 8 but Megatron runs None"):
        planner_config_for(megatron_config(), SchedulerKind.DYNAMIC_CP, 2, {"min_local_rows": 8})


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


def test_batch_size_ramp_up_is_refused_by_the_refusal_table_and_virtual_stages_are_not():
    """wrap_data_iterator refuses a step whose num_microbatches changed (batch-size ramp-up), a core row
    of the one table that Bridge reads at its own path; virtual pipeline stages it runs (one iterator
    per virtual stage), so no row of its own refuses them."""
    import trainer_client.megatron_bridge  # noqa: F401  (registers Bridge's places of the core's rows)
    from trainer_client.refusals.compatibility import RULES, UnsupportedCombinationError, table
    from trainer_client.dropin.stages import StageData
    from trainer_client.megatron_lm.packing import PackingDropIn

    from trainer_client.refusals.compatibility import check

    wrapper = PackingDropIn(None, megatron_config(), 2, None, SchedulerKind.DYNAMIC_CP, StageData(frozenset(), None))
    # The step's one check of the table happens in StepPlanner.next_step, with the plan; this planner
    # stand-in checks what the hook hands it and plans nothing.
    wrapper.planner = SimpleNamespace(next_step=lambda checks: check(checks))
    with pytest.raises(UnsupportedCombinationError, match="num_microbatches=changed from 2 to 4.*ramp-up") as ramp_up:
        wrapper.next_step(4)
    assert ramp_up.value.option == "num_microbatches"
    assert any(r is ramp_up.value.rule for r in RULES if r.reads("megatron_lm"))
    assert {p.path for p in ramp_up.value.rule.places_in() if p.source == "bridge"} == {"train.rampup_batch_size"}
    assert not any(p.path == "virtual_pipeline_model_parallel_size" for r in table() for p in r.places_in() if p.source == "megatron_lm")


def test_a_rope_model_is_refused_before_the_first_step_where_megatron_core_rotates_over_the_static_cp_group():
    """0.19 rotates THD input over the static CP group: both Megatron-LM drop-ins refuse a RoPE model
    when they are built (before any step), by the one row Bridge reads too; the dev build rotates
    over the micro-batch's group, and the drop-ins start."""
    from types import SimpleNamespace

    from trainer_client.refusals.compatibility import InstalledMegatron, UnsupportedCombinationError
    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper, wrap_data_iterator
    from trainer_client.megatron_lm.checks import check_model

    class GroupOfSize:
        def __init__(self, size):
            self.size = lambda: size

    groups = SimpleNamespace(dp_cp=GroupOfSize(2), dp=GroupOfSize(1), tp=GroupOfSize(1), pp=None)
    rope = dict(position_embedding_type="rope")
    if InstalledMegatron.detect().build == "dev":
        from trainer_client.megatron_lm.checks import megatron_planner_config as planner_config_for

        for kind in (SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP):
            check_model(megatron_config(**rope), planner_config_for(megatron_config(), kind, 2, {}))
        return
    with pytest.raises(UnsupportedCombinationError, match="position_embedding_type='rope'.*static CP group.*dev build") as hybrid:
        HybridCPDataLoaderWrapper(iter([]), megatron_config(**rope), groups, planner={})
    assert hybrid.value.option == "position_embedding_type"
    config = megatron_config(sequence_packing_scheduler="default_dynamic_cp", **rope)
    with pytest.raises(UnsupportedCombinationError, match="position_embedding_type='rope'"):
        wrap_data_iterator(iter([]), config, 1, groups, planner={})


def test_an_mtp_model_is_refused_before_the_first_step_where_megatron_core_rolls_over_the_static_cp_group():
    """0.19's MTP rolls packed tokens and labels over the static CP group (a Bridge PP2 run with one
    MTP layer hangs there in the boundary exchange): both Megatron-LM drop-ins refuse an MTP model when
    they are built, by the one row Bridge reads too; the dev build rolls within the micro-batch's
    group (tests/trainer_client/megatron_lm/test_megatron_dropin_pipeline.py runs MTP through the drop-in), and the drop-ins start."""
    from types import SimpleNamespace

    from trainer_client.refusals.compatibility import InstalledMegatron, UnsupportedCombinationError
    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper, wrap_data_iterator
    from trainer_client.megatron_lm.checks import check_model

    class GroupOfSize:
        def __init__(self, size):
            self.size = lambda: size

    groups = SimpleNamespace(dp_cp=GroupOfSize(2), dp=GroupOfSize(1), tp=GroupOfSize(1), pp=None)
    mtp = dict(mtp_num_layers=1, position_embedding_type="learned_absolute")
    if InstalledMegatron.detect().build == "dev":
        from trainer_client.megatron_lm.checks import megatron_planner_config as planner_config_for

        for kind in (SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP):
            check_model(megatron_config(**mtp), planner_config_for(megatron_config(), kind, 2, {}))
        return
    with pytest.raises(UnsupportedCombinationError, match="mtp_num_layers=1.*static CP group.*dev build") as hybrid:
        HybridCPDataLoaderWrapper(iter([]), megatron_config(**mtp), groups, planner={})
    assert hybrid.value.option == "mtp_num_layers"
    config = megatron_config(sequence_packing_scheduler="default_dynamic_cp", **mtp)
    with pytest.raises(UnsupportedCombinationError, match="mtp_num_layers=1"):
        wrap_data_iterator(iter([]), config, 1, groups, planner={})
