"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contract (docs/megatron-lm.md). Two drop-ins, one per contract Megatron-LM's `training.py` uses:
`HybridCPDataLoaderWrapper` (0.19.x, `--hybrid-context-parallel`) and `wrap_data_iterator` (dev
branch, `--sequence-packing-scheduler default_dynamic_cp | dp_balanced`), each with Megatron-Core's
arguments and return values; each module here says its own concern.
"""

from trainer_client.megatron_lm.checks import DropInInputError, GlobalLayout, LocalBatch, check_packed_sample
from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import PackingDropIn, close_wrapped, last_planned_step, wrap_data_iterator
from trainer_client.megatron_lm.read_ahead import PlannedStep, StepPlanner
from trainer_client.megatron_lm.routing import Traffic, route_samples, sample_id_groups
from trainer_client.megatron_lm.settings import CONFIG_ENV, given_planner_settings, planner_config_for

__all__ = [
    "CONFIG_ENV", "DropInInputError", "GlobalLayout", "HybridCPDataLoaderWrapper", "LocalBatch",
    "PackingDropIn", "PlannedStep", "StepPlanner", "Traffic", "check_packed_sample", "close_wrapped",
    "given_planner_settings", "last_planned_step", "planner_config_for", "route_samples", "sample_id_groups",
    "wrap_data_iterator",
]
