"""What a trainer fixes of the planner settings (`DerivedSettings`): read by each drop-in from the
trainer's own config, and refused where the user's planner settings say otherwise
(`trainer_client.dropin.settings.planner_config`; docs/trainer-client.md, "Adding a drop-in")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from batch_planner.precision import Precision
from batch_planner.request import CpLayout, PaddingRule, SchedulerKind
from trainer_client.errors import ConfigError


class NotFixed:
    """The value of a setting the trainer leaves to the planner settings (their default otherwise)."""

    def __repr__(self) -> str:
        return "NOT_FIXED"


NOT_FIXED: Final = NotFixed()
_ENUMS = {"scheduler": SchedulerKind, "padding": PaddingRule, "cp_layout": CpLayout, "precision": Precision}


@dataclass(frozen=True)
class DerivedSettings:
    """The planner settings a trainer fixes, by `PlannerClientConfig`'s names. A setting that is
    `NOT_FIXED` is the user's to give; one fixed to None is fixed all the same (the planner's "none")."""

    # The most tokens a DPxCP rank holds in one micro-batch: the trainer's per-rank token budget.
    max_seqlen_per_dp_cp_rank: int
    # The model's context parallel size: the static CP group the plans are made for.
    context_parallel_size: int
    # The model's tensor parallel size: each CP shard is padded to a multiple of it.
    tensor_parallel_size: int
    # The scheduler the trainer runs (Megatron's `sequence_packing_scheduler`, verl's dynamic CP).
    scheduler: SchedulerKind | NotFixed = NOT_FIXED
    # Whose THD/CP padding the trainer's engine applies, so that the plan counts it.
    padding: PaddingRule | NotFixed = NOT_FIXED
    # verl's top-up: every rank of a CP group holds at least this many rows (None: no top-up).
    min_local_rows: int | None | NotFixed = NOT_FIXED
    # The layout the trainer's attention cuts and reads a sequence's CP shards in.
    cp_layout: CpLayout | NotFixed = NOT_FIXED
    # Dynamic CP's smallest CP group (Megatron-Core's `min_dynamic_context_parallel_size`).
    min_cp_size: int | None | NotFixed = NOT_FIXED
    # Static packing's real-sequence cap of a micro-batch (Megatron-Core's wrap_data_iterator's).
    max_seqs_per_micro_batch: int | None | NotFixed = NOT_FIXED
    # Micro-batches per virtual pipeline stage group (`microbatch_group_size_per_vp_stage` under VPP).
    micro_batch_group_size: int | None | NotFixed = NOT_FIXED
    # The precision the trainer's linear layers run in (FP8's recipe), which each pass is padded for.
    precision: Precision | NotFixed = NOT_FIXED
    # Whether the trainer runs sequence parallelism (its TP ranks each take 1/TP of a rank's rows).
    sequence_parallel: bool | NotFixed = NOT_FIXED

    def __post_init__(self) -> None:
        for name, kind in _ENUMS.items():
            value = getattr(self, name)
            if value is NOT_FIXED or isinstance(value, kind):
                continue
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ConfigError(f"derived setting {name}: {value!r} is not allowed; allowed: {[k.value for k in kind]}") from None

    def fixed(self) -> dict[str, Any]:
        """The settings the trainer fixes, as planner settings (an enum by its value), in field order."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.value if isinstance(v, Enum) else v for k, v in values.items() if v is not NOT_FIXED}
