"""Dynamic CP for Megatron-Bridge: the batch planner behind Bridge's own training loop
(docs/megatron-bridge.md). One call before `pretrain`, no edit of Bridge:

    from trainer_client.megatron_bridge import enable
    enable(cfg, planner={"planner_endpoint": "dns:///planner-headless:50051"})
    pretrain(cfg, forward_step)
"""

from trainer_client.megatron_bridge.enable import active, disable, enable, get_batch, get_packed_seq_params
from trainer_client.megatron_bridge.micro_batches import TOKEN_FIELDS, PlannedMicroBatches, unpack_micro_batch
from trainer_client.megatron_bridge.schedule import PlannedForwardBackward, PlannedIterator
from trainer_client.megatron_bridge.settings import BRIDGE_RULES, BridgeSettings, check_bridge_support
from trainer_client.megatron_bridge.version import CHECKED_BRIDGE_VERSIONS, bridge_version

__all__ = [
    "BRIDGE_RULES", "CHECKED_BRIDGE_VERSIONS", "TOKEN_FIELDS", "BridgeSettings", "PlannedForwardBackward",
    "PlannedIterator", "PlannedMicroBatches", "active", "bridge_version", "check_bridge_support", "disable",
    "enable", "get_batch", "get_packed_seq_params", "unpack_micro_batch",
]
