"""Applying a plan to a batch: the batch and its checks, this rank's micro-batches, Megatron-Core's
touchpoint (`megatron.py`, the one module that imports `megatron.core`), restoring outputs in the
original order, side data, and ranks that fail together."""
