"""The Bridge drop-in's refusals, version gate and input checks, in one process on Bridge's real
config classes: every unsupported combination is refused by `enable()` before anything runs, with
the setting's path, its value and what to do; a Bridge version it was not checked against gets one
warning and no change; docs/megatron-bridge.md lists the same refusals as the code."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.trainer_client.megatron_bridge import dropin_ranks as ranks

ROOT = Path(__file__).resolve().parents[3]

# A value of each row's setting that the drop-in refuses.
REFUSED = {
    "model.pipeline_model_parallel_size": 3,
    "dataset.dataloader_type": "batch",
    "dataset.skip_getting_attention_mask_from_dataset": False,
    "train.iterations_to_skip": [3],
    "dist.use_megatron_fsdp": True,
    "model.overlap_moe_expert_parallel_comm": True,
    "model.position_embedding_type": "rope",
    "model.mtp_num_layers": 1,
    "train.rampup_batch_size": [1, 1, 100],
    "ddp.use_megatron_fsdp": True,
    "model.is_hybrid_model": True,
    "model.moe_expert_rank_capacity_factor": 1.5,
    "dist.use_decentralized_pg": True,
    "model.dynamic_context_parallel": False,
    "model.hybrid_context_parallel": False,
    "model.sequence_packing_scheduler": "round_robin",
    "model.max_seqlen_per_dp_cp_rank": None,
}


def _config():
    return ranks.bridge_config(tp=1, cp=2, world=4)


def _set(cfg, path: str, value) -> None:
    *parents, name = path.split(".")
    target = cfg
    for parent in parents:
        target = getattr(target, parent)
    setattr(target, name, value)


def _applies(path: str) -> bool:
    """The group rows apply to the build that has their field (dynamic: dev, hybrid: 0.19); the RoPE
    and MTP rows to 0.19 only."""
    dev = ranks._has_dynamic_cp()
    release_only = ("model.hybrid_context_parallel", "model.position_embedding_type", "model.mtp_num_layers")
    return {"model.dynamic_context_parallel": dev, **{p: not dev for p in release_only}}.get(path, True)


def _bridge_paths(rule) -> list[str]:
    return [place.path for place in rule.places_in() if place.source == "bridge"]


def test_every_bridge_rule_has_a_refused_value():
    from trainer_client.megatron_bridge import BRIDGE_RULES

    assert sorted(path for r in BRIDGE_RULES for path in _bridge_paths(r)) == sorted(REFUSED)


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_enable_refuses_each_unsupported_combination(path):
    from trainer_client import UnsupportedCombinationError
    from trainer_client.megatron_bridge import BRIDGE_RULES, active, enable

    if not _applies(path):
        pytest.skip(f"{path} is the other Megatron-Core build's field")
    cfg = _config()
    if path == "model.dynamic_context_parallel":  # the scheduler named, the groups not asked for
        cfg.model.sequence_packing_scheduler = "default_dynamic_cp"
    _set(cfg, path, REFUSED[path])
    with pytest.raises(UnsupportedCombinationError) as refused:
        enable(cfg)
    rule = next(r for r in BRIDGE_RULES if path in _bridge_paths(r))
    assert refused.value.option == path and rule.fix in str(refused.value), str(refused.value)
    assert repr(REFUSED[path]) in str(refused.value)
    assert active() is None  # nothing was changed


def test_the_release_refuses_the_contiguous_layout():
    from trainer_client import UnsupportedCombinationError
    from trainer_client.megatron_bridge import enable

    if ranks._has_dynamic_cp():
        pytest.skip("the dev build's PackedSeqParams carries the layout (cp_partition_mode)")
    with pytest.raises(UnsupportedCombinationError, match="cp_layout='contiguous'.*zigzag"):
        enable(_config(), planner={"cp_layout": "contiguous"})


def test_enable_refuses_what_every_dynamic_cp_trainer_refuses():
    from trainer_client import UnsupportedCombinationError
    from trainer_client.megatron_bridge import enable

    cfg = _config()
    cfg.model.calculate_per_token_loss = False
    with pytest.raises(UnsupportedCombinationError, match="calculate_per_token_loss"):
        enable(cfg)


def test_settings_come_from_bridges_config():
    from batch_planner.request import SchedulerKind
    from trainer_client.megatron_bridge import BridgeSettings

    cfg = _config()
    settings = BridgeSettings.of(cfg, {"planner_endpoint": "127.0.0.1:1"})
    assert settings.scheduler is SchedulerKind.DYNAMIC_CP
    assert settings.planner.max_seqlen_per_dp_cp_rank == ranks.MAX_SEQLEN_PER_RANK
    assert (settings.planner.context_parallel_size, settings.planner.tensor_parallel_size) == (2, 1)
    assert settings.planner.planner_endpoint == "127.0.0.1:1"


def test_an_fp8_model_is_planned_for_its_recipe_and_not_refused():
    """FP8 runs with the drop-in: the planner settings take the model's fp8_recipe and sequence
    parallelism, the refusal table lets it through, and a planner precision that disagrees is
    refused naming both."""
    from batch_planner.precision import Precision
    from trainer_client import ConfigError, UnsupportedCombinationError
    from trainer_client.megatron_bridge import BridgeSettings
    from trainer_client.megatron_bridge.settings import check_bridge_support

    cfg = _config()
    cfg.model.fp8, cfg.model.fp8_recipe = "e4m3", "tensorwise"
    settings = BridgeSettings.of(cfg, {"planner_endpoint": "127.0.0.1:1"})
    assert (settings.planner.precision, settings.planner.sequence_parallel) == (Precision.FP8_CURRENT, bool(cfg.model.sequence_parallel))
    check_bridge_support(cfg, settings)
    with pytest.raises(ConfigError, match="precision: the planner settings say 'bf16' but Megatron runs 'fp8_current'"):
        BridgeSettings.of(cfg, {"precision": "bf16"})
    cfg.model.fp8_recipe = "custom"
    with pytest.raises(ConfigError, match="fp8_recipe: 'custom'.*allowed with dynamic CP: delayed, tensorwise, blockwise, mxfp8"):
        BridgeSettings.of(cfg)
    cfg.model.fp8, cfg.model.fp4 = None, "e2m1"
    with pytest.raises(UnsupportedCombinationError, match="fp4='e2m1'.*no row alignment for NVFP4"):
        check_bridge_support(cfg, BridgeSettings.of(cfg))


def test_a_size_given_twice_must_agree():
    from trainer_client import ConfigError
    from trainer_client.megatron_bridge import BridgeSettings

    with pytest.raises(ConfigError, match="max_seqlen_per_dp_cp_rank.*planner settings say 7"):
        BridgeSettings.of(_config(), {"max_seqlen_per_dp_cp_rank": 7})


def test_an_unchecked_bridge_version_warns_once_and_changes_nothing(monkeypatch):
    import megatron.bridge.training.gpt_step as gpt_step
    import megatron.bridge.training.train as train

    from trainer_client.megatron_bridge import active, enable, version

    before = (train.get_forward_backward_func, gpt_step.get_batch, gpt_step.get_packed_seq_params)
    monkeypatch.setattr(version, "bridge_version", lambda: "0.7.0")
    monkeypatch.setattr(version.GATE, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert enable(_config()) is False
        assert enable(_config()) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "0.7.0" in messages[0] and "nothing is changed" in messages[0], messages
    assert (train.get_forward_backward_func, gpt_step.get_batch, gpt_step.get_packed_seq_params) == before
    assert active() is None


def test_enable_and_disable_replace_and_restore_bridges_functions():
    import megatron.bridge.training.eval as bridge_eval
    import megatron.bridge.training.gpt_step as gpt_step
    import megatron.bridge.training.train as train

    from trainer_client.megatron_bridge import active, disable, enable, get_batch

    before = (train.get_forward_backward_func, bridge_eval.get_forward_backward_func, gpt_step.get_batch,
              gpt_step.get_packed_seq_params)
    assert enable(_config())
    try:
        assert gpt_step.get_batch is get_batch and active() is not None
        assert train.get_forward_backward_func is not before[0] and bridge_eval.get_forward_backward_func is not before[1]
    finally:
        disable()
    assert (train.get_forward_backward_func, bridge_eval.get_forward_backward_func, gpt_step.get_batch,
            gpt_step.get_packed_seq_params) == before


@pytest.mark.parametrize("bad, message", [
    ({"tokens": torch.zeros(1, 4, dtype=torch.long)}, "has no tensor"),
    ({**ranks.micro_batch(0, 0, 0), "cu_seqlens": torch.tensor([[0, 5, 3]], dtype=torch.int32),
      "cu_seqlens_argmin": torch.tensor(3)}, "decreases"),
    ([1, 2], "is a list"),
    ({**ranks.micro_batch(0, 0, 0), "labels": torch.zeros(1, 3, dtype=torch.long)}, "share one"),
])
def test_bad_micro_batches_name_what_is_wrong(bad, message):
    from trainer_client.errors import DropInInputError
    from trainer_client.megatron_bridge import unpack_micro_batch

    with pytest.raises(DropInInputError, match=message):
        unpack_micro_batch(bad, 0)


def test_packed_and_row_micro_batches_unpack_to_their_sequences():
    from trainer_client.megatron_bridge import unpack_micro_batch

    packed = ranks.micro_batch(0, 0, 0)
    samples = unpack_micro_batch(packed, 0)
    assert [len(s["tokens"]) for s in samples] == ranks.sequence_lengths(0, 0, 0)
    assert torch.equal(torch.cat([s["tokens"] for s in samples]), packed["tokens"][0])
    rows = {name: torch.arange(6).reshape(2, 3) for name in ("tokens", "labels", "loss_mask", "position_ids")}
    assert [s["tokens"].tolist() for s in unpack_micro_batch(rows, 0)] == [[0, 1, 2], [3, 4, 5]]


def test_docs_list_the_refusals_of_the_code():
    """docs/megatron-bridge.md's table is the one generated from BRIDGE_RULES (trainer_client/refusals/refusal_docs.py)."""
    from trainer_client.megatron_bridge import BRIDGE_RULES
    from trainer_client.refusals.refusal_docs import own_table

    table = own_table("trainer_client.megatron_bridge")
    assert table.count("\n") - 1 == len(BRIDGE_RULES)
    page = (ROOT / "docs" / "megatron-bridge.md").read_text()
    page = page.split("## What is refused", 1)[1].split("\n## ", 1)[0]
    assert table in page, "docs/megatron-bridge.md, What is refused, should hold:\n" + table
