"""What Megatron-LM's drop-ins check once, before the first step: the model they plan for, against
the refusal table's `megatron_lm` rows (trainer_client/compatibility.py)."""

from __future__ import annotations

from typing import Any

from trainer_client.compatibility import check
from trainer_client.config import PlannerClientConfig


def check_model(config: Any, planner_config: PlannerClientConfig) -> None:
    """UnsupportedCombinationError for a model the drop-in's plans would train wrong on the installed
    Megatron-Core (RoPE or MTP on 0.19 with CP groups other than the static one)."""
    model = {name: model_setting(config, name) for name in MODEL_SETTINGS}
    check({"megatron_lm": model, "planner config": planner_config})


# The model's settings the `megatron_lm` rows read.
MODEL_SETTINGS = ("position_embedding_type", "mtp_num_layers")


def model_setting(config: Any, name: str) -> Any:
    """A model setting: the config's own attribute where it has one, else Megatron-LM's argument of
    that name (its training loop's parsed arguments, e.g. `--position-embedding-type`); None where
    neither is known."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    try:
        from megatron.training.global_vars import get_args
    except ImportError:  # Megatron-Core alone, without Megatron-LM's training package
        return None
    try:
        return getattr(get_args(), name, None)
    except AssertionError:  # Megatron-LM's arguments are not parsed in this process
        return None
