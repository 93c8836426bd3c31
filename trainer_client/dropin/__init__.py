"""The drop-in core: what every trainer drop-in (Megatron-LM, Megatron-Bridge, verl) shares, on top
of `BatchPlannerClient`. A drop-in imports this package and `trainer_client`; no drop-in imports another (the
import-linter contract in pyproject.toml). docs/trainer-client.md, "Adding a drop-in", is the recipe.
"""

from trainer_client.dropin.device import data_device
from trainer_client.dropin.routing import Traffic, route_samples, sample_id_groups
from trainer_client.dropin.settings import (
    CONFIG_ENV,
    PACKING_SCHEDULERS,
    client_for,
    given_planner_settings,
    merged_settings,
    planner_config_for,
)
from trainer_client.dropin.step_input import (
    GlobalLayout,
    LocalBatch,
    agree_on_read,
    agree_on_step,
    check_packed_sample,
    raise_on_bad_packed_sample,
)
from trainer_client.dropin.step_planner import Agreement, PlannedStep, StepPlanner
from trainer_client.errors import DropInInputError

__all__ = [
    "Agreement", "CONFIG_ENV", "DropInInputError", "GlobalLayout", "LocalBatch", "PACKING_SCHEDULERS", "PlannedStep", "StepPlanner",
    "Traffic", "agree_on_read", "agree_on_step", "check_packed_sample", "client_for", "data_device",
    "given_planner_settings", "merged_settings", "planner_config_for", "raise_on_bad_packed_sample", "route_samples",
    "sample_id_groups",
]
