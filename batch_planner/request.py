"""The planning request as plain Python: what every scheduler call and validation works on."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SchedulerKind(str, Enum):
    """Megatron-Core's scheduling algorithms, named by what they do (proto enum `Scheduler`)."""

    HYBRID_CP = "hybrid_cp"
    DYNAMIC_CP = "dynamic_cp"
    STATIC_PACKING = "static_packing"


class CpLayout(str, Enum):
    """How a sequence is split over its CP group (Megatron's THD layout)."""

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


class CapacityBound(str, Enum):
    """Which reading of plan invariant 4 holds for a plan (docs/design.md, Plan invariants)."""

    PER_SAMPLE = "per_sample"  # hybrid CP: each sample of a group is its own forward pass
    PER_RANK_SUM = "per_rank_sum"  # packing schedulers: a rank's shards are packed together


@dataclass(frozen=True)
class PlanRequest:
    """One global batch to plan. Sample ids are indices into `sequence_lengths`."""

    sequence_lengths: tuple[int, ...]
    data_parallel_size: int
    context_parallel_size: int
    max_seqlen_per_dp_cp_rank: int
    scheduler: SchedulerKind = SchedulerKind.HYBRID_CP
    tensor_parallel_size: int = 1
    cp_layout: CpLayout = CpLayout.ZIGZAG
    min_cp_size: int | None = None
    max_seqs_per_micro_batch: int | None = None
    micro_batch_group_size: int | None = None
    job: str = ""

    @property
    def dp_cp_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def num_samples(self) -> int:
        return len(self.sequence_lengths)
