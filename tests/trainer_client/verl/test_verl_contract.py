"""verl's own DCP unit tests (tests/utils/test_dynamic_cp_scheduler.py of verl 0.9.1), their
assertions ported to the drop-in where they test the public contract (docs/verl.md says which
apply and why the rest do not); plus the drop-in's settings and verl's hook for loading it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.utils import tensordict_utils as tu
from verl.utils.dynamic_cp_scheduler import DCP_GROUP_LEADER, DCP_LOCAL_NUM_TOKENS, DCP_PADDING_MASK, DCP_SAMPLE_IDS

from batch_planner.request import CpLayout, SchedulerKind
from tests.support.planner_process import ROOT, planner_env
from tests.trainer_client.verl.support import mini_batch
from trainer_client.service.config import ConfigError
from trainer_client.errors import InvalidArgumentError, UnrunnablePlanError, UnsupportedCombinationError
from trainer_client.verl import DynamicCPScheduler
from trainer_client.verl.micro_batches import rank_micro_batches
from trainer_client.plans.apply import shard_padding_mask
from trainer_client.verl.settings import planner_settings, verl_planner_config


def _planned(assignment, lengths, tp_size=1, layout=CpLayout.ZIGZAG):
    """A plan's micro-batches with the groups of `assignment` (Megatron-Core's sample_id_groups)."""
    from batch_planner.padding import PlanPadding
    from batch_planner.plan import micro_batches_from_assignment

    return micro_batches_from_assignment(assignment, PlanPadding(lengths, tp_size, layout))[0]


class _Group:
    """The two calls schedule() makes of a DPxCP group before it plans (verl's tests use the same)."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


# verl: test_schedule_adapts_mcore_assignments. The assignment Megatron-Core returns for lengths
# [7, 3, 5] on 2x2 ranks becomes, per rank, these micro-batches.
def test_an_assignment_becomes_each_ranks_micro_batch():
    batch = mini_batch([7, 3, 5], seed=0)
    expected = [
        ([0], 2, True, 3, [False, False, False, True]),
        ([0], 2, False, 4, [False, False, False, False]),
        ([1], 1, True, 3, [False, False, False]),
        ([2], 1, True, 5, [False, False, False, False, False]),
    ]
    for rank, (sample_ids, cp_size, leader, local_tokens, padding_mask) in enumerate(expected):
        micro_batches = rank_micro_batches(
            batch, _planned([[[0], [0], [1], [2]]], [7, 3, 5]), [7, 3, 5], rank, tp_size=1, cp_layout=CpLayout.ZIGZAG, min_local_rows=None
        )
        assert len(micro_batches) == 1
        mb = micro_batches[0]
        assert mb["uid"].tolist() == sample_ids
        assert tu.get_non_tensor_data(mb, "local_cp_size", None) == cp_size
        assert tu.get_non_tensor_data(mb, DCP_SAMPLE_IDS, None) == sample_ids
        assert tu.get_non_tensor_data(mb, DCP_GROUP_LEADER, None) is leader
        assert tu.get_non_tensor_data(mb, DCP_LOCAL_NUM_TOKENS, None) == local_tokens
        assert tu.get_non_tensor_data(mb, DCP_PADDING_MASK, None).tolist() == padding_mask


# verl: the same test's check of what Megatron-Core's scheduler is built with. Here: the request
# the planner gets carries verl's sizes, and no VPP group size (verl passes None).
def test_the_request_carries_verls_sizes():
    config = verl_planner_config({}, max_seqlen_per_dp_cp_rank=4, cp_size=2, tp_size=1, cp_layout=CpLayout.ZIGZAG)
    assert (config.max_seqlen_per_dp_cp_rank, config.context_parallel_size, config.micro_batch_group_size) == (4, 2, None)
    assert config.scheduler is SchedulerKind.DYNAMIC_CP and config.min_cp_size is None


# verl: test_local_token_count_partitions_real_tokens, on the public keys: a CP group's ranks hold
# every real token once between them.
@pytest.mark.parametrize("cp_size,tp_size", [(2, 1), (4, 2)])
@pytest.mark.parametrize("layout", list(CpLayout))
@pytest.mark.parametrize("min_local_rows", [None, 40])
def test_local_token_counts_partition_the_real_tokens(cp_size, tp_size, layout, min_local_rows):
    lengths = [7, 3, 17]
    batch = mini_batch(lengths, seed=1)
    assignment = [[[0, 1, 2]] * cp_size]
    counts = []
    for rank in range(cp_size):
        planned = _planned(assignment, lengths, tp_size, layout)
        (mb,) = rank_micro_batches(batch, planned, lengths, rank, tp_size=tp_size, cp_layout=layout, min_local_rows=min_local_rows)
        mask = tu.get_non_tensor_data(mb, DCP_PADDING_MASK, None)
        counts.append(tu.get_non_tensor_data(mb, DCP_LOCAL_NUM_TOKENS, None))
        assert counts[-1] == mask.numel() - int(mask.sum())
        if min_local_rows is not None:
            assert mask.numel() >= min_local_rows
    assert sum(counts) == 27


# verl: test_scheduler_rejects_invalid_topology.
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_seqlen_per_dp_cp_rank": 0, "dp_size": 1, "cp_size": 1}, "max_seqlen_per_dp_cp_rank"),
        ({"max_seqlen_per_dp_cp_rank": 4, "dp_size": True, "cp_size": 1}, "dp_size"),
        ({"max_seqlen_per_dp_cp_rank": 4, "dp_size": 1, "cp_size": -1}, "cp_size"),
    ],
)
def test_scheduler_rejects_invalid_topology(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}.*positive integer"):
        DynamicCPScheduler(**kwargs)


