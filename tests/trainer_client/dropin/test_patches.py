"""The seam's `Patches` and `VersionGate` (trainer_client/dropin/patches.py) on real modules: each test
writes its own small module into a fresh directory on sys.path and imports it by name, as a drop-in
reaches a trainer's modules. `Patches` replaces attributes, keeps each original once, puts every one
back, and names what it holds when asked for an original it never replaced; it hooks methods of a
trainer's classes (own, inherited, static and class methods) and puts each back as the class had it
(an inherited one inherited again). `VersionGate` passes a checked version silently and warns once,
from the drop-in's caller, on any other, and finds the upstream names each use of a drop-in needs,
refusing a use whose names are not all there."""

from __future__ import annotations

import itertools
import logging
import sys
import warnings

import pytest

from trainer_client.dropin import Patches, VersionGate
from trainer_client.errors import MissingUpstreamError, PlannerClientError, UsageError

_names = itertools.count()


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """Writes a module of `source` under a name no other test uses and returns that name (not imported)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(source: str) -> str:
        name = f"patch_target_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


TRAINER = "def step():\n    return 'trainer'\n\ndef read():\n    return 'read'\n\nLIMIT = 4\n"


def _patched(name: str):
    return lambda: f"patched {name}"


def test_replace_sets_the_attribute_and_returns_the_original(make_module):
    name = make_module(TRAINER)
    module = __import__(name)
    original_step = module.step
    patches = Patches()
    returned = patches.replace(name, "step", _patched("step"))
    assert returned is original_step
    assert module.step() == "patched step"
    assert patches.original(name, "step") is original_step


def test_replace_imports_the_module_it_names(make_module):
    name = make_module(TRAINER)
    assert name not in sys.modules
    Patches().replace(name, "step", _patched("step"))
    assert sys.modules[name].step() == "patched step"


def test_the_original_is_kept_once_when_patched_twice(make_module):
    name = make_module(TRAINER)
    module = __import__(name)
    first = module.step
    patches = Patches()
    patches.replace(name, "step", _patched("once"))
    returned = patches.replace(name, "step", _patched("twice"))
    assert returned is first, "the second replace returned the first patch, not the trainer's function"
    assert module.step() == "patched twice"
    assert patches.original(name, "step") is first
    patches.restore()
    assert module.step is first and module.step() == "trainer"


def test_replace_without_a_value_only_keeps_the_original(make_module):
    name = make_module(TRAINER)
    module = __import__(name)
    patches = Patches()
    assert patches.replace(name, "LIMIT") == 4
    assert module.LIMIT == 4
    module.LIMIT = 9  # changed by someone else after the drop-in kept it
    assert patches.original(name, "LIMIT") == 4
    patches.restore()
    assert module.LIMIT == 4


def test_restore_puts_every_original_back_across_modules(make_module):
    first, second = make_module(TRAINER), make_module(TRAINER)
    a, b = __import__(first), __import__(second)
    before = {(first, "step"): a.step, (first, "read"): a.read, (second, "step"): b.step, (second, "LIMIT"): b.LIMIT}
    patches = Patches()
    for (name, attribute) in before:
        patches.replace(name, attribute, _patched(f"{name}.{attribute}"))
    assert a.step() != "trainer" and b.LIMIT != 4
    patches.restore()
    after = {(first, "step"): a.step, (first, "read"): a.read, (second, "step"): b.step, (second, "LIMIT"): b.LIMIT}
    assert after == before
    with pytest.raises(UsageError, match="replaced: nothing"):
        patches.original(first, "step")  # restore forgets what it put back
    patches.restore()  # a second restore has nothing to put back and changes nothing
    assert a.step() == "trainer"


def test_the_original_of_something_never_replaced_is_refused_naming_both(make_module):
    name = make_module(TRAINER)
    patches = Patches()
    patches.replace(name, "step", _patched("step"))
    with pytest.raises(UsageError) as caught:
        patches.original(name, "read")
    message = str(caught.value)
    assert f"{name}.read was never replaced" in message and f"replaced: ['{name}.step']" in message, message
    assert isinstance(caught.value, PlannerClientError) and isinstance(caught.value, RuntimeError)
    assert not isinstance(caught.value, KeyError)
    with pytest.raises(UsageError, match=r"other_module\.step was never replaced"):
        patches.original("other_module", "step")


def test_if_loaded_leaves_a_module_that_is_not_imported_alone(make_module):
    name = make_module(TRAINER)
    patches = Patches()
    assert patches.replace(name, "step", _patched("step"), if_loaded=True) is None
    assert name not in sys.modules, "if_loaded imported the module"
    with pytest.raises(UsageError, match="replaced: nothing"):
        patches.original(name, "step")


def test_if_loaded_skips_an_attribute_the_loaded_module_lacks(make_module):
    name = make_module(TRAINER)
    module = __import__(name)
    patches = Patches()
    assert patches.replace(name, "not_there", _patched("x"), if_loaded=True) is None
    assert not hasattr(module, "not_there")
    assert patches.replace(name, "step", _patched("step"), if_loaded=True)() == "trainer"
    assert module.step() == "patched step"


def test_replacing_a_missing_attribute_keeps_nothing(make_module):
    name = make_module(TRAINER)
    patches = Patches()
    with pytest.raises(AttributeError, match="not_there"):
        patches.replace(name, "not_there", _patched("x"))
    assert not hasattr(sys.modules[name], "not_there")
    patches.restore()  # nothing kept: nothing to put back
    assert not hasattr(sys.modules[name], "not_there")


def _gate() -> VersionGate:
    return VersionGate(drop_in="tests.drop_in", trainer="TrainerX", checked=("1.2.0", "1.3.0"), unchanged="the trainer's loop runs as is")


def _enable(gate: VersionGate, version: str | None) -> bool:
    """A drop-in's enable(): VersionGate warns from the caller of this function (stacklevel)."""
    return gate.allows(version)


