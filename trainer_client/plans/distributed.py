"""Whether there is a process group of several ranks to talk to; without one (a single process,
torch.distributed not started) the client's collectives are skipped."""

from __future__ import annotations

import torch.distributed as dist


def is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
