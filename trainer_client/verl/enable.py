"""The entry point for verl's hooks, which turn a user's module on by importing it by name:
`actor_rollout_ref.model.external_lib=trainer_client.verl.enable` (verl's `import_external_libs`) or
`VERL_USE_EXTERNAL_MODULES=trainer_client.verl.enable` (docs/verl.md, "Turning it on").

Importing this module is the explicit act of turning the drop-in on: it calls
`trainer_client.verl.switch.enable()`, and `enabled` holds its answer. It is the one module of the
trainer client that changes anything when imported; nothing imports it but such a hook. In code, call
`trainer_client.verl.switch.enable()` (or use `enabled()` as a context manager) instead.
"""

from __future__ import annotations

from trainer_client.verl.switch import CHECKED_VERL_VERSIONS, GATE, disable, enable

__all__ = ["CHECKED_VERL_VERSIONS", "GATE", "disable", "enable", "enabled"]

enabled = enable()
