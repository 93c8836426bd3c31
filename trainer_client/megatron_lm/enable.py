"""Turning the drop-in on without editing Megatron-LM: `enable()` before `pretrain` replaces
`HybridCPDataLoaderWrapper` and `wrap_data_iterator` in `megatron.training.training` (whichever the
installed Megatron-LM has), only on a Megatron-Core build the drop-in was checked against and only
when every upstream name the replaced wrapper calls is there; `disable()` puts Megatron-LM's own back
and closes the planner clients (docs/megatron-lm.md, "Turning it on")."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from trainer_client.dropin.patches import Patches
from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import close_all_wrapped, wrap_data_iterator
from trainer_client.megatron_lm.version import GATE, megatron_core_version, require

log = logging.getLogger(__name__)

TRAINING_MODULE = "megatron.training.training"
DROP_INS = {"HybridCPDataLoaderWrapper": HybridCPDataLoaderWrapper, "wrap_data_iterator": wrap_data_iterator}
_patches = Patches()


def enable() -> tuple[str, ...]:
    """Replaces the names of `DROP_INS` that Megatron-LM's training loop has; returns them (empty:
    nothing changed, after a warning, on a Megatron-Core build not checked). A checked build that
    lacks an upstream name a replaced wrapper calls is refused (MissingUpstreamError naming each),
    before anything is replaced."""
    import megatron.training.training as training

    version = megatron_core_version()
    if not GATE.allows(version):
        return ()
    names = tuple(name for name in DROP_INS if hasattr(training, name))  # 0.19.x has the first, dev both
    for name in names:
        require(name)
    for name in names:
        _patches.replace(TRAINING_MODULE, name, DROP_INS[name])
    log.info("trainer_client.megatron_lm: Megatron-Core %s plans through the batch planner (%s)", version, ", ".join(names))
    return names


def disable() -> None:
    """Puts Megatron-LM's own wrappers back and closes the planner clients wrap_data_iterator made."""
    try:
        _patches.restore()
    finally:
        close_all_wrapped()


@contextmanager
def enabled() -> Iterator[tuple[str, ...]]:
    """`enable()` for the block (yields what it replaced); at its end, `disable()`."""
    try:
        yield enable()
    finally:
        disable()
