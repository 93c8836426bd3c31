"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contract (docs/megatron-lm.md says how to use it and what changes against Megatron-Core's wrappers).

Two drop-ins, one for each contract Megatron-LM's `training.py` uses: `HybridCPDataLoaderWrapper`
(0.19.x, `--hybrid-context-parallel`) and `wrap_data_iterator` (dev branch,
`--sequence-packing-scheduler default_dynamic_cp | dp_balanced`), each with Megatron-Core's
arguments and return values. The modules, one concern each: `settings` (the planner settings),
`checks` (one step's input, checked and agreed over the DPxCP group), `routing` (the plan in
Megatron-Core's shape, the all-to-all), `read_ahead` (the step planner one global batch ahead), and
the two drop-ins, `hybrid_cp` and `packing`.
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
