"""A drop-in registers its part of the refusal table and its contract (`trainer_client.dropin.DropIn`)
from its own package: `check` then knows its source, its rows refuse, the core's rows read its places
of their settings, and a name registered twice is refused naming who registered it. A source nobody
registered is refused naming those known."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import trainer_client.megatron_bridge  # noqa: F401  (registers the `bridge` drop-in)
from trainer_client.refusals import compatibility
from trainer_client.refusals.compatibility import Place, Rule, TableSource, check, is_set, known_sources, table
from trainer_client.dropin.derived import DerivedSettings
from trainer_client.dropin import DropIn, dropin, register_dropin, registered_dropins, spec
from trainer_client.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedCombinationError, UsageError

TITAN_ROW = Rule(Place("titan", "compile"), "true", "the planned steps change shape every step; set compile=False", is_set)


def _titan(**overrides) -> DropIn:
    refusals = TableSource("titan", "the titan drop-in", (TITAN_ROW,), places={"use_megatron_fsdp": ("parallelism.fsdp",)})
    values = dict(refusals=refusals, package="tests.titan", settings=lambda config: DerivedSettings(4096, 2, 1), readers=(lambda: None,))
    return DropIn(**{**values, **overrides})


@pytest.fixture
def isolated(monkeypatch):
    """The registries as they are now, restored after the test."""
    monkeypatch.setattr(compatibility, "_REGISTERED", dict(compatibility._REGISTERED))
    monkeypatch.setattr(compatibility, "_REGISTERED_BY", dict(compatibility._REGISTERED_BY))
    monkeypatch.setattr(spec, "_DROP_INS", dict(spec._DROP_INS))


def test_a_source_nobody_registered_is_refused_naming_the_known_ones(isolated):
    with pytest.raises(InvalidArgumentError) as caught:
        check({"titan": {"compile": True}})
    message = str(caught.value)
    assert "unknown refusal-table sources ['titan']" in message and "'bridge'" in message and "'engine'" in message
    assert "register_dropin" in message


def test_a_registered_drop_in_is_checked_by_its_rows_and_the_cores_rows_at_its_places(isolated):
    titan = register_dropin(_titan())
    assert dropin("titan") is titan and titan in registered_dropins() and "titan" in known_sources()
    with pytest.raises(UnsupportedCombinationError, match="compile=True: the planned steps") as own:
        check({"titan": {"compile": True}})
    assert own.value.rule is TITAN_ROW
    with pytest.raises(UnsupportedCombinationError, match="Megatron FSDP") as core:
        check({"titan": {"parallelism": {"fsdp": True}}})
    assert core.value.option == "parallelism.fsdp" and Place("engine", "use_megatron_fsdp") in core.value.rule.places
    check({"titan": {"compile": False}})
    # Its rows come after the core's own and before the core's rows read only at a drop-in's places.
    rows = table(["titan"])
    assert rows.index(TITAN_ROW) == sum(1 for r in compatibility.RULES if r.places)
    # Another drop-in's table is as it was.
    assert TITAN_ROW not in table(["bridge"])


def test_a_name_registered_twice_is_refused_naming_who_registered_it(isolated):
    bridge = dropin("bridge")
    with pytest.raises(UsageError) as caught:
        register_dropin(bridge)
    assert str(caught.value).startswith("drop-in 'bridge' is registered already, by trainer_client.megatron_bridge;")
    with pytest.raises(UsageError, match="drop-in 'bridge' is registered already, by trainer_client.megatron_bridge; tests.titan must"):
        register_dropin(_titan(refusals=TableSource("bridge", "another Bridge drop-in")))
    with pytest.raises(UsageError, match="refusal-table source 'bridge' is registered already, by trainer_client.megatron_bridge; tests.titan"):
        compatibility.register_source(TableSource("bridge", "another Bridge drop-in"), "tests.titan")
    with pytest.raises(UsageError, match="'engine' is a core source"):
        register_dropin(_titan(refusals=TableSource("engine", "an engine")))
    assert dropin("bridge") is bridge


def test_a_drop_ins_rows_read_its_own_source_and_the_cores_settings_only(isolated):
    foreign = TableSource("titan", "titan", (Rule(Place("bridge", "model.fp8"), "set", "no", is_set),))
    with pytest.raises(InvalidArgumentError, match=r"reads sources \['bridge'\]"):
        register_dropin(_titan(refusals=foreign))
    unknown = TableSource("titan", "titan", places={"use_fsdp": ("fsdp",)})
    with pytest.raises(InvalidArgumentError, match=r"settings \['use_fsdp'\] are not a core row's; allowed: \['batch_size_rampup'"):
        register_dropin(_titan(refusals=unknown))
    with pytest.raises(InvalidArgumentError, match=r"places: \{'use_megatron_fsdp': 'fsdp'\} are not allowed; expected a tuple"):
        register_dropin(_titan(refusals=TableSource("titan", "titan", places={"use_megatron_fsdp": "fsdp"})))
    assert "titan" not in known_sources()


def test_a_drop_in_is_a_typed_contract(isolated):
    with pytest.raises(InvalidArgumentError, match=r"hooks: \['get_batch'\] are not upstream names; expected 'module:attribute'"):
        _titan(hooks={"get_batch": print}, gate=object(), enable=print, disable=print)
    with pytest.raises(InvalidArgumentError, match="hooks need a version gate"):
        _titan(hooks={"trainer.step:get_batch": print})
    with pytest.raises(ArgumentTypeError, match=r"readers\[0\]: 3 is not callable"):
        _titan(readers=(3,))
    with pytest.raises(ArgumentTypeError, match="register_dropin: got a SimpleNamespace"):
        register_dropin(SimpleNamespace(name="titan"))
    with pytest.raises(InvalidArgumentError, match=r"unknown drop-in 'titan'; registered: \[.*'bridge'"):
        dropin("titan")


def test_the_three_drop_ins_register_their_contract_and_enable_nothing():
    import sys

    import trainer_client.megatron_lm  # noqa: F401
    import trainer_client.verl  # noqa: F401

    for package, name in [("trainer_client.megatron_bridge", "bridge"), ("trainer_client.megatron_lm", "megatron_lm"), ("trainer_client.verl", "verl")]:
        registered = dropin(name)
        assert registered.package == package and registered.gate is not None and registered.hooks
        assert compatibility.rules_of(name) and all(r.reads(name) for r in compatibility.rules_of(name))
        # Registered, not enabled: no upstream name the drop-in replaces holds its hook.
        for target, hook in registered.hooks.items():
            module, _, attribute = target.partition(":")
            assert getattr(sys.modules.get(module), attribute, None) is not hook, target
