"""What Megatron-LM's drop-ins check once, before the first step: the model they plan for, against
the refusal table's `megatron_lm` rows (trainer_client/compatibility.py)."""

from __future__ import annotations

from typing import Any

from trainer_client.compatibility import check
from trainer_client.config import PlannerClientConfig


def check_model(config: Any, planner_config: PlannerClientConfig) -> None:
    """UnsupportedCombinationError for a model the drop-in's plans would train wrong on the installed
    Megatron-Core (RoPE on 0.19 with CP groups other than the static one)."""
    check({"megatron_lm": {"position_embedding_type": position_embedding_type(config)}, "planner config": planner_config})


def position_embedding_type(config: Any) -> str | None:
    """The model's position embedding: the config's own attribute where it has one, else
    Megatron-LM's `--position-embedding-type` (its training loop's parsed arguments); None where
    neither is known."""
    value = getattr(config, "position_embedding_type", None)
    if value is not None:
        return value
    try:
        from megatron.training.global_vars import get_args
    except ImportError:  # Megatron-Core alone, without Megatron-LM's training package
        return None
    try:
        return getattr(get_args(), "position_embedding_type", None)
    except AssertionError:  # Megatron-LM's arguments are not parsed in this process
        return None
