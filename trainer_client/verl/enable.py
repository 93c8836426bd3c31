"""Importing this module makes verl's Megatron engine plan through the batch planner: it replaces verl's
`DynamicCPScheduler`, on the verl versions it was checked against (docs/verl.md, "Turning it on").
"""

from __future__ import annotations

import logging
import sys
import warnings

log = logging.getLogger(__name__)

# verl releases whose DynamicCPScheduler contract (constructor, schedule(), the micro-batches'
# keys) this drop-in was tested against (the CI leg `./dev test-verl`).
CHECKED_VERL_VERSIONS = ("0.9.1",)
VERL_MODULE = "verl.utils.dynamic_cp_scheduler"
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
# verl's own class, kept before it is replaced (comparisons, turning the drop-in off).
verl_scheduler_class = None


def enable() -> bool:
    """Puts the drop-in in place; True when it did, False (after saying why) when it did not."""
    global verl_scheduler_class
    import verl

    version = getattr(verl, "__version__", "unknown")
    if version not in CHECKED_VERL_VERSIONS:
        message = (
            f"trainer_client.verl: verl {version} is not a version this drop-in was checked against "
            f"(checked: {list(CHECKED_VERL_VERSIONS)}); verl's own DynamicCPScheduler stays in place, nothing is changed"
        )
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
    import importlib

    from trainer_client.verl.scheduler import DynamicCPScheduler

    module = importlib.import_module(VERL_MODULE)
    if module.DynamicCPScheduler is not DynamicCPScheduler:
        verl_scheduler_class = module.DynamicCPScheduler
    module.DynamicCPScheduler = DynamicCPScheduler
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is not None and hasattr(engine, "DynamicCPScheduler"):
        engine.DynamicCPScheduler = DynamicCPScheduler
    log.info("trainer_client.verl: verl %s's DynamicCPScheduler plans through the batch planner", version)
    return True


def disable() -> None:
    """Puts verl's own class back (tests)."""
    if verl_scheduler_class is None:
        return
    import importlib

    importlib.import_module(VERL_MODULE).DynamicCPScheduler = verl_scheduler_class
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is not None and hasattr(engine, "DynamicCPScheduler"):
        engine.DynamicCPScheduler = verl_scheduler_class


enabled = enable()
