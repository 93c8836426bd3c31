"""The planning request as plain Python: what every scheduler call and validation works on."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, Sequence

from batch_planner.cost_spec import CostModelSpec


class SchedulerKind(str, Enum):
    """Megatron-Core's scheduling algorithms, named by what they do (proto enum `Scheduler`)."""

    HYBRID_CP = "hybrid_cp"
    DYNAMIC_CP = "dynamic_cp"
    STATIC_PACKING = "static_packing"
    # Not a Megatron-Core class: the cheapest of their plans (batch_planner/auto.py).
    AUTO = "auto"


class CpLayout(str, Enum):
    """How a sequence is split over its CP group (Megatron's THD layout)."""

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


class CapacityBound(str, Enum):
    """Which reading of plan invariant 4 holds for a plan (docs/design.md, Plan invariants)."""

    PER_SAMPLE = "per_sample"  # hybrid CP: each sample of a group is its own forward pass
    PER_RANK_SUM = "per_rank_sum"  # packing schedulers: a rank's shards are packed together


@dataclass(frozen=True)
class OptionFields:
    """How a job's batches are planned: everything of a request but the batch itself.

    The one list of planning options, inherited by `PlanningOptions` (the options as a value) and
    `PlanRequest` (a request's own attributes). The trainer's config extends PlanningOptions
    (trainer_client/config.py); the proto conversion, the plan id and the ranks' agreement digest
    read it field by field (`PlanningOptions.canonical`); `proto` metadata names each field's place
    in batch_planner.v1.PlanRequest.
    """

    # Tokens one DPxCP rank may hold in one micro-batch, after padding (Megatron's
    # max_seqlen_per_dp_cp_rank); required.
    max_seqlen_per_dp_cp_rank: int = field(default=0, metadata={"proto": "max_seqlen_per_dp_cp_rank"})
    # The job's static CP size: the statistics compare against static CP at this size, and
    # DP = DPxCP / CP.
    context_parallel_size: int = field(default=1, metadata={"proto": "layout.context_parallel_size"})
    # Which Megatron-Core scheduler plans the batch.
    scheduler: SchedulerKind = field(default=SchedulerKind.HYBRID_CP, metadata={"proto": "scheduler"})
    # Samples are padded to multiples of TP (sequence parallelism) times the CP layout's unit.
    tensor_parallel_size: int = field(default=1, metadata={"proto": "layout.tensor_parallel_size"})
    cp_layout: CpLayout = field(default=CpLayout.ZIGZAG, metadata={"proto": "cp_layout"})
    # Smallest CP size dynamic CP may give a sample (a group size Megatron-Core builds).
    min_cp_size: int | None = field(default=None, metadata={"proto": "min_cp_size"})
    # Cap on sequences packed into one micro-batch (static packing).
    max_seqs_per_micro_batch: int | None = field(default=None, metadata={"proto": "max_seqs_per_micro_batch"})
    # Virtual pipeline: the micro-batch count becomes a multiple of this (packing schedulers).
    micro_batch_group_size: int | None = field(default=None, metadata={"proto": "micro_batch_group_size"})
    # The cost model that prices plans and ranks auto's candidates: a preset, coefficients or
    # profiles (batch_planner.cost_spec.CostModelSpec); None: the server's default.
    cost_model: CostModelSpec | None = field(default=None, metadata={"proto": "cost_model"})
    # auto only: the schedulers its candidates may use (static CP candidates are static_packing);
    # empty: every one the server has.
    auto_schedulers: tuple[SchedulerKind, ...] = field(default=(), metadata={"proto": "auto_schedulers"})


@dataclass(frozen=True)
class PlanningOptions(OptionFields):
    """The planning options of OptionFields as one value: what a job plans every batch with."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(PlanningOptions))

    @classmethod
    def of(cls, source: Any) -> PlanningOptions:
        """The options of any object that has them as attributes (a trainer config, a request)."""
        return PlanningOptions(**{name: getattr(source, name) for name in PlanningOptions.names()})

    def canonical(self) -> dict[str, Any]:
        """Plain values by field name (enums by value): what the plan id and the digest hash."""
        return {name: _plain(getattr(self, name)) for name in PlanningOptions.names()}


_OPTION_NAMES = PlanningOptions.names()


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "canonical"):
        return value.canonical()
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True, init=False, kw_only=True)
class PlanRequest(OptionFields):
    """One global batch to plan: the batch, its DP size, and its planning options. Sample ids are
    indices into `sequence_lengths`.

    The options are the request's own attributes (`request.scheduler`), declared once in
    OptionFields; `options` is the PlanningOptions the request was built from (not compared: the
    attributes are).
    """

    sequence_lengths: tuple[int, ...]
    data_parallel_size: int
    job: str = ""  # a metric label only; never part of the plan
    options: PlanningOptions = field(compare=False, repr=False)

    def __init__(self, sequence_lengths: tuple[int, ...], data_parallel_size: int, options: PlanningOptions, job: str = ""):
        if not isinstance(options, PlanningOptions):
            raise TypeError(
                f"PlanRequest's third field is its PlanningOptions, got {options!r}: for flat values use "
                "PlanRequest.of(lengths, dp, cp, max_seqlen_per_dp_cp_rank, scheduler=...)"
            )
        own = object.__setattr__
        for name in _OPTION_NAMES:
            own(self, name, getattr(options, name))
        own(self, "sequence_lengths", sequence_lengths)
        own(self, "data_parallel_size", data_parallel_size)
        own(self, "job", job)
        own(self, "options", options)

    @classmethod
    def of(
        cls,
        sequence_lengths: Sequence[int],
        data_parallel_size: int,
        context_parallel_size: int = 1,
        max_seqlen_per_dp_cp_rank: int = 0,
        job: str = "",
        **options: Any,
    ) -> PlanRequest:
        """A request from flat values: `PlanRequest.of(lengths, dp, cp, max_seqlen, scheduler=...)`."""
        planning = PlanningOptions(
            max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, context_parallel_size=context_parallel_size, **options
        )
        return cls(tuple(sequence_lengths), data_parallel_size, planning, job)

    def replace(self, **changes: Any) -> PlanRequest:
        """A copy with some fields changed; option names change the options."""
        own = {k: v for k, v in changes.items() if k not in _OPTION_NAMES}
        option_changes = {k: v for k, v in changes.items() if k in _OPTION_NAMES}
        options = replace(self.options, **option_changes) if option_changes else self.options
        values = {"sequence_lengths": self.sequence_lengths, "data_parallel_size": self.data_parallel_size, "job": self.job, **own}
        return PlanRequest(options=options, **values)

    @property
    def dp_cp_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def num_samples(self) -> int:
        return len(self.sequence_lengths)


