"""The batch planner behind verl's Megatron engine (verl 0.9's dynamic context parallelism): docs/verl.md.
Importing this package changes nothing in verl: `trainer_client.verl.switch.enable()` does, or verl's
hook naming the entry point `trainer_client.verl.enable`.
"""

from trainer_client.dropin.spec import register_dropin
from trainer_client.verl.planning import close_planners, closing_planners, planners
from trainer_client.verl.refusals import VERL_SCHEDULERS
from trainer_client.verl.scheduler import DynamicCPScheduler
from trainer_client.verl.settings import ENDPOINT_ENV
from trainer_client.verl.spec import VERL

__all__ = ["DynamicCPScheduler", "ENDPOINT_ENV", "VERL", "VERL_SCHEDULERS", "close_planners", "closing_planners", "planners"]

# Its part of the refusal table, so that `check` knows the `verl` source once this package is imported
# (this registration enables nothing: `switch.enable()` does, or verl's hook naming `trainer_client.verl.enable`).
register_dropin(VERL)
