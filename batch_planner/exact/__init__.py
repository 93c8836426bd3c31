"""Exact, faster executions of Megatron-Core's scheduling algorithms (docs/design.md, "The exact
scheduler path"): the same plans, list for list, and the same exceptions as upstream's code, used
only on the Megatron-Core builds they were verified against (verified.py)."""
