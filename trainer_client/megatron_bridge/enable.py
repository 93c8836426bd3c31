"""Turning the drop-in on: `enable(cfg)` before `pretrain(cfg, forward_step)`, no edit of Bridge. It replaces
`get_forward_backward_func` and `make_data_iterator_list` in Bridge's train and eval modules, and `get_batch`
and `get_packed_seq_params` in `gpt_step` (Bridge's own would cut a planned unit again over the static CP
group and give its `PackedSeqParams` no CP group); `disable()` puts them back (docs/megatron-bridge.md, "What it
does in Bridge's loop", and the VPP row of "Pipeline, virtual pipeline, MTP, MoE and RoPE").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from trainer_client.plans import megatron as mcore
from trainer_client.service.config import PlannerClientConfig
from trainer_client.dropin.patches import Patches
from trainer_client.dropin.registry import Registry
from trainer_client.megatron_bridge.micro_batches import PlannedMicroBatches, PlannedPackedSeq, bridge_batch
from trainer_client.megatron_bridge.schedule import ChunkIterators, PlannedForwardBackward, PlannedIterator
from trainer_client.megatron_bridge.settings import BridgeSettings, check_bridge_support
from trainer_client.megatron_bridge.version import bridge_version, version_checked

log = logging.getLogger(__name__)

SCHEDULE_MODULES = ("megatron.bridge.training.train", "megatron.bridge.training.eval")
STEP_MODULE = "megatron.bridge.training.gpt_step"


@dataclass
class BridgeDropIn:
    """The drop-in in force: its settings and one read-ahead planner per Bridge data iterator."""

    settings: BridgeSettings
    planned: Registry[PlannedIterator] = field(default_factory=Registry)

    def planned_iterator(self, data_iterator: Any, num_microbatches: int, pg_collection: Any) -> PlannedIterator:
        return self.planned.get(
            data_iterator,
            lambda: PlannedIterator(data_iterator, num_microbatches, mcore.DataGroups.of(pg_collection), self.settings),
        )

    def close(self) -> None:
        self.planned.close()


_active: BridgeDropIn | None = None
_patches = Patches()


def enable(cfg: Any, planner: PlannerClientConfig | dict | None = None) -> bool:
    """Plans Bridge's training and evaluation steps (`cfg`: the `ConfigContainer` given to `pretrain`)
    through the batch planner. Refuses an unsupported combination here, before anything runs. Returns
    False (after one warning) and changes nothing on a Bridge version the drop-in was not checked against."""
    global _active
    if not version_checked():
        return False
    settings = BridgeSettings.of(cfg, planner)
    check_bridge_support(cfg, settings)
    disable()
    _active = BridgeDropIn(settings)
    for name in SCHEDULE_MODULES:
        original = _patches.replace(name, "get_forward_backward_func")
        _patches.replace(name, "get_forward_backward_func", _planned_getter(original))
        _patches.replace(name, "make_data_iterator_list", _chunk_iterators(_patches.replace(name, "make_data_iterator_list")))
    _patches.replace(STEP_MODULE, "get_batch", get_batch)
    _patches.replace(STEP_MODULE, "get_packed_seq_params", get_packed_seq_params)
    log.info("trainer_client.megatron_bridge: Megatron-Bridge %s plans %s steps through the batch planner",
             bridge_version(), settings.scheduler.value)
    return True


def active() -> BridgeDropIn | None:
    """The drop-in in force (its read-ahead planners, their last steps), or None."""
    return _active


def disable() -> None:
    """Puts Bridge's own functions back and closes the planner clients."""
    global _active
    _patches.restore()
    if _active is not None:
        _active.close()
        _active = None


def _planned_getter(original: Any) -> Any:
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return PlannedForwardBackward(original(*args, **kwargs), _active)

    return get_forward_backward_func


def _chunk_iterators(original: Any) -> Any:
    def make_data_iterator_list(model: Any, data_iterator: Any) -> Any:
        if not isinstance(model, list) or len(model) <= 1 or data_iterator is None:
            return original(model, data_iterator)
        return ChunkIterators(data_iterator, len(model), lambda: original(model, data_iterator))

    return make_data_iterator_list


def get_batch(data_iterator: Any, cfg: Any, use_mtp: bool = False, *, pg_collection: Any, vp_stage: Any = None):
    """Bridge's `gpt_step.get_batch`, except for the planned iterator: then the next planned unit,
    as Bridge's returns a batch (a forward step of one's own can call this too)."""
    if not isinstance(data_iterator, PlannedMicroBatches):
        original = _patches.original(STEP_MODULE, "get_batch")
        return original(data_iterator, cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage)
    return bridge_batch(next(data_iterator), data_iterator.device)


def get_packed_seq_params(metadata: Any) -> Any:
    """Bridge's `get_packed_seq_params`, except for a planned unit's metadata: then its own
    `PackedSeqParams`, with the unit's CP group."""
    if isinstance(metadata, PlannedPackedSeq):
        return metadata.params
    return _patches.original(STEP_MODULE, "get_packed_seq_params")(metadata)
