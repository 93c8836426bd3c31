"""Importing this module makes verl's Megatron engine plan through the batch planner: it replaces verl's
`DynamicCPScheduler`, on the verl versions it was checked against (docs/verl.md, "Turning it on").
"""

from __future__ import annotations

import logging

from trainer_client.dropin.patches import Patches, VersionGate

log = logging.getLogger(__name__)

# verl releases whose DynamicCPScheduler contract (constructor, schedule(), the micro-batches'
# keys) this drop-in was tested against (the CI leg `./dev test-verl`).
CHECKED_VERL_VERSIONS = ("0.9.1",)
VERL_MODULE = "verl.utils.dynamic_cp_scheduler"
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
GATE = VersionGate("trainer_client.verl", "verl", CHECKED_VERL_VERSIONS, "verl's own DynamicCPScheduler stays in place")
_patches = Patches()


def enable() -> bool:
    """Puts the drop-in in place; True when it did, False (after saying why) when it did not."""
    import verl

    version = getattr(verl, "__version__", "unknown")
    if not GATE.allows(version):
        return False
    from trainer_client.verl.scheduler import DynamicCPScheduler

    _patches.replace(VERL_MODULE, "DynamicCPScheduler", DynamicCPScheduler)
    _patches.replace(ENGINE_MODULE, "DynamicCPScheduler", DynamicCPScheduler, if_loaded=True)
    log.info("trainer_client.verl: verl %s's DynamicCPScheduler plans through the batch planner", version)
    return True


def disable() -> None:
    """Puts verl's own class back (tests)."""
    _patches.restore()


enabled = enable()
