"""The one call that refuses every combination the drop-in cannot honour in Bridge's loop, once, in
`enable()`, before Bridge initialises anything (docs/megatron-bridge.md, "What is refused, before the first step").
"""

from __future__ import annotations

from typing import Any

from trainer_client.compatibility import RULES, check

# The rows of the one table that read Bridge's ConfigContainer, or apply to Bridge alone.
BRIDGE_RULES = tuple(rule for rule in RULES if rule.reads("bridge"))


def check_bridge_support(cfg: Any, settings: Any) -> None:
    """Raises UnsupportedCombinationError for the first combination the drop-in cannot run."""
    check({"bridge": cfg, "transformer": cfg.model, "model": cfg.model, "planner config": settings.planner})
