"""Megatron-Bridge's drop-in as one object (`trainer_client.dropin.DropIn`), registered by the package."""

from __future__ import annotations

from trainer_client.dropin.settings import planner_settings_of
from trainer_client.dropin.spec import DropIn
from trainer_client.megatron_bridge.enable import SCHEDULE_MODULES, STEP_MODULE, disable, enable, get_batch, get_packed_seq_params
from trainer_client.megatron_bridge.micro_batches import read_local_batch
from trainer_client.megatron_bridge.refusals import REFUSALS
from trainer_client.megatron_bridge.schedule import ChunkIterators, PlannedForwardBackward
from trainer_client.megatron_bridge.version import GATE

BRIDGE = DropIn(
    refusals=REFUSALS,
    package="trainer_client.megatron_bridge",
    settings=planner_settings_of,
    readers=(read_local_batch,),
    hooks={
        **{f"{module}:get_forward_backward_func": PlannedForwardBackward for module in SCHEDULE_MODULES},
        **{f"{module}:make_data_iterator_list": ChunkIterators for module in SCHEDULE_MODULES},
        f"{STEP_MODULE}:get_batch": get_batch,
        f"{STEP_MODULE}:get_packed_seq_params": get_packed_seq_params,
    },
    gate=GATE,
    enable=enable,
    disable=disable,
)
