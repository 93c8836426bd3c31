"""A drop-in for Megatron-LM's own training loop: the planner behind Megatron-Core's data-iterator
contract (docs/megatron-lm.md). Two drop-ins, one per contract Megatron-LM's `training.py` uses:
`HybridCPDataLoaderWrapper` (0.19.x, `--hybrid-context-parallel`) and `wrap_data_iterator` (dev
branch, `--sequence-packing-scheduler default_dynamic_cp | dp_balanced`), each with Megatron-Core's
arguments and return values. Reading ahead, the checks, routing and the settings are the drop-in
core's (trainer_client/dropin).
"""

from trainer_client.megatron_lm.hybrid_cp import HybridCPDataLoaderWrapper
from trainer_client.megatron_lm.packing import PackingDropIn, close_wrapped, last_planned_step, wrap_data_iterator

__all__ = ["HybridCPDataLoaderWrapper", "PackingDropIn", "close_wrapped", "last_planned_step", "wrap_data_iterator"]