# verl: test_scheduler_rejects_unaligned_mcore_group.
# verl raises RuntimeError for both; the drop-in refuses them by verl's rows of the one table, before
# it builds a micro-batch, with UnrunnablePlanError (a RuntimeError too).
def _verl_step_check(micro_batches):
    from types import SimpleNamespace

    from trainer_client.refusals.compatibility import check

    check({"verl": {"tp_size": 1, "cp_layout": "zigzag"}, "plan": SimpleNamespace(micro_batches=micro_batches)})


def test_an_unaligned_cp_group_is_refused():
    with pytest.raises(UnrunnablePlanError, match=r"CP group of ranks \[1, 2\].*first rank 1") as refused:
        _verl_step_check(_planned([[[0], [1], [1], [2]]], [3, 5, 7]))
    assert isinstance(refused.value, RuntimeError) and refused.value.option == "cp_groups"


def test_a_rank_without_a_sample_is_refused():
    with pytest.raises(UnrunnablePlanError, match=r"ranks \[1\] have no sample") as refused:
        _verl_step_check(_planned([[[0], [], [1], [1]]], [3, 5]))
    assert isinstance(refused.value, RuntimeError) and refused.value.option == "micro_batches"


# verl's schedule() checks before planning, each named by its field.
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda s, b: s.schedule(b, _Group(3), tp_size=1), "dcp_group: DPxCP group size 3"),
        (lambda s, b: s.schedule(b, _Group(4), tp_size=1, cp_layout="ring"), "cp_layout: 'ring' is not allowed"),
        (lambda s, b: s.schedule(b, _Group(4), tp_size=1, min_local_rows=0), "min_local_rows: 0 is not allowed"),
        (lambda s, b: s.schedule(mini_batch([40], seed=3), _Group(4), tp_size=1), "40 tokens needs at least 10 ranks"),
        # The refusal table's verl row: a top-up that would leave a zigzag sequence Transformer Engine asserts on.
        (lambda s, b: s.schedule(b, _Group(4), tp_size=1, min_local_rows=5), r"min_local_rows.*multiple of 2 x CP"),
        (lambda s, b: s.schedule(b, _Group(4), tp_size=2, cp_layout="contiguous", min_local_rows=3), r"min_local_rows.*sequence parallelism"),
    ],
)
def test_schedule_refuses_bad_input_before_planning(call, message):
    with pytest.raises(ValueError, match=message):
        call(DynamicCPScheduler(4, 2, 2), mini_batch([3, 5], seed=3))


