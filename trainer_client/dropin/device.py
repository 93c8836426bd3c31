"""Where a drop-in's tensors live: the one home of that choice."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def data_device(group: Any) -> torch.device:
    """The device of the tensors a drop-in exchanges over `group`: the current CUDA device under
    NCCL (which moves only CUDA tensors), else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device() -> torch.device:
    """The device of the micro-batches a drop-in hands the model: the current CUDA device where
    there is one, as Megatron-Core's own iterators put them (`torch.cuda.current_device()`), whatever
    backend moved them; else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
