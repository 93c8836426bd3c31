"""Putting a drop-in in a trainer's place: only on a trainer version it was checked against
(`VersionGate`, which also checks that the upstream names the drop-in calls outside the trainer's
public API are there), by replacing attributes of the trainer's modules that `Patches` can put back."""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

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


class Patches:
    """Attributes of a trainer's modules a drop-in replaces, each original kept once."""

    def __init__(self) -> None:
        self._originals: dict[tuple[str, str], Any] = {}

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

    def original(self, module_name: str, attribute: str) -> Any:
        """The value `module.attribute` held before the first `replace`; UsageError where it was never replaced."""
        try:
            return self._originals[(module_name, attribute)]
        except KeyError:
            patched = [f"{name}.{attr}" for name, attr in self._originals]
            raise UsageError(
                f"{module_name}.{attribute} was never replaced, so it has no original here; call replace() first "
                f"(replaced: {patched or 'nothing'})"
            ) from None

    def restore(self) -> None:
        """Puts every original back."""
        for (name, attribute), original in self._originals.items():
            setattr(importlib.import_module(name), attribute, original)
        self._originals.clear()
