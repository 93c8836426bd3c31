"""Which layouts each Megatron-Core scheduler plans, and how: the one home of that rule, as measured.

Megatron-Core's schedulers loop for ever, crash or return plans no process group can run on some
batches of some layouts: dynamic CP on a DPxCP that is not a power of two raises IndexError in
`fill_empty_gpus_once`, places a CP group parallel_state does not build (16 on 24 ranks) and, with
VPP grouping, loops for ever in `align_sample_id_groups`; hybrid CP does the same on those sizes.
`scripts/characterize_domain.py` plans a few hundred small, adversarial seeded batches per DPxCP
size (every even size up to 256, then a seeded sample up to 1,024) on each build and records every
failure; its output is docs/domain/<build>.json. On realistic batches (bench/nonpow2.py) the same
layouts fail rarely: upstream's plan is valid for nearly every batch.

So a layout is one of three things for a scheduler:
- planned for every batch (`exact_sizes`): no batch of the sweep failed on it, other than by one
  of upstream's own refusals of the batch itself (`BATCH_LIMITS`: a property of the batch, answered
  OUT_OF_RANGE, errors.BatchNotPlannableError). An upstream failure there is our bug: INTERNAL.
- planned batch by batch (`per_batch`, dynamic CP on every other even DPxCP): upstream's algorithm
  runs bounded (the exact path detects a loop; Megatron-Core's own code is cut off,
  batch_planner/bounded.py), its plan is served when every invariant holds, and otherwise the
  named substitute (batch_planner/substitute.py: Megatron-Core's static-packing plan of the batch).
- refused (INVALID_ARGUMENT on `layout`, before any scheduler runs).

tests/batch_planner/test_scheduler_domain.py checks this module against the sweep's output and the table in
docs/design.md against `domain_table()`; the sweep is kept, since it finds where substitutes happen.
"""

from __future__ import annotations

from dataclasses import dataclass

from batch_planner.cp_groups import is_power_of_two
from batch_planner.request import SchedulerKind

@dataclass(frozen=True)
class BatchLimit:
    """One of upstream's own refusals of a batch on a layout it plans: a bounded assertion about
    the batch (too few samples), reported OUT_OF_RANGE with what to do."""

    scheduler: SchedulerKind
    upstream_message: str  # what Megatron-Core's AssertionError says (a substring of it)
    meaning: str
    instead: str


BATCH_LIMITS: tuple[BatchLimit, ...] = (
    BatchLimit(
        SchedulerKind.DYNAMIC_CP,
        "align_sample_id_groups: no tail microbatch has enough ids to split",
        "too few samples to split into a multiple of micro_batch_group_size micro-batches",
        "send more samples per global batch, a smaller micro_batch_group_size, or scheduler auto",
    ),
    BatchLimit(
        SchedulerKind.STATIC_PACKING,
        "Not enough samples to move",
        "too few samples to make the packed micro-batch count a multiple of DP x micro_batch_group_size",
        "send more samples per global batch, raise max_seqs_per_micro_batch or leave it unset, "
        "a smaller micro_batch_group_size, or scheduler auto",
    ),
)


def batch_limit(scheduler: SchedulerKind, exc: BaseException) -> BatchLimit | None:
    """The BatchLimit `exc` (raised by `scheduler`'s upstream code) is, if any."""
    if not isinstance(exc, AssertionError):
        return None
    text = str(exc)
    return next((b for b in BATCH_LIMITS if b.scheduler is scheduler and b.upstream_message in text), None)


