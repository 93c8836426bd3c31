"""Dynamic CP for Megatron-Bridge: the batch planner behind Bridge's own training loop
(docs/megatron-bridge.md). One call before `pretrain`, no edit of Bridge:

    from trainer_client.megatron_bridge import enable
    enable(cfg, planner={"planner_endpoint": "dns:///planner-headless:50051"})
    pretrain(cfg, forward_step)
"""

from trainer_client.refusals.compatibility import rules_of
from trainer_client.dropin.spec import register_dropin
from trainer_client.megatron_bridge.enable import active, disable, enable, get_batch, get_packed_seq_params
from trainer_client.megatron_bridge.micro_batches import TOKEN_FIELDS, PlannedMicroBatches, unpack_micro_batch
from trainer_client.megatron_bridge.refusals import BRIDGE_SCHEDULERS
from trainer_client.megatron_bridge.schedule import PlannedForwardBackward, PlannedIterator
from trainer_client.megatron_bridge.settings import BridgeSettings, check_bridge_support
from trainer_client.megatron_bridge.spec import BRIDGE
from trainer_client.megatron_bridge.version import CHECKED_BRIDGE_VERSIONS, bridge_version

__all__ = [
    "BRIDGE", "BRIDGE_RULES", "BRIDGE_SCHEDULERS", "CHECKED_BRIDGE_VERSIONS", "TOKEN_FIELDS", "BridgeSettings",
    "PlannedForwardBackward", "PlannedIterator", "PlannedMicroBatches", "active", "bridge_version", "check_bridge_support",
    "disable", "enable", "get_batch", "get_packed_seq_params", "unpack_micro_batch",
]

# Its part of the refusal table, so that `check` knows the `bridge` source once this package is imported
# (this registration enables nothing: `enable` does).
register_dropin(BRIDGE)
# The rows of the table that read Bridge's ConfigContainer, or apply to Bridge alone.
BRIDGE_RULES = rules_of(BRIDGE.name)