def test_a_checked_version_passes_without_a_warning(caplog):
    gate = _gate()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        assert _enable(gate, "1.2.0") and _enable(gate, "1.3.0")
    assert caught == [] and caplog.records == []
    assert gate.warned is False


def test_an_unchecked_version_warns_once_and_is_refused_every_time(caplog):
    gate = _gate()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        results = [_enable(gate, "1.4.0rc1"), _enable(gate, "1.4.0rc1"), _enable(gate, "0.9")]
    assert results == [False, False, False]
    assert len(caught) == 1 and caught[0].category is RuntimeWarning, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for part in ("tests.drop_in", "TrainerX 1.4.0rc1", "['1.2.0', '1.3.0']", "the trainer's loop runs as is", "nothing is changed"):
        assert part in message, (part, message)
    assert caught[0].filename == __file__, "the warning does not point at the drop-in's caller"
    assert [r.getMessage() for r in caplog.records if r.name == "trainer_client.dropin.patches"] == [message]
    # A checked version still passes after the warning.
    assert _enable(gate, "1.3.0") is True


def test_a_trainer_that_is_not_installed_is_named_so():
    gate = _gate()
    with pytest.warns(RuntimeWarning, match="TrainerX not installed is not a version"):
        assert _enable(gate, None) is False


def test_a_version_that_only_looks_like_a_checked_one_is_refused():
    gate = _gate()
    with pytest.warns(RuntimeWarning):
        assert [_enable(gate, v) for v in ("1.2", "1.2.0 ", "1.2.0+local", "v1.2.0")] == [False] * 4


def test_behind_the_gate_an_unchecked_version_changes_nothing(make_module):
    """How a drop-in uses the two (its enable()): patches only where the gate allows."""
    name = make_module(TRAINER)
    module = __import__(name)
    original = module.step
    for version, patched in (("2.0", False), ("1.2.0", True)):
        gate, patches = _gate(), Patches()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if _enable(gate, version):
                patches.replace(name, "step", _patched("step"))
        assert (module.step is not original) is patched, version
        patches.restore()
        assert module.step is original


