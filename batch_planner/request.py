"""The planning request as plain Python: what every scheduler call and validation works on."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from operator import attrgetter
from typing import TYPE_CHECKING, Annotated, Any, Sequence, get_args, get_type_hints

from pydantic import Field

from batch_planner.cost_spec import CostModelSpec
from batch_planner.precision import Precision


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


class PaddingRule(str, Enum):
    """Whose THD/CP padding the trainer's engine applies: what plan statistics count (docs/design.md,
    "Padding, layouts and statistics"; batch_planner/padding.py)."""

    # Megatron-Core's: on a CP group, every sequence to a multiple of 2 x CP x TP, in either layout.
    MEGATRON_CORE = "megatron_core"
    # verl's preprocess_thd_engine: zigzag as Megatron-Core; contiguous to CP x TP only (verl picks it
    # for attention that reads contiguous shards itself); then `min_local_rows`.
    VERL = "verl"


class CapacityBound(str, Enum):
    """Which reading of plan invariant 4 holds for a plan (docs/design.md, Plan invariants)."""

    PER_SAMPLE = "per_sample"  # hybrid CP: each sample of a group is its own forward pass
    PER_RANK_SUM = "per_rank_sum"  # packing schedulers: a rank's shards are packed together


# An option's lower bound, as pydantic reads it (the trainer's config, trainer_client/service/config.py)
# and validation does (`option_bounds`).
Count = Annotated[int, Field(ge=1)]


def _option(default: Any, proto: str, limit: str = "") -> Any:
    """An option's default, its place in batch_planner.v1.PlanRequest (`proto`) and the server's
    RequestLimits field that bounds it above (`limit`, batch_planner/validation.py), if any."""
    return field(default=default, metadata={"proto": proto, "limit": limit})


@dataclass(frozen=True)
class PlanningOptions:
    """How a job's batches are planned: everything of a request but the batch itself.

    The one declaration of each option: its doc (the comment above it), type, default, lower bound
    (`Count`), the server limit above it and its place in the proto (`_option`). The trainer's
    config extends this class (trainer_client/service/config.py) and enforces the same bounds; a
    PlanRequest reads its options as its own attributes; the proto conversion, the plan id and the
    ranks' agreement digest read them field by field (`canonical`).
    """

    # Tokens one DPxCP rank may hold in one micro-batch, after padding (Megatron's
    # max_seqlen_per_dp_cp_rank); required.
    max_seqlen_per_dp_cp_rank: Annotated[int, Field(ge=1, validate_default=True, description="required: the job's per-rank token budget")] = (
        _option(0, "max_seqlen_per_dp_cp_rank", "max_sequence_length"))
    # The job's static CP size: the statistics compare against static CP at this size, and
    # DP = DPxCP / CP.
    context_parallel_size: Count = _option(1, "layout.context_parallel_size", "max_dp_cp_size")
    # Which Megatron-Core scheduler plans the batch.
    scheduler: SchedulerKind = _option(SchedulerKind.HYBRID_CP, "scheduler")
    # Samples are padded to multiples of TP (sequence parallelism) times the padding rule's CP unit.
    tensor_parallel_size: Count = _option(1, "layout.tensor_parallel_size", "max_tensor_parallel_size")
    cp_layout: CpLayout = _option(CpLayout.ZIGZAG, "cp_layout")
    # Whose THD/CP padding the trainer's engine applies, which the plan's padded tokens and cost
    # count (batch_planner/padding.py): Megatron-Core's, or verl's (the verl drop-in sets it).
    padding: PaddingRule = _option(PaddingRule.MEGATRON_CORE, "padding")
    # verl's padding only: every rank of a packed CP group holds at least this many rows (a kernel's
    # window); the group's last sequence is padded up to it.
    min_local_rows: Count | None = _option(None, "min_local_rows")
    # The precision the trainer's linear layers run in (batch_planner/precision.py): FP8 and MXFP8
    # need each rank's rows in a pass to be a multiple of 8, 32 or 128, and each pass is padded so.
    precision: Precision = _option(Precision.BF16, "precision")
    # Whether the trainer runs sequence parallelism: each TP rank's linear layers then see 1/TP of
    # a rank's rows, and those must be the precision's multiple (no effect in bf16).
    sequence_parallel: bool = _option(True, "sequence_parallel")
    # Smallest CP size dynamic CP may give a sample (a group size Megatron-Core builds).
    min_cp_size: Count | None = _option(None, "min_cp_size")
    # Cap on sequences packed into one micro-batch (static packing).
    max_seqs_per_micro_batch: Count | None = _option(None, "max_seqs_per_micro_batch")
    # Virtual pipeline: the micro-batch count becomes a multiple of this (packing schedulers).
    micro_batch_group_size: Count | None = _option(None, "micro_batch_group_size", "max_micro_batch_group_size")
    # The cost model that prices plans and ranks auto's candidates: a preset, coefficients or
    # profiles (batch_planner.cost_spec.CostModelSpec); None: the server's default.
    cost_model: CostModelSpec | None = _option(None, "cost_model")
    # auto only: the schedulers its candidates may use (static CP candidates are static_packing);
    # empty: every one the server has.
    auto_schedulers: tuple[SchedulerKind, ...] = _option((), "auto_schedulers")

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


def option_bounds() -> tuple[tuple[str, str, int, str], ...]:
    """(name, proto field, lower bound, RequestLimits field or "") of each option with a lower
    bound, read from the declarations above."""
    hints = get_type_hints(PlanningOptions, include_extras=True)
    bounds = []
    for f in fields(PlanningOptions):
        lower = next((m.ge for arg in (hints[f.name], *get_args(hints[f.name])) for info in getattr(arg, "__metadata__", ())
                      for m in info.metadata if hasattr(m, "ge")), None)
        if lower is not None:
            bounds.append((f.name, f.metadata["proto"], lower, f.metadata["limit"]))
    return tuple(bounds)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "canonical"):
        return value.canonical()
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True)
class PlanRequest:
    """One global batch to plan: the batch, its DP size, and its planning options. Sample ids are
    indices into `sequence_lengths`. Each option also reads as the request's own attribute
    (`request.scheduler` is `request.options.scheduler`)."""

    sequence_lengths: tuple[int, ...]
    data_parallel_size: int
    options: PlanningOptions
    job: str = ""  # a metric label only; never part of the plan

    def __post_init__(self) -> None:
        if not isinstance(self.options, PlanningOptions):
            raise TypeError(
                f"PlanRequest's third field is its PlanningOptions, got {self.options!r}: for flat values use "
                "PlanRequest.of(lengths, dp, cp, max_seqlen_per_dp_cp_rank, scheduler=...)"
            )

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
        option_changes = {name: changes.pop(name) for name in list(changes) if name in _OPTION_NAMES}
        return replace(self, options=replace(self.options, **option_changes), **changes)

    if TYPE_CHECKING:  # the options' properties are made below, from PlanningOptions' fields
        def __getattr__(self, name: str) -> Any: ...

    @property
    def dp_cp_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def num_samples(self) -> int:
        return len(self.sequence_lengths)


for _name in _OPTION_NAMES:
    setattr(PlanRequest, _name, property(attrgetter(f"options.{_name}"), doc=f"options.{_name}"))
