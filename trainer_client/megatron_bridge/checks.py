"""The one call that refuses every combination the drop-in cannot honour in Bridge's loop.

`check_bridge_support(cfg, settings)` runs once, in `enable()`, before Bridge initialises anything:
no refusal ever comes halfway through training. It applies the one refusal table
(trainer_client/compatibility.py, `RULES`) to Bridge's `ConfigContainer` (the rows that name its
paths: `BRIDGE_RULES`), its model config (the rules every dynamic-CP trainer shares: per-token loss,
CUDA graphs, FP8, the planner's sizes against the model's, ...) and the planner settings. Each
refusal is an `UnsupportedCombinationError` naming the setting (by its path in the
`ConfigContainer` for Bridge's rows), its value and what to do; docs/megatron-bridge.md lists
`BRIDGE_RULES` (a test keeps the two equal).
"""

from __future__ import annotations

from typing import Any

from trainer_client.compatibility import RULES, check

# The rows of the one table that read Bridge's ConfigContainer, or apply to Bridge alone.
BRIDGE_RULES = tuple(rule for rule in RULES if rule.reads("bridge"))


def check_bridge_support(cfg: Any, settings: Any) -> None:
    """Raises UnsupportedCombinationError for the first combination the drop-in cannot run."""
    check({"bridge": cfg, "transformer": cfg.model, "model": cfg.model, "planner config": settings.planner})