# The upstream names a drop-in calls outside the trainer's public API, per use.
UPSTREAM = "def _cut(batch):\n    return batch\n\nclass Wrapper:\n    def unpack(self, batch):\n        return batch\n"


def _gate_needing(module: str) -> VersionGate:
    return VersionGate("tests.drop_in", "TrainerX", ("1.2.0",), "the trainer's loop runs as is", needs={
        "wrap": (f"{module}:_cut", f"{module}:_gone"),
        "hybrid": (f"{module}:Wrapper.unpack",),
        "other": ("no_such_module_anywhere:_f",),
    })


def test_the_gate_finds_the_private_names_each_use_needs(make_module):
    name = make_module(UPSTREAM)
    gate = _gate_needing(name)
    assert gate.missing("hybrid") == []
    assert gate.missing("wrap") == [f"{name}:_gone"]
    assert gate.missing("other") == ["no_such_module_anywhere:_f"]  # a module that does not import lacks them all
    assert gate.missing() == [f"{name}:_gone", "no_such_module_anywhere:_f"]
    gate.require("hybrid")  # all there: nothing to refuse
    with pytest.raises(UsageError, match=r"no use named 'typo'.*\['hybrid', 'other', 'wrap'\]"):
        gate.missing("typo")


def test_a_build_lacking_a_private_name_is_refused_naming_it(make_module):
    name = make_module(UPSTREAM)
    with pytest.raises(MissingUpstreamError) as refused:
        _gate_needing(name).require("wrap", "1.2.0")
    message = str(refused.value)
    assert f"wrap calls TrainerX's {name}:_gone, which the installed build (1.2.0) lacks" in message, message
    assert "checked: ['1.2.0']" in message and f"{name}:_cut" not in message
    assert refused.value.missing == (f"{name}:_gone",)
    assert isinstance(refused.value, ImportError) and isinstance(refused.value, PlannerClientError)


