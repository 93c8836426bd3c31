"""Putting a drop-in in a trainer's place: only on a trainer version it was checked against
(`VersionGate`), by replacing attributes of the trainer's modules that `Patches` can put back."""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from trainer_client.errors import UsageError

log = logging.getLogger(__name__)


@dataclass
class VersionGate:
    """The trainer releases a drop-in was checked against (its CI leg); on any other it warns once
    and changes nothing."""

    drop_in: str  # the drop-in's package, e.g. "trainer_client.verl"
    trainer: str  # the trainer's name in messages
    checked: tuple[str, ...]
    unchanged: str  # what stays as it is, in words
    warned: bool = False

    def allows(self, version: str | None) -> bool:
        if version not in self.checked and not self.warned:
            self.warned = True
            message = (f"{self.drop_in}: {self.trainer} {version or 'not installed'} is not a version this drop-in was checked against "
                       f"(checked: {list(self.checked)}); {self.unchanged}, nothing is changed")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return version in self.checked


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
