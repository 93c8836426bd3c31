"""The Megatron-LM drop-in behind its version gate, on the installed Megatron-Core and Megatron-LM's
real `megatron.training.training`: every private upstream name the drop-in calls is one the gate looks
up; a build that lacks one is refused, naming it, before a planner starts or anything is replaced;
`enable()` replaces the wrappers Megatron-LM's loop has only on a checked build, `disable()` (and the
end of `enabled()`) puts Megatron-LM's own back and closes the planner clients; importing the drop-in
changes nothing."""

from __future__ import annotations

import ast
import importlib
import logging
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainer_client
from tests.support.dropin_support import local_packed_batch, megatron_config
from trainer_client.errors import MissingUpstreamError
from trainer_client.megatron_lm import GATE, HybridCPDataLoaderWrapper, closing_wrapped, disable, enable, enabled, wrap_data_iterator
from trainer_client.megatron_lm import packing

enable_module = importlib.import_module("trainer_client.megatron_lm.enable")  # the package's `enable` is the function

ROOT = Path(trainer_client.__file__).resolve().parents[1]
# Where the drop-in reaches Megatron-Core: its own package and the one module all drop-ins share.
DROP_IN_SOURCES = [ROOT / "trainer_client" / "plans" / "megatron.py", *sorted((ROOT / "trainer_client" / "megatron_lm").glob("*.py"))]
class _GroupOfSize:
    """A process group's size, all the model's refusals read before the gate (no group is used)."""

    def __init__(self, size: int) -> None:
        self.size = lambda: size


GROUPS = SimpleNamespace(dp_cp=_GroupOfSize(2), dp=_GroupOfSize(1), tp=_GroupOfSize(1), pp=None)


class Closable:
    def __init__(self):
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def _private_upstream_imports() -> set[str]:
    found = set()
    for path in DROP_IN_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                found |= {f"{node.module}:{alias.name}" for alias in node.names if alias.name.startswith("_")}
    return found


def test_every_private_upstream_name_the_drop_in_calls_is_one_the_gate_looks_up():
    private = _private_upstream_imports()
    assert {"megatron.core.datasets.data_schedule_utils:_unpack_batch",
            "megatron.core.datasets.data_schedule:_get_scheduler_max_real_num_seqs"} <= private, private
    gated = {name for names in GATE.needs.values() for name in names}
    assert private <= gated, f"not in the gate's needs: {sorted(private - gated)}"


def test_the_installed_build_has_what_each_of_its_wrappers_calls():
    from megatron.core.datasets import data_schedule

    uses = [use for use in GATE.needs if hasattr(data_schedule, use)]  # 0.19 releases: HybridCPDataLoaderWrapper alone
    assert "HybridCPDataLoaderWrapper" in uses
    assert {use: GATE.missing(use) for use in uses} == {use: [] for use in uses}


def test_wrap_data_iterator_on_a_build_without_unpack_batch_is_refused_naming_it(monkeypatch):
    from megatron.core.datasets import data_schedule_utils

    monkeypatch.delattr(data_schedule_utils, "_unpack_batch")
    data = iter([local_packed_batch(0, 0)])
    with closing_wrapped(), pytest.raises(MissingUpstreamError, match=r"wrap_data_iterator calls Megatron-Core's "
                                          r"megatron\.core\.datasets\.data_schedule_utils:_unpack_batch, which the installed build"):
        wrap_data_iterator(data, megatron_config(sequence_packing_scheduler="default_dynamic_cp"), 1, GROUPS)
    assert packing.last_planned_step(data) is None and packing._wrappers.values() == []  # no planner started


def test_the_hybrid_cp_wrapper_on_a_build_without_upstreams_cut_is_refused_naming_it(monkeypatch):
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper as Upstream

    monkeypatch.delattr(Upstream, "unpack_batch")
    with pytest.raises(MissingUpstreamError, match=r"data_schedule:HybridCPDataLoaderWrapper\.unpack_batch") as refused:
        HybridCPDataLoaderWrapper(iter([]), megatron_config(), GROUPS)
    assert refused.value.missing == ("megatron.core.datasets.data_schedule:HybridCPDataLoaderWrapper.unpack_batch",)


@pytest.fixture
def training():
    import megatron.training.training as training

    own = {name: getattr(training, name) for name in enable_module.DROP_INS if hasattr(training, name)}
    yield training, own
    disable()
    assert {name: getattr(training, name) for name in own} == own


def test_enable_replaces_what_megatron_lms_loop_has_and_disable_puts_it_back(training):
    module, own = training
    assert own and all(value.__module__.startswith("megatron.core") for value in own.values())
    assert enable() == tuple(own)
    assert {name: getattr(module, name) for name in own} == {name: enable_module.DROP_INS[name] for name in own}
    disable()
    assert {name: getattr(module, name) for name in own} == own


def test_enabled_puts_megatron_lms_own_back_and_closes_the_planners_at_the_end_of_the_block(training):
    module, own = training
    entry = packing._wrappers.get(object(), Closable)  # a planner wrap_data_iterator made
    with pytest.raises(KeyError), enabled() as replaced:
        assert replaced == tuple(own) and module.wrap_data_iterator is wrap_data_iterator
        raise KeyError("pretrain failed")
    assert {name: getattr(module, name) for name in own} == own
    assert entry.closes == 1 and packing._wrappers.values() == []


def test_a_checked_build_lacking_a_private_name_is_refused_and_nothing_is_replaced(training, monkeypatch):
    from megatron.core.datasets import data_schedule

    module, own = training
    monkeypatch.delattr(data_schedule, "_get_scheduler_max_real_num_seqs")
    with pytest.raises(MissingUpstreamError, match=r"data_schedule:_get_scheduler_max_real_num_seqs, which the installed build \(0\.19"):
        enable()
    assert {name: getattr(module, name) for name in own} == own


def test_an_unchecked_build_warns_and_nothing_is_replaced(training, monkeypatch, caplog):
    module, own = training
    monkeypatch.setattr(enable_module, "megatron_core_version", lambda: "0.21.0")
    monkeypatch.setattr(GATE, "warned", False)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        assert enable() == ()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1 and "Megatron-Core 0.21.0 is not a version this drop-in was checked against" in messages[0], messages
    assert "Megatron-LM's own data-iterator wrappers stay in place, nothing is changed" in messages[0]
    assert {name: getattr(module, name) for name in own} == own


def test_closing_wrapped_closes_every_wrapped_iterators_planner_at_the_end_of_the_block():
    with closing_wrapped():
        entries = [packing._wrappers.get(object(), Closable) for _ in range(2)]
    assert [e.closes for e in entries] == [1, 1] and packing._wrappers.values() == []


def test_importing_the_drop_in_changes_nothing_in_megatron_lm():
    code = ("import trainer_client.megatron_lm, trainer_client.megatron_lm.enable\n"
            "import megatron.training.training as t\n"
            "print(t.wrap_data_iterator.__module__)")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["megatron.core.datasets.data_schedule"]
