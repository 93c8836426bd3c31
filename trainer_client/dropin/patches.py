"""Putting a drop-in in a trainer's place: only on a trainer version it was checked against
(`VersionGate`, which also checks that the upstream names the drop-in calls outside the trainer's
public API are there), by replacing attributes of the trainer's modules, or methods of its classes,
that `Patches` can put back."""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer_client.errors import MissingUpstreamError, UsageError

log = logging.getLogger(__name__)


@dataclass
class VersionGate:
    """The trainer releases a drop-in was checked against (its CI leg); on any other it warns once
    and changes nothing.

    `needs`: per use of the drop-in (e.g. the upstream name it stands in for), the upstream names that
    use calls outside the trainer's public API, as "module:attribute[.attribute]" (private functions
    such as `data_schedule_utils:_unpack_batch`). A later build may drop or rename them at any commit,
    so `missing` looks each one up and `require` refuses a use whose names are not all there, with a
    `MissingUpstreamError` naming each one; on an unchecked version `allows` names them in its warning."""

    drop_in: str  # the drop-in's package, e.g. "trainer_client.verl"
    trainer: str  # the trainer's name in messages
    checked: tuple[str, ...]
    unchanged: str  # what stays as it is, in words
    warned: bool = False
    needs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def allows(self, version: str | None) -> bool:
        if version not in self.checked and not self.warned:
            self.warned = True
            gone = self.missing()
            lacking = f"; this build lacks {gone}, which the drop-in calls" if gone else ""
            message = (f"{self.drop_in}: {self.trainer} {version or 'not installed'} is not a version this drop-in was checked against "
                       f"(checked: {list(self.checked)}){lacking}; {self.unchanged}, nothing is changed")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return version in self.checked

    def missing(self, use: str | None = None) -> list[str]:
        """The names `use` needs (None: every use's) that the installed trainer lacks, as written in `needs`."""
        if use is not None and use not in self.needs:
            raise UsageError(f"{self.drop_in}: no use named {use!r} in the version gate (its uses: {sorted(self.needs)})")
        wanted = self.needs[use] if use is not None else [n for names in self.needs.values() for n in names]
        return [name for name in dict.fromkeys(wanted) if not _found(name)]

    def require(self, use: str, version: str | None = None) -> None:
        """MissingUpstreamError naming every upstream name `use` needs that the installed trainer lacks."""
        gone = self.missing(use)
        if gone:
            raise MissingUpstreamError(
                f"{self.drop_in}: {use} calls {self.trainer}'s {', '.join(gone)}, which the installed build"
                f"{f' ({version})' if version else ''} lacks (checked: {list(self.checked)}); install a checked "
                f"version, or use {self.trainer}'s own {use}", missing=gone,
            )


def _found(name: str) -> bool:
    """Whether "module:attribute[.attribute]" resolves; a module that does not import (missing, or
    failing as it imports) counts as lacking."""
    module_name, _, path = name.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - whatever stops the import, the name is not there to call
        return False
    for part in path.split(".") if path else ():
        if not hasattr(found, part):
            return False
        found = getattr(found, part)
    return True


# Where a replaced attribute lives: a module, by name, or a class.
Target = str | type
_INHERITED = object()  # a class's own dict lacked the method: restore deletes the hook, so inheritance resumes


class Patches:
    """What a drop-in replaces in a trainer, each original kept once: attributes of its modules
    (`replace`) and methods of its classes (`replace_method`, e.g. a `Trainer.train_step`)."""

    def __init__(self) -> None:
        self._originals: dict[tuple[Target, str], Any] = {}  # what `original` hands back
        self._own: dict[tuple[type, str], Any] = {}  # a class's own attribute before its hook, or _INHERITED

    def replace(self, module_name: str, attribute: str, value: Any = None, *, if_loaded: bool = False) -> Any:
        """Sets `module.attribute` to `value` (None: only keeps the original); returns the original.
        `if_loaded`: only where the module is imported already and has the attribute (else None)."""
        if if_loaded and not hasattr(sys.modules.get(module_name), attribute):
            return None
        module = importlib.import_module(module_name)
        original = self._originals.setdefault((module_name, attribute), getattr(module, attribute))
        if value is not None:
            setattr(module, attribute, value)
        return original

    def replace_method(self, owner: type, name: str, hook: Callable[..., Any]) -> Any:
        """Sets the method `owner.name` (its own, or one it inherits) to `hook`; returns the original
        as the class gives it (a plain method's function: call it with the instance first). Every
        instance and subclass that does not override it calls the hook; `restore` puts the class's
        own attribute back, or removes the hook where the method was inherited."""
        if not isinstance(owner, type):
            raise UsageError(f"replace_method: owner {owner!r} is not allowed; allowed: a class (e.g. the trainer's Trainer)")
        if not (callable(hook) or isinstance(hook, (staticmethod, classmethod))):
            raise UsageError(f"replace_method: hook for {_name(owner)}.{name} is a {type(hook).__name__}; "
                             "allowed: a callable, a staticmethod or a classmethod")
        if not hasattr(owner, name):
            methods = sorted(n for n in dir(owner) if not n.startswith("__") and callable(getattr(owner, n, None)))
            raise UsageError(f"replace_method: {_name(owner)} has no method {name!r} to hook; its methods: {methods}")
        original = self._originals.setdefault((owner, name), getattr(owner, name))
        self._own.setdefault((owner, name), owner.__dict__.get(name, _INHERITED))
        setattr(owner, name, hook)
        return original

    def original(self, target: Target, attribute: str) -> Any:
        """What `target.attribute` was before the first `replace` or `replace_method` (`target`: the
        module's name or the class); UsageError where it was never replaced."""
        try:
            return self._originals[(target, attribute)]
        except (KeyError, TypeError):
            patched = [f"{_name(where)}.{attr}" for where, attr in self._originals]
            raise UsageError(
                f"{_name(target)}.{attribute} was never replaced, so it has no original here; call replace() or "
                f"replace_method() first (replaced: {patched or 'nothing'})"
            ) from None

    def restore(self) -> None:
        """Puts every original back, the last replaced first."""
        for (target, attribute), original in reversed(self._originals.items()):
            if isinstance(target, str):
                setattr(importlib.import_module(target), attribute, original)
            elif self._own[(target, attribute)] is _INHERITED:
                delattr(target, attribute)
            else:
                setattr(target, attribute, self._own[(target, attribute)])
        self._originals.clear()
        self._own.clear()


def _name(target: Any) -> str:
    """A module's name, or a class's module and name, as messages show them."""
    return f"{target.__module__}.{target.__qualname__}" if isinstance(target, type) else str(target)