def test_an_unchecked_version_names_the_missing_private_names_in_its_warning(make_module):
    name = make_module(UPSTREAM)
    gate = _gate_needing(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _enable(gate, "2.0.0") is False
    message = str(caught[0].message)
    assert "TrainerX 2.0.0 is not a version this drop-in was checked against" in message
    assert f"this build lacks ['{name}:_gone', 'no_such_module_anywhere:_f'], which the drop-in calls" in message, message


# A trainer's classes, as a torchtitan- or Hugging Face-style loop has them: methods a drop-in hooks.
CLASSES = """
class Base:
    def train_step(self, batch):
        return f"base step {batch}"

    @staticmethod
    def loss(x):
        return f"loss {x}"

    @classmethod
    def build(cls):
        return f"built {cls.__name__}"

class Trainer(Base):
    def __init__(self):
        self.steps = 0

    def training_step(self, batch):
        self.steps += 1
        return f"trainer step {batch}"
"""


def _hook(patches: Patches, owner, name: str):
    """A drop-in's hook: it calls the trainer's own method through `original`, with the instance first."""

    def hooked(self, batch):
        return "hooked " + patches.original(owner, name)(self, batch)

    return hooked


def test_a_method_is_hooked_on_every_instance_and_restored(make_module):
    module = __import__(make_module(CLASSES))
    trainer, own = module.Trainer(), module.Trainer.__dict__["training_step"]
    patches = Patches()
    returned = patches.replace_method(module.Trainer, "training_step", _hook(patches, module.Trainer, "training_step"))
    assert returned is own and patches.original(module.Trainer, "training_step") is own
    assert trainer.training_step(3) == "hooked trainer step 3" and trainer.steps == 1  # the original ran on the instance
    assert module.Trainer().training_step(4) == "hooked trainer step 4", "an instance made after the hook"
    patches.restore()
    assert module.Trainer.__dict__["training_step"] is own and trainer.training_step(5) == "trainer step 5"
    with pytest.raises(UsageError, match="replaced: nothing"):
        patches.original(module.Trainer, "training_step")


def test_an_inherited_method_is_hooked_on_the_subclass_alone_and_inheritance_resumes(make_module):
    module = __import__(make_module(CLASSES))
    base_step = module.Base.__dict__["train_step"]
    patches = Patches()
    assert patches.replace_method(module.Trainer, "train_step", _hook(patches, module.Trainer, "train_step")) is base_step
    assert module.Trainer().train_step(1) == "hooked base step 1"
    assert module.Base().train_step(1) == "base step 1" and module.Base.__dict__["train_step"] is base_step
    patches.restore()
    assert "train_step" not in module.Trainer.__dict__, "restore left a copy of the base's method on the subclass"
    module.Base.train_step = lambda self, batch: f"new base {batch}"  # a later change of the base reaches the subclass again
    assert module.Trainer().train_step(2) == "new base 2"


def test_static_and_class_methods_are_put_back_as_they_were(make_module):
    module = __import__(make_module(CLASSES))
    patches = Patches()
    loss = patches.replace_method(module.Base, "loss", lambda x: "hooked " + patches.original(module.Base, "loss")(x))
    build = patches.replace_method(module.Base, "build", classmethod(lambda cls: "hooked " + patches.original(module.Base, "build")()))
    assert loss(1) == "loss 1" and build() == "built Base"  # the originals as the class gives them: callable as they are
    assert module.Base.loss(2) == "hooked loss 2" and module.Trainer.build() == "hooked built Base"
    patches.restore()
    assert isinstance(module.Base.__dict__["loss"], staticmethod) and isinstance(module.Base.__dict__["build"], classmethod)
    assert module.Trainer().loss(3) == "loss 3" and module.Trainer.build() == "built Trainer"


def test_a_method_hooked_twice_keeps_the_trainers_own(make_module):
    module = __import__(make_module(CLASSES))
    own = module.Trainer.__dict__["training_step"]
    patches = Patches()
    patches.replace_method(module.Trainer, "training_step", lambda self, batch: "once")
    assert patches.replace_method(module.Trainer, "training_step", lambda self, batch: "twice") is own
    assert module.Trainer().training_step(0) == "twice"
    patches.restore()
    assert module.Trainer.__dict__["training_step"] is own


def test_modules_and_classes_restore_together(make_module):
    name = make_module(TRAINER)
    trainer_module, module = __import__(name), __import__(make_module(CLASSES))
    step, own = trainer_module.step, module.Trainer.__dict__["training_step"]
    patches = Patches()
    patches.replace(name, "step", _patched("step"))
    patches.replace_method(module.Trainer, "training_step", lambda self, batch: "hooked")
    with pytest.raises(UsageError) as caught:
        patches.original(module.Trainer, "train_step")
    message = str(caught.value)
    assert f"{module.__name__}.Trainer.train_step was never replaced" in message, message
    assert f"replaced: ['{name}.step', '{module.__name__}.Trainer.training_step']" in message, message
    patches.restore()
    assert trainer_module.step is step and module.Trainer.__dict__["training_step"] is own


def test_a_hook_that_cannot_be_set_is_refused_naming_what_is_allowed(make_module):
    module = __import__(make_module(CLASSES))
    patches = Patches()
    with pytest.raises(UsageError, match=r"owner <.*Trainer object.*> is not allowed; allowed: a class"):
        patches.replace_method(module.Trainer(), "training_step", lambda self, batch: None)
    with pytest.raises(UsageError, match=r"Trainer has no method 'train_stpe' to hook; its methods: \['build', 'loss', 'train_step', 'training_step'\]"):
        patches.replace_method(module.Trainer, "train_stpe", lambda self, batch: None)
    with pytest.raises(UsageError, match=r"hook for .*Trainer.training_step is a str; allowed: a callable, a staticmethod"):
        patches.replace_method(module.Trainer, "training_step", "not a function")
    patches.restore()  # nothing was kept: nothing to put back
    assert module.Trainer().training_step(1) == "trainer step 1"
