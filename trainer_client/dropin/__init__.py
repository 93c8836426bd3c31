"""The drop-in core: what every trainer drop-in (Megatron-LM, Megatron-Bridge, verl) shares, on top
of `BatchPlannerClient`. One concern per module:

- `settings`: the planner settings a drop-in is given, merged with the sizes the trainer runs;
- `step_input`: one step's local batch, read and checked, its global layout agreed by all ranks;
- `step_planner`: read one step ahead, plan it while the current one trains, route its samples;
- `routing`: the plan in Megatron-Core's `sample_id_groups` shape, and moving each sample to the
  ranks that run it;
- `device`: where a drop-in's tensors live.

A drop-in imports this package and `trainer_client`; no drop-in imports another (the
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
