"""Executes one rank's share of a plan, micro-batch by micro-batch, and times it.

What a trainer does with a plan from the client: in every micro-batch, find this rank's CP group,
take its samples, shard each over the group (zigzag), run forward and backward (one pass per
sample under hybrid CP, one pass per pack under static CP), wait at the barrier where Megatron
has one, and all-reduce gradients over all DPxCP ranks at the end of the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from batch_planner.padding import padded_length
from batch_planner.plan import CpGroup
from batch_planner.request import CpLayout
from bench.gpu.cp_attention import SequenceAttention, make_attention, zigzag_positions, zigzag_shard
from bench.gpu.model import DecoderStack
from bench.gpu.plans import BenchPlan


@dataclass(frozen=True)
class MicroBatchRecord:
    index: int
    cp_size: int
    first_rank: int
    sample_ids: tuple[int, ...]
    busy_seconds: float  # this rank's work, without the wait at the barrier


@dataclass
class StepResult:
    plan: str
    rank: int
    step_seconds: float
    micro_batches: list[MicroBatchRecord] = field(default_factory=list)


class SampleInputs:
    """Deterministic input activations per sample id, cached per (sample, CP size, CP rank)."""

    def __init__(self, lengths: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device, seed: int):
        self.lengths = lengths
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        self.seed = seed
        self._full: dict[int, torch.Tensor] = {}
        self._shards: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def full(self, sample_id: int) -> torch.Tensor:
        if sample_id not in self._full:
            generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + sample_id)
            self._full[sample_id] = torch.randn(
                self.lengths[sample_id], self.hidden, generator=generator, device=self.device, dtype=torch.float32
            ).to(self.dtype)
        return self._full[sample_id]

    def shard(self, sample_id: int, cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, real-token mask) of this rank's zigzag shard, padded as the planner pads."""
        key = (sample_id, cp_size, cp_rank)
        if key not in self._shards:
            length = self.lengths[sample_id]
            padded = padded_length(length, cp_size, 1, CpLayout.ZIGZAG)
            x = torch.nn.functional.pad(self.full(sample_id), (0, 0, 0, padded - length))
            real = zigzag_positions(padded, cp_size, cp_rank, self.device) < length
            self._shards[key] = (zigzag_shard(x, cp_size, cp_rank), real)
        return self._shards[key]


class PlanExecutor:
    def __init__(
        self,
        model: DecoderStack,
        inputs: SampleInputs,
        cp_groups: dict[tuple[int, int], dist.ProcessGroup],
        device: torch.device,
    ):
        """cp_groups: (first_rank, size) -> process group, for every CP group of size > 1."""
        self.model = model
        self.inputs = inputs
        self.cp_groups = cp_groups
        self.device = device
        self.rank = dist.get_rank()
        self._attention: dict[tuple[int, int], SequenceAttention] = {}
        self._loss_scale = 1.0 / max(1, sum(inputs.lengths))

    def attention_for(self, group: CpGroup) -> SequenceAttention:
        key = (group.first_rank, group.size)
        if key not in self._attention:
            self._attention[key] = make_attention(group.size, self.cp_groups.get(key), self.device)
        return self._attention[key]

    def run_pass(self, group: CpGroup, sample_ids: tuple[int, ...]) -> None:
        cp_rank = self.rank - group.first_rank
        shards = [self.inputs.shard(i, group.size, cp_rank) for i in sample_ids]
        tokens = torch.cat([x for x, _ in shards]) if len(shards) > 1 else shards[0][0]
        real = torch.cat([m for _, m in shards]) if len(shards) > 1 else shards[0][1]
        attention = self.attention_for(group)
        with attention.pass_context():
            out = self.model(tokens, [x.shape[0] for x, _ in shards], attention)
            # Sum over real tokens only: padding never changes the gradient, so every plan of a
            # batch computes the same total gradient (the CPU test checks this).
            loss = (out.float().square().sum(-1) * real).sum() * self._loss_scale
            loss.backward()

    def run_step(self, plan: BenchPlan) -> StepResult:
        cuda = self.device.type == "cuda"
        for p in self.model.parameters():
            p.grad = None
        self._synchronize()
        dist.barrier(**self._barrier_kwargs())
        self._synchronize()
        start = time.perf_counter()
        result = StepResult(plan.name, self.rank, 0.0)
        timers = []
        for index, group in enumerate(plan.rank_schedule(self.rank)):
            if group is not None:
                timer = _Timer(cuda)
                passes = [(i,) for i in group.sample_ids] if plan.pass_per_sample else [group.sample_ids]
                for sample_ids in passes:
                    self.run_pass(group, sample_ids)
                timer.stop()
                timers.append((index, group, timer))
            if plan.barrier_between_micro_batches:
                dist.barrier(**self._barrier_kwargs())
        self._all_reduce_gradients()
        self._synchronize()
        result.step_seconds = time.perf_counter() - start
        for index, group, timer in timers:
            result.micro_batches.append(
                MicroBatchRecord(index, group.size, group.first_rank, group.sample_ids, timer.seconds())
            )
        return result

    def _all_reduce_gradients(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _barrier_kwargs(self) -> dict:
        return {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}


class _Timer:
    """CUDA events on the GPU timeline (so host/GPU overlap counts as it runs), else host clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self._start.elapsed_time(self._end) / 1000.0
        return self._t1 - self._t0
