"""The batch planner behind verl's Megatron engine (verl 0.9's dynamic context parallelism).

- `DynamicCPScheduler` (trainer_client/verl/scheduler.py): verl's class, planned by the service;
- `trainer_client.verl.enable`: the module verl's `external_lib` hook loads to put it in place;
- `prefetch` plans a rollout batch's mini-batches at once; plans are cached per mini-batch.

Importing this package changes nothing in verl; importing `trainer_client.verl.enable` does.
docs/verl.md has the configuration lines.
"""

from trainer_client.verl.planning import close_planners, planners
from trainer_client.verl.scheduler import DynamicCPScheduler
from trainer_client.verl.settings import ENDPOINT_ENV, VERL_SCHEDULERS

__all__ = ["DynamicCPScheduler", "ENDPOINT_ENV", "VERL_SCHEDULERS", "close_planners", "planners"]