def test_padding_mask_zigzag_halves():
    # 10 tokens on CP2 zigzag pad to 12: rank 0 holds rows 0-2 and 9-11, rank 1 rows 3-8.
    assert shard_padding_mask([10], [12], 2, 0, CpLayout.ZIGZAG).tolist() == [False] * 3 + [False, True, True]
    assert shard_padding_mask([10], [12], 2, 1, CpLayout.ZIGZAG).tolist() == [False] * 6


# The drop-in's settings: the client's config format, from the environment.
def test_settings_come_from_the_endpoint_variable_and_the_config_file(tmp_path, monkeypatch):
    path = tmp_path / "planner.yaml"
    path.write_text("batch_planner:\n  planner_endpoint: other:1\n  deadline_seconds: 3.0\n")
    monkeypatch.setenv("BATCH_PLANNER_CONFIG", str(path))
    monkeypatch.setenv("BATCH_PLANNER_ENDPOINT", "planner.example:50051")
    assert planner_settings() == {"planner_endpoint": "planner.example:50051", "deadline_seconds": 3.0}
    monkeypatch.delenv("BATCH_PLANNER_CONFIG")
    monkeypatch.delenv("BATCH_PLANNER_ENDPOINT")
    assert planner_settings() == {}


def test_one_config_per_distinct_settings_and_sizes_even_from_a_yaml_with_lists(tmp_path, monkeypatch):
    """verl builds a scheduler for every call: the config of the same settings and sizes is built (and
    checked) once, also when the YAML holds a list; an unhashable bad argument is still named."""
    path = tmp_path / "planner.yaml"
    path.write_text("batch_planner:\n  scheduler: auto\n  auto_schedulers: [dynamic_cp]\n")
    monkeypatch.setenv("BATCH_PLANNER_CONFIG", str(path))
    monkeypatch.delenv("BATCH_PLANNER_ENDPOINT", raising=False)
    first = DynamicCPScheduler(4, 1, 2)._config(1, "zigzag")
    assert DynamicCPScheduler(4, 1, 2)._config(1, "zigzag") is first
    assert first.auto_schedulers == (SchedulerKind.DYNAMIC_CP,)
    assert DynamicCPScheduler(4, 1, 2)._config(1, "contiguous") is not first
    with pytest.raises(InvalidArgumentError, match=r"min_local_rows: \[1\] is not allowed"):
        DynamicCPScheduler(4, 1, 2)._config(1, "zigzag", [1])


@pytest.mark.parametrize(
    "settings,error,message",
    [
        ({"scheduler": "hybrid_cp"}, UnsupportedCombinationError,
         "scheduler=<SchedulerKind.HYBRID_CP: 'hybrid_cp'>: verl's engine runs the dynamic-CP contract.*set scheduler to dynamic_cp or auto"),
        ({"scheduler": "auto", "auto_schedulers": ["static_packing"]}, UnsupportedCombinationError,
         "auto_schedulers=\\['static_packing'\\]: auto may choose only"),
        ({"context_parallel_size": 4}, ConfigError, "context_parallel_size: the planner settings say 4 but verl's engine runs 2"),
    ],
)
def test_settings_verl_cannot_run_are_refused(settings, error, message):
    with pytest.raises(error, match=message):
        verl_planner_config(settings, max_seqlen_per_dp_cp_rank=4, cp_size=2, tp_size=1, cp_layout=CpLayout.ZIGZAG)


def test_auto_is_restricted_to_dynamic_cp():
    config = verl_planner_config({"scheduler": "auto"}, max_seqlen_per_dp_cp_rank=4, cp_size=2, tp_size=1, cp_layout=CpLayout.ZIGZAG)
    assert config.auto_schedulers == (SchedulerKind.DYNAMIC_CP,)


# verl's hook for a user's module: the drop-in is in place by configuration only.
def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**planner_env(), **env}
    return subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", textwrap.dedent(code)],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=180,
    )


