"""Whether there is a process group to talk to: broadcasting a plan and gathering outputs both
skip their collectives without one (a single-process trainer, or torch.distributed not started)."""

from __future__ import annotations

import torch.distributed as dist


def is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