@dataclass(frozen=True)
class SchedulerDomain:
    """The DPxCP sizes one scheduler plans, per option class, and what to use elsewhere."""

    scheduler: SchedulerKind
    builds: str  # the builds measured (the scheduler's class is in these)
    rule: str  # the sizes, in words, for messages and the table
    instead: str  # what serves the sizes outside it
    # Whether micro_batch_group_size > 1 (VPP grouping, which runs another upstream function:
    # dynamic CP's align_sample_id_groups, static packing's move of samples to a multiple) is planned.
    vpp: bool
    # Whether the even sizes outside `exact_sizes` are planned batch by batch, with the substitute
    # where upstream's plan is not valid (the module doc).
    substitutes: bool = False

    def exact_sizes(self, dp_cp_size: int) -> bool:
        """Sizes where upstream's plan is valid for every batch the sweep tried."""
        if self.scheduler is SchedulerKind.STATIC_PACKING:
            return dp_cp_size >= 1
        return dp_cp_size >= 2 and is_power_of_two(dp_cp_size)

    def per_batch(self, dp_cp_size: int) -> bool:
        """Sizes planned batch by batch: upstream's plan where valid, the substitute elsewhere."""
        return self.substitutes and dp_cp_size >= 2 and dp_cp_size % 2 == 0 and not self.exact_sizes(dp_cp_size)

    def plans(self, dp_cp_size: int) -> bool:
        return self.exact_sizes(dp_cp_size) or self.per_batch(dp_cp_size)


DOMAINS: dict[SchedulerKind, SchedulerDomain] = {
    SchedulerKind.DYNAMIC_CP: SchedulerDomain(
        SchedulerKind.DYNAMIC_CP, "dev 0.19.0+dev.d48bd6b (no PyPI release has it)",
        "even (2 to 1024), with or without micro_batch_group_size; where it is not a power of two, batch by "
        "batch: upstream's plan where it is valid, else the substitute (static_packing's plan, named)",
        "", vpp=True, substitutes=True,
    ),
    SchedulerKind.HYBRID_CP: SchedulerDomain(
        SchedulerKind.HYBRID_CP, "0.19.2 and dev 0.19.0+dev.d48bd6b",
        "a power of two (2 to 1024), without micro_batch_group_size",
        "`auto` serves static_packing here", vpp=False,
    ),
    SchedulerKind.STATIC_PACKING: SchedulerDomain(
        SchedulerKind.STATIC_PACKING, "dev 0.19.0+dev.d48bd6b (0.19.x lacks it)",
        "every size, with or without micro_batch_group_size and max_seqs_per_micro_batch",
        "", vpp=True,
    ),
}


def per_batch(scheduler: SchedulerKind, dp_cp_size: int) -> bool:
    """Whether `scheduler` plans `dp_cp_size` ranks batch by batch, with the substitute (the module doc)."""
    return DOMAINS[scheduler].per_batch(dp_cp_size) if scheduler in DOMAINS else False


def layout_refusal(scheduler: SchedulerKind, data_parallel_size: int, context_parallel_size: int) -> str | None:
    """The refusal (without the field) of a layout outside `scheduler`'s domain; None inside it."""
    dp_cp = data_parallel_size * context_parallel_size
    domain = DOMAINS[scheduler]
    if domain.plans(dp_cp):
        return None
    return (
        f"{scheduler.value} plans only a DPxCP that is {domain.rule}; got {data_parallel_size}x{context_parallel_size} = {dp_cp}"
        f"{'; ' + domain.instead if domain.instead else ''}"
    )


def domain_table() -> str:
    """The markdown table docs/design.md holds (between its domain-table markers)."""
    lines = [
        "| scheduler | builds measured | DPxCP it plans (accepted) | outside: refused `INVALID_ARGUMENT` on `layout` "
        "| batches upstream refuses on an accepted layout: `OUT_OF_RANGE` |",
        "|---|---|---|---|---|",
    ]
    for kind, domain in DOMAINS.items():
        limits = "; ".join(f"\"{b.upstream_message}\": {b.meaning}" for b in BATCH_LIMITS if b.scheduler is kind) or "none seen"
        outside = "odd sizes (the dev build's parallel_state needs an even DPxCP)" if domain.substitutes else (
            "none" if kind is SchedulerKind.STATIC_PACKING else f"every other size; {domain.instead}"
        )
        lines.append(f"| `{kind.value}` | {domain.builds} | {domain.rule} | {outside} | {limits} |")
    return "\n".join(lines)
