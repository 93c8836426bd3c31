"""The drop-in contract as one object (`DropIn`) and the registry of drop-ins: each drop-in registers
its own from its own package (`register_dropin`), which adds its part of the refusal table; `dropin`
looks one up by name. Registering enables nothing: a drop-in's `enable` does, when the trainer's user
calls it (docs/trainer-client.md, "Adding a drop-in")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from trainer_client.refusals.compatibility import TableSource, register_source
from trainer_client.dropin.derived import DerivedSettings
from trainer_client.dropin.patches import VersionGate
from trainer_client.errors import ArgumentTypeError, InvalidArgumentError, UsageError


@dataclass(frozen=True)
class DropIn:
    """What a drop-in provides, besides the seam it is built from: the five things a drop-in writes."""

    # Its part of the refusal table: its name (the source its own settings are handed to `check` under),
    # its words, its rows (reading that source) and its paths of the core rows' settings.
    refusals: TableSource
    # The package that provides it ("trainer_client.verl"): named when another registers the same name.
    package: str
    # Reads the trainer's config into the planner settings the trainer fixes.
    settings: Callable[..., DerivedSettings]
    # The trainer's batch in, a `LocalBatch` out (where every rank holds the whole batch, as verl's, the
    # lengths for `client.plan`): one per hook that reads the trainer's data.
    readers: tuple[Callable[..., Any], ...]
    # What stands in the trainer's place, by the upstream name it replaces ("module:attribute"); empty
    # for a drop-in the trainer's loop calls itself.
    hooks: Mapping[str, Any] = field(default_factory=dict)
    # The trainer releases it was checked against, and the private upstream names it calls; None: it
    # replaces nothing of the trainer's.
    gate: VersionGate | None = None
    # Puts the hooks in place behind the gate; called by the trainer's user, never at import or registration.
    enable: Callable[..., Any] | None = None
    # Puts the trainer's own back and closes the drop-in's clients.
    disable: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.refusals, TableSource):
            raise ArgumentTypeError(f"refusals: got a {type(self.refusals).__name__}; expected a trainer_client.refusals.compatibility.TableSource")
        object.__setattr__(self, "readers", tuple(self.readers))
        called = {"settings": self.settings, "enable": self.enable, "disable": self.disable,
                  **{f"readers[{i}]": reader for i, reader in enumerate(self.readers)}}
        for name, value in called.items():
            if value is not None and not callable(value):
                raise ArgumentTypeError(f"drop-in {self.name!r} {name}: {value!r} is not callable")
        odd = [target for target in self.hooks if not _is_upstream_name(target)]
        if odd:
            raise InvalidArgumentError(f"drop-in {self.name!r} hooks: {odd} are not upstream names; expected 'module:attribute'")
        if self.hooks and (self.gate is None or self.enable is None or self.disable is None):
            raise InvalidArgumentError(f"drop-in {self.name!r}: hooks need a version gate, `enable` and `disable` to put them in "
                                       "place and take them back")

    @property
    def name(self) -> str:
        return self.refusals.source


def _is_upstream_name(target: Any) -> bool:
    module, sep, attribute = target.partition(":") if isinstance(target, str) else ("", "", "")
    return bool(module and sep and attribute)


_DROP_INS: dict[str, DropIn] = {}


def register_dropin(spec: DropIn) -> DropIn:
    """Registers `spec` and adds its part to the refusal table, once per name: a name registered already
    raises UsageError naming it and the package that registered it. Returns `spec`."""
    if not isinstance(spec, DropIn):
        raise ArgumentTypeError(f"register_dropin: got a {type(spec).__name__}; expected a trainer_client.dropin.DropIn")
    if spec.name in _DROP_INS:
        raise UsageError(f"drop-in {spec.name!r} is registered already, by {_DROP_INS[spec.name].package}; "
                         f"{spec.package} must register its drop-in under a name of its own")
    register_source(spec.refusals, spec.package)
    _DROP_INS[spec.name] = spec
    return spec


def dropin(name: str) -> DropIn:
    """The drop-in registered as `name`; an unknown name raises InvalidArgumentError naming those registered."""
    if name not in _DROP_INS:
        raise InvalidArgumentError(f"unknown drop-in {name!r}; registered: {sorted(_DROP_INS)} (a drop-in is registered when "
                                   "its package is imported, e.g. import trainer_client.verl)")
    return _DROP_INS[name]


def registered_dropins() -> tuple[DropIn, ...]:
    """Every registered drop-in, in the order they were registered."""
    return tuple(_DROP_INS.values())
