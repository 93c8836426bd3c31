"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contract.

Two drop-ins, one for each contract Megatron-LM's `training.py` uses:

- `HybridCPDataLoaderWrapper(data_iterator, config, pg_collection=None)` (0.19.x,
  `--hybrid-context-parallel`): same constructor arguments as Megatron-Core's class, and each
  `next()` yields the same `(samples_this_rank_with_id, sample_id_groups)` that
  `hybrid_context_parallel_forward_backward` consumes.
- `wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None)` (dev branch,
  `--sequence-packing-scheduler default_dynamic_cp | dp_balanced`): same arguments and the same
  return value, `(packed THD micro-batch iterator, number of micro-batches, sum of sequence lengths,
  sum of squared sequence lengths)`.

What changes against Megatron-Core's wrappers: the schedule comes from the batch planner
(`BatchPlannerClient`: planned one step ahead, one rank asks, every rank checks it holds the same
plan for the same batch, in-process fallback with the same Megatron-Core scheduler when the
service fails) instead of every rank running the scheduler on the step's critical path. The data
path is Megatron-Core's: the same unpacking of packed samples (its own helpers), the same global
sample ids (DP rank order), the same packing into THD micro-batches (its own helpers). Samples
move with one all-to-all per field inside the DP group, so each rank receives exactly the samples
it runs and no rank ever holds the global batch.

Bad input is raised on every rank of the DPxCP group at the step that holds it (`checks`); a
sample longer than the DPxCP group can hold is refused by the planner (`PlanRejectedError`).

Planner settings: `planner=` (a `PlannerClientConfig` or dict), else the YAML file named by
`$BATCH_PLANNER_CONFIG` (section `batch_planner`), else in-process planning only. The sizes and the
scheduler come from Megatron's own config (see docs/megatron-lm.md).

The modules, one concern each: `settings` (the planner settings), `checks` (one step's input,
checked and agreed over the DPxCP group), `routing` (the plan in Megatron-Core's shape, the
all-to-all), `read_ahead` (the step planner one global batch ahead), and the two drop-ins,
`hybrid_cp` and `packing`.
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
