"""Putting the drop-in in verl's place, by an explicit call: `enable()` replaces verl's
`DynamicCPScheduler` on the verl versions it was checked against, `disable()` puts verl's own back and
closes the planner clients. Importing this module changes nothing; verl's hooks, which can only import
a module by name, import `trainer_client.verl.enable`, the entry point that calls `enable()`
(docs/verl.md, "Turning it on")."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from trainer_client.dropin.patches import Patches, VersionGate
from trainer_client.verl.planning import close_planners

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
    """Puts verl's own class back and closes every planner client the drop-in made."""
    try:
        _patches.restore()
    finally:
        close_planners()


@contextmanager
def enabled() -> Iterator[bool]:
    """`enable()` for the block (yields its answer); at its end, `disable()`."""
    try:
        yield enable()
    finally:
        disable()
