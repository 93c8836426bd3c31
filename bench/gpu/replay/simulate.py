"""A pass's time on its CP group, and a step's time from every rank's timeline (docs/gpu-replay.md).

A pass (`pass_seconds`), over the model's L layers, on a group of c ranks that each hold T rows:

    L x ( rest(T) + ring forward + ring backward + TP collectives ) + head(T)

- rest(T), head(T): the clock's (`clock.py`), the slowest member's.
- The ring (c > 1): c steps. Transformer Engine posts step i + 1's transfer before it computes
  step i, so a step lasts max(compute, transfer) and the last step has nothing left to receive:

      ring = (c - 1) x max(compute / c, transfer) + compute / c

  with `compute` the slowest member's attention (forward, then backward) and `transfer` the
  step's bytes on the group's slowest hop (`links.LinkSpec.ring_step_seconds`). Bytes per step
  (`ring_step_bytes`): forward, the keys and values of the sender's T rows; backward, those again
  and their gradients.
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

# Bytes a ring step sends per rank, in units of the sender's keys and values (forward: K and V;
# backward: K and V, and dK and dV), as the in-process stand-in recorded Transformer Engine's sends.
FORWARD_KV_UNITS = 1
BACKWARD_KV_UNITS = 2
TP_COLLECTIVES_PER_DIRECTION = 4


@dataclass(frozen=True)
class PassTime:
    seconds: float
    compute: float  # the same pass with free links
    ring_exposed: float  # what the CP transfers added
    tp_collectives: float


def ring_step_bytes(shape: RankShape, local_tokens: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends at one ring step of one layer."""
    kv = local_tokens * shape.kv_bytes_per_token
    return FORWARD_KV_UNITS * kv, BACKWARD_KV_UNITS * kv


def ring_seconds(compute: float, steps: int, transfer: float) -> float:
    """A ring of `steps` steps whose compute totals `compute`, each step's transfer `transfer`."""
    if steps <= 1:
        return compute
    per_step = compute / steps
    return (steps - 1) * max(per_step, transfer) + per_step


def pass_seconds(clock: KernelClock, shape: RankShape, links: LinkSpec, group_pass: GroupPass) -> PassTime:
    c, tokens, t = group_pass.cp_size, group_pass.local_tokens, shape.tensor_parallel_size
    rest = clock.rest(tokens)
    head = clock.head(tokens)
    attention = [clock.attention(c, r, group_pass.real, group_pass.padded) for r in range(c)]
    forward = max(a.forward for a in attention)
    backward = max(a.backward for a in attention)
    forward_bytes, backward_bytes = ring_step_bytes(shape, tokens)
    ranks = group_pass.ranks
    ring_forward = ring_seconds(forward, c, links.ring_step_seconds(forward_bytes, ranks, t))
    ring_backward = ring_seconds(backward, c, links.ring_step_seconds(backward_bytes, ranks, t))
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


__all__ = ["PassTime", "StepTime", "Timing", "pass_seconds", "group_seconds", "ring_seconds", "ring_step_bytes", "simulate_step",
           "replay_step"]
