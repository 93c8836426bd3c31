"""A pass's time on its CP group, and a step's time from every rank's timeline (docs/gpu-replay.md).

A pass (`pass_seconds`), over the model's L layers, on a group of c ranks that each hold T rows:

    L x ( rest(T) + ring forward + ring backward + TP collectives ) + head(T)

- rest(T), head(T): the clock's (`clock.py`), the slowest member's.
- The ring (c > 1): c steps. Transformer Engine posts each step's transfer before it computes the
  step, so a step lasts max(compute / c, its transfer) (`ring_seconds`), with `compute` the
  slowest member's attention and each transfer priced on the group's slowest hop
  (`links.LinkSpec.ring_step_seconds`). What a step sends (`ring_transfers`, in units of the
  sender's keys and values of its T rows, kv): forward, kv at steps 0..c-2 and nothing at the last;
  backward, kv at step 0, kv and their gradients (2 kv) at steps 1..c-2, the gradients alone (kv)
  at the last (`AttnFuncWithCPAndKVP2P.backward`: `p2p_comm_buffers[i % 2]`, its first half at
  step 0 and its second at step c-1).
- TP collectives (t > 1, sequence parallelism): forward an all-gather before the QKV and the MLP's
  first GEMM and a reduce-scatter after the attention's and the MLP's last; backward the same four
  again; each of T x hidden activations; not overlapped.

A step (`simulate_step`) from an event simulation of every rank's timeline: each rank runs its
micro-batches in order; a group's pass starts when all its members are free (its ring needs them
all) and holds them until it ends. The step is the last rank's end. Beside it, the cost model's
barrier arithmetic (`barrier_step`): every micro-batch lasts its slowest group, one after another.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from bench.gpu.replay.clock import KernelClock, Timing
from bench.gpu.replay.links import LinkSpec
from bench.gpu.replay.passes import GroupPass, GroupWork
from bench.gpu.replay.shapes import RankShape

TP_COLLECTIVES_PER_DIRECTION = 4


@dataclass(frozen=True)
class PassTime:
    seconds: float
    compute: float  # the same pass with free links
    ring_exposed: float  # what the CP transfers added
    tp_collectives: float


def ring_transfers(cp_size: int) -> tuple[list[int], list[int]]:
    """(forward, backward): what each of the c ring steps sends, in units of the sender's keys and
    values (module docstring)."""
    if cp_size <= 1:
        return [0], [0]
    return [1] * (cp_size - 1) + [0], [1] + [2] * (cp_size - 2) + [1]


def kv_bytes(shape: RankShape, local_tokens: int) -> float:
    """One unit of `ring_transfers`: the keys and values of a rank's T rows in one layer."""
    return float(local_tokens * shape.kv_bytes_per_token)


def ring_seconds(compute: float, transfers: Sequence[float]) -> float:
    """A ring of len(transfers) steps whose compute totals `compute`: each step lasts the longer of
    its share of the compute and the transfer posted before it."""
    per_step = compute / len(transfers)
    return sum(max(per_step, transfer) for transfer in transfers)


def pass_seconds(clock: KernelClock, shape: RankShape, links: LinkSpec, group_pass: GroupPass) -> PassTime:
    c, tokens, t = group_pass.cp_size, group_pass.local_tokens, shape.tensor_parallel_size
    rest = clock.rest(tokens)
    head = clock.head(tokens)
    attention = [clock.attention(c, r, group_pass.real, group_pass.padded) for r in range(c)]
    forward = max(a.forward for a in attention)
    backward = max(a.backward for a in attention)
    unit, ranks = kv_bytes(shape, tokens), group_pass.ranks
    forward_units, backward_units = ring_transfers(c)
    ring_forward = ring_seconds(forward, [links.ring_step_seconds(n * unit, ranks, t) for n in forward_units])
    ring_backward = ring_seconds(backward, [links.ring_step_seconds(n * unit, ranks, t) for n in backward_units])
    tp = 2 * TP_COLLECTIVES_PER_DIRECTION * links.tp_collective_seconds(tokens * shape.activation_bytes_per_token, t)
    layers = shape.num_layers
    compute = layers * (rest.total + forward + backward) + head.total
    seconds = layers * (rest.total + ring_forward + ring_backward + tp) + head.total
    return PassTime(seconds, compute, layers * (ring_forward + ring_backward - forward - backward), layers * tp)


def group_seconds(clock: KernelClock, shape: RankShape, links: LinkSpec, work: GroupWork) -> float:
    """A group's passes, one after another."""
    return sum(pass_seconds(clock, shape, links, p).seconds for p in work.passes)


@dataclass(frozen=True)
class StepTime:
    event_seconds: float  # the event simulation's step
    barrier_seconds: float  # the cost model's barrier arithmetic on the same group times
    busy_seconds: float  # the ranks' busy time, summed
    ranks: int

    @property
    def utilization(self) -> float:
        """Busy rank-seconds over the step's rank-seconds."""
        return self.busy_seconds / (self.event_seconds * self.ranks) if self.event_seconds > 0 else 1.0


def simulate_step(micro_batches: Sequence[Sequence[tuple[range, float]]], ranks: int) -> StepTime:
    """The step of micro-batches of (group's ranks, group's seconds) (module docstring)."""
    free: dict[int, float] = defaultdict(float)
    busy = 0.0
    barrier = 0.0
    for micro_batch in micro_batches:
        slowest = 0.0
        for members, seconds in micro_batch:
            start = max((free[r] for r in members), default=0.0)
            for r in members:
                free[r] = start + seconds
            busy += seconds * len(members)
            slowest = max(slowest, seconds)
        barrier += slowest
    return StepTime(max(free.values(), default=0.0), barrier, busy, ranks)


def replay_step(clock: KernelClock, shape: RankShape, links: LinkSpec, passes: Sequence[Sequence[GroupWork]], ranks: int) -> StepTime:
    """A plan's step (`passes.plan_passes`) on this clock and these links."""
    timed = [[(work.ranks, group_seconds(clock, shape, links, work)) for work in micro_batch] for micro_batch in passes]
    return simulate_step(timed, ranks)


__all__ = ["PassTime", "StepTime", "Timing", "pass_seconds", "group_seconds", "ring_seconds", "ring_transfers", "kv_bytes",
           "simulate_step", "replay_step"]
