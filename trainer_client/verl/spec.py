"""verl's drop-in as one object (`trainer_client.dropin.DropIn`), registered by the package."""

from __future__ import annotations

from trainer_client.dropin.spec import DropIn
from trainer_client.verl.refusals import REFUSALS
from trainer_client.verl.scheduler import DynamicCPScheduler
from trainer_client.verl.settings import verl_settings
from trainer_client.verl.switch import ENGINE_MODULE, GATE, VERL_MODULE, disable, enable

VERL = DropIn(
    refusals=REFUSALS,
    package="trainer_client.verl",
    settings=verl_settings,
    # Every rank holds the whole batch: the lengths for `client.plan`.
    readers=(DynamicCPScheduler._lengths,),
    hooks={f"{VERL_MODULE}:DynamicCPScheduler": DynamicCPScheduler, f"{ENGINE_MODULE}:DynamicCPScheduler": DynamicCPScheduler},
    gate=GATE,
    enable=enable,
    disable=disable,
)
