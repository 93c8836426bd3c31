"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contracts, `HybridCPDataLoaderWrapper` (0.19.x) and `wrap_data_iterator` (dev branch); docs/megatron-lm.md.
"""

from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import PackingDropIn, close_wrapped, last_planned_step, wrap_data_iterator

__all__ = ["HybridCPDataLoaderWrapper", "PackingDropIn", "close_wrapped", "last_planned_step", "wrap_data_iterator"]
