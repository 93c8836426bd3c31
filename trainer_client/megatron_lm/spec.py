"""Megatron-LM's drop-ins as one object (`trainer_client.dropin.DropIn`), registered by the package."""

from __future__ import annotations

from trainer_client.dropin.settings import planner_settings_of
from trainer_client.dropin.spec import DropIn
from trainer_client.megatron_lm.enable import DROP_INS, TRAINING_MODULE, disable, enable
from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import PackingDropIn
from trainer_client.megatron_lm.refusals import REFUSALS
from trainer_client.megatron_lm.version import GATE

MEGATRON_LM = DropIn(
    refusals=REFUSALS,
    package="trainer_client.megatron_lm",
    settings=planner_settings_of,
    readers=(HybridCPDataLoaderWrapper._read_local, PackingDropIn.read_local),
    hooks={f"{TRAINING_MODULE}:{name}": hook for name, hook in DROP_INS.items()},
    gate=GATE,
    enable=enable,
    disable=disable,
)
