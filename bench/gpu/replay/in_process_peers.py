"""Stand-in for a CP group's other ranks inside one process (named as such): `InProcessCpPeersStandIn`.

Why: the replay times one rank's share of Transformer Engine's THD ring attention alone on the one
GPU (docs/gpu-replay.md). Transformer Engine's ring (`AttnFuncWithCPAndKVP2P`, `cp_comm_type="p2p"`)
asks its CP group for its size and this rank's place in it, and exchanges keys and values (forward)
and their gradients (backward) with its ring neighbours through `torch.distributed`'s
`isend`/`irecv`/`batch_isend_irecv`/`P2POp`. Megatron-Core's RoPE asks the group object for
`size()` and `rank()`. Inside the stand-in, a `CpGroupStandIn(size, rank)` answers all of these as
rank `rank` of a group of `size`:

- `get_world_size`, `get_rank` and `get_process_group_ranks` of the group: its size, the rank, and
  global ranks 0..size-1;
- a send is recorded (its bytes and its peer) and dropped;
- a receive completes at once and leaves its buffer as it was: the peers' values are not there.
  The kernels' times do not depend on the values (dense arithmetic over the same shapes), and the
  replay reads only times and the calls' shapes from these runs, never their outputs.

Every other group, and every other call, goes to torch.distributed as it is. What is real: every
kernel Transformer Engine launches on this rank, its ring schedule (which half of which chunk it
attends to at each step, the corrections between steps, its two streams); what is stood in: the
transport, whose time `links.py` models from the bytes recorded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

_PATCHED = ("get_world_size", "get_rank", "get_process_group_ranks", "isend", "irecv", "batch_isend_irecv", "P2POp")


class CpGroupStandIn(dist.ProcessGroup):
    """A CP group of `size` ranks of which this process is rank `rank` (module docstring). A
    `ProcessGroup` (its `size()` and `rank()` are the base class's), since Transformer Engine counts
    a CP group's ranks only for a `ProcessGroup`: any other object runs as CP 1, and the ring's
    rows then fall short of the group's cu_seqlens (the first GPU run read past them). Each instance
    is its own group: Transformer Engine caches a group's rank by the group object."""

    def __init__(self, size: int, rank: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of size {size}")
        super().__init__(rank, size)

    def __repr__(self) -> str:
        return f"CpGroupStandIn(size={self.size()}, rank={self.rank()})"


@dataclass
class Message:
    phase: str  # what the caller was running: InProcessCpPeersStandIn.phase ("forward", "backward")
    op: str  # "send" or "recv"
    peer: int
    bytes: int


@dataclass
class StandInP2POp:
    """What `torch.distributed.P2POp` holds, without its check that `op` is torch's own isend/irecv."""

    op: Callable
    tensor: Any
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class InProcessCpPeersStandIn:
    """Context manager: while active, `CpGroupStandIn` groups answer torch.distributed's group
    queries and point-to-point calls (module docstring); `messages` lists the sends and receives
    made on them, in call order."""

    messages: list[Message] = field(default_factory=list)
    phase: str = ""  # set by the caller; each message records it

    def __enter__(self) -> InProcessCpPeersStandIn:
        self._saved = {name: getattr(dist, name) for name in _PATCHED}
        dist.get_world_size = self._get_world_size
        dist.get_rank = self._get_rank
        dist.get_process_group_ranks = self._get_process_group_ranks
        dist.isend, dist.irecv = self.isend, self.irecv
        dist.batch_isend_irecv, dist.P2POp = self.batch_isend_irecv, StandInP2POp
        return self

    def __exit__(self, *exc) -> None:
        for name, value in self._saved.items():
            setattr(dist, name, value)

    def take(self) -> list[Message]:
        """The messages since the last take, and forget them."""
        taken, self.messages = self.messages, []
        return taken

    def _get_world_size(self, group=None):
        return group.size() if isinstance(group, CpGroupStandIn) else self._saved["get_world_size"](group)

    def _get_rank(self, group=None):
        return group.rank() if isinstance(group, CpGroupStandIn) else self._saved["get_rank"](group)

    def _get_process_group_ranks(self, group):
        return list(range(group.size())) if isinstance(group, CpGroupStandIn) else self._saved["get_process_group_ranks"](group)

    def isend(self, tensor, dst=None, group=None, tag: int = 0, group_dst=None):
        if not isinstance(group, CpGroupStandIn):
            return self._saved["isend"](tensor, dst, group=group, tag=tag, group_dst=group_dst)
        self.messages.append(Message(self.phase, "send", dst if dst is not None else group_dst, tensor.numel() * tensor.element_size()))
        return _Done()

    def irecv(self, tensor, src=None, group=None, tag: int = 0, group_src=None):
        if not isinstance(group, CpGroupStandIn):
            return self._saved["irecv"](tensor, src, group=group, tag=tag, group_src=group_src)
        self.messages.append(Message(self.phase, "recv", src if src is not None else group_src, tensor.numel() * tensor.element_size()))
        return _Done()

    def batch_isend_irecv(self, ops: list) -> list:
        if not all(isinstance(op.group, CpGroupStandIn) for op in ops):
            raise RuntimeError("InProcessCpPeersStandIn: a batch mixes stand-in and real groups")
        return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]
