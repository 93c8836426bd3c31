"""What the refusal table (trainer_client/refusals/compatibility.py) refuses before it reads a row: a scheduler
or CP layout name that is none is refused with the project's own errors (a planner config's as a
setting, ConfigError; a plan's as an argument, InvalidArgumentError), naming where it was read, the
value and what is allowed. `schedulers_the_trainer_runs` raises the first refusal when no scheduler
is left. Bridge's `scheduler_of` allows what the table's Bridge row allows, read from the one home."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from batch_planner.request import CpLayout, SchedulerKind
from trainer_client.refusals.compatibility import (
    InstalledMegatron, UnsupportedCombinationError, check, check_dynamic_cp_support, schedulers_the_trainer_runs,
)
from trainer_client.service.config import PlannerClientConfig
from trainer_client.errors import ConfigError, InvalidArgumentError, PlannerClientError
from trainer_client.megatron_bridge import BRIDGE_SCHEDULERS  # and, imported, the `bridge` source registered

RELEASE = InstalledMegatron(vpp_aware_scheduler=False)
KINDS = [k.value for k in SchedulerKind]
LAYOUTS = [k.value for k in CpLayout]


@pytest.mark.parametrize("field, value, allowed", [
    ("scheduler", "round_robin", KINDS), ("scheduler", "DYNAMIC_CP", KINDS), ("cp_layout", "diagonal", LAYOUTS), ("cp_layout", 3, LAYOUTS),
])
def test_a_planner_config_name_that_is_none_is_a_config_error(field, value, allowed):
    with pytest.raises(ConfigError) as caught:
        check_dynamic_cp_support(planner_config={field: value}, installed=RELEASE)
    assert str(caught.value) == f"planner config {field}: {value!r} is not allowed; allowed: {allowed}"
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, PlannerClientError)


@pytest.mark.parametrize("field, value, allowed", [("scheduler", "round_robin", KINDS), ("cp_layout", "diagonal", LAYOUTS)])
def test_a_plan_name_that_is_none_is_an_invalid_argument(field, value, allowed):
    plan = SimpleNamespace(**{field: value}, micro_batches=())
    with pytest.raises(InvalidArgumentError) as caught:
        check_dynamic_cp_support(plan=plan, planner_config={field: allowed[0]}, installed=RELEASE)
    assert str(caught.value) == f"plan {field}: {value!r} is not allowed; allowed: {allowed}"
    assert isinstance(caught.value, ValueError)


def test_names_and_members_alike_pass():
    for scheduler in (*KINDS, *SchedulerKind):
        for layout in (*LAYOUTS, *CpLayout):
            check_dynamic_cp_support(planner_config={"scheduler": scheduler, "cp_layout": layout}, installed=RELEASE)
    check_dynamic_cp_support(planner_config={"scheduler": None, "cp_layout": None}, installed=RELEASE)


def _transformer(**overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **overrides)


def test_with_no_scheduler_left_the_first_refusal_is_raised():
    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=4096)
    assert schedulers_the_trainer_runs(config, transformer_config=_transformer(calculate_per_token_loss=True)) == ()
    with pytest.raises(UnsupportedCombinationError) as caught:
        schedulers_the_trainer_runs(config, transformer_config=_transformer(calculate_per_token_loss=False))
    assert caught.value.option == "calculate_per_token_loss" and caught.value.value is False


def _bridge_config():
    """A stand-in for Bridge's ConfigContainer on a Megatron-Core release (its model has no
    sequence_packing_scheduler), holding only what the Bridge rows read to pass."""
    return SimpleNamespace(model=SimpleNamespace(max_seqlen_per_dp_cp_rank=4096, hybrid_context_parallel=True))


def _table_allows_for_bridge(kind: SchedulerKind) -> bool:
    try:
        check({"bridge": _bridge_config(), "planner config": {"scheduler": kind}}, RELEASE)
    except UnsupportedCombinationError as refused:
        assert refused.option == "scheduler", refused
        return False
    return True


def test_bridges_allowed_schedulers_are_the_tables():
    from trainer_client.megatron_bridge.settings import scheduler_of

    model = _bridge_config().model
    table = [kind.value for kind in SchedulerKind if _table_allows_for_bridge(kind)]
    assert table == [kind.value for kind in BRIDGE_SCHEDULERS] == ["dynamic_cp", "static_packing"]
    with pytest.raises(ConfigError) as caught:
        scheduler_of(model, "round_robin")
    assert str(caught.value) == f"scheduler: 'round_robin' is not allowed in Megatron-Bridge's drop-in; allowed: {table}"
    assert scheduler_of(model) is SchedulerKind.DYNAMIC_CP
    for kind in SchedulerKind:
        # Every scheduler is read as itself; the table refuses those Bridge's loop does not run.
        assert scheduler_of(model, kind.value) is kind
        assert _table_allows_for_bridge(kind) == (kind.value in table)
