"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contracts, `HybridCPDataLoaderWrapper` (0.19.x) and `wrap_data_iterator` (dev branch); docs/megatron-lm.md.
Importing it changes nothing in Megatron-LM; `enable()` (or the import line in training.py) does.
"""

from trainer_client.dropin.spec import register_dropin
from trainer_client.megatron_lm.enable import disable, enable, enabled
from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import (
    PackingDropIn, close_all_wrapped, close_wrapped, closing_wrapped, last_planned_step, wrap_data_iterator,
)
from trainer_client.megatron_lm.spec import MEGATRON_LM
from trainer_client.megatron_lm.version import CHECKED_MEGATRON_CORE_VERSIONS, GATE, megatron_core_version

__all__ = [
    "CHECKED_MEGATRON_CORE_VERSIONS", "GATE", "MEGATRON_LM", "HybridCPDataLoaderWrapper", "PackingDropIn", "close_all_wrapped",
    "close_wrapped", "closing_wrapped", "disable", "enable", "enabled", "last_planned_step", "megatron_core_version",
    "wrap_data_iterator",
]

# Its part of the refusal table, so that `check` knows the `megatron_lm` source once this package is
# imported (this registration enables nothing: `enable` does).
register_dropin(MEGATRON_LM)