def test_verls_external_lib_setting_puts_the_drop_in_in_place():
    # What HFModelConfig.__post_init__ does with `actor_rollout_ref.model.external_lib`.
    done = _python(
        """
        from verl.utils.import_utils import import_external_libs
        import_external_libs("trainer_client.verl.enable")
        from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler
        print(DynamicCPScheduler.__module__)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["trainer_client.verl.scheduler"]


def test_verls_external_modules_variable_puts_the_drop_in_in_place():
    done = _python(
        "from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler; print(DynamicCPScheduler.__module__)",
        VERL_USE_EXTERNAL_MODULES="trainer_client.verl.enable",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["trainer_client.verl.scheduler"]


def test_an_unchecked_verl_version_says_so_and_changes_nothing():
    done = _python(
        """
        import verl
        verl.__version__ = "0.10.0"
        import trainer_client.verl.enable as enable
        from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler
        print(enable.enabled, DynamicCPScheduler.__module__)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "verl.utils.dynamic_cp_scheduler"]
    assert "verl 0.10.0 is not a version this drop-in was checked against" in done.stderr


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.integers(1, 8), st.sampled_from([1, 2]),
       st.sampled_from(list(CpLayout)), st.one_of(st.none(), st.integers(1, 64)))
def test_verls_padding_is_verls_own(lengths, cp_size, tp_size, layout, min_local_rows):
    """The drop-in pads as verl does (verl's own `_local_padding_mask`, the mask verl's preprocessing
    yields): every rank's padding mask equal, for odd lengths, CP 1-8, TP 1-2, both layouts and
    `min_local_rows`, save what the refusal table refuses before the first step."""
    from verl.utils.dynamic_cp_scheduler import _local_padding_mask

    from batch_planner.padding import group_padded_lengths
    from batch_planner.request import PaddingRule
    from trainer_client.refusals.compatibility import check
    from trainer_client.service.config import PlannerClientConfig
    from trainer_client.errors import UnsupportedCombinationError

    try:
        check({"planner config": PlannerClientConfig(max_seqlen_per_dp_cp_rank=64, cp_layout=layout, tensor_parallel_size=tp_size,
                                                     padding=PaddingRule.VERL, min_local_rows=min_local_rows)})
    except UnsupportedCombinationError:
        return  # refused before verl pads anything
    padded = group_padded_lengths(lengths, cp_size, tp_size, layout, PaddingRule.VERL, min_local_rows)
    for rank in range(cp_size):
        theirs = _local_padding_mask(lengths, cp_size=cp_size, cp_rank=rank, tp_size=tp_size, cp_layout=layout.value,
                                     min_local_rows=min_local_rows)
        assert shard_padding_mask(lengths, padded, cp_size, rank, layout).tolist() == theirs.tolist(), (padded, rank)


def test_importing_the_drop_in_changes_nothing_in_verl():
    """Only the hooks' entry point, trainer_client.verl.enable, turns the drop-in on when imported."""
    done = _python(
        """
        import trainer_client.verl, trainer_client.verl.switch, trainer_client.verl.scheduler
        from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler
        print(DynamicCPScheduler.__module__)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["verl.utils.dynamic_cp_scheduler"]


def test_enable_is_a_call_and_the_end_of_enabled_puts_verls_own_back_and_closes_the_planners():
    import verl.utils.dynamic_cp_scheduler as upstream

    from trainer_client.verl import planning, switch
    from trainer_client.verl.scheduler import DynamicCPScheduler as Ours

    own = upstream.DynamicCPScheduler

    class Planner:
        closes = 0

        def close(self):
            self.closes += 1

    planner = planning._planners.get(("a group", "a config"), Planner)
    with pytest.raises(KeyError), switch.enabled() as turned_on:
        assert turned_on and upstream.DynamicCPScheduler is Ours
        raise KeyError("the trainer failed")
    assert upstream.DynamicCPScheduler is own and planner.closes == 1 and planning.planners() == []
