"""verl's drop-in's part of the refusal table (docs/verl.md): its rows need the `verl` source, handed
with the settings when a schedule call's config is first built (the settings verl's engine runs) and
with each step's plan (the plans it cannot run). Registered with the drop-in
(trainer_client/verl/__init__.py)."""

from __future__ import annotations

from batch_planner.precision import Precision
from batch_planner.request import SchedulerKind
from trainer_client.refusals.compatibility import Inputs, Place, Rule, TableSource, kind_name
from trainer_client.errors import UnrunnablePlanError

SOURCE = "verl"
# verl's engine runs the dynamic-CP contract: dynamic CP, or auto choosing among these only (the one
# home of this allow-list; the rows below refuse the others).
VERL_SCHEDULERS = (SchedulerKind.DYNAMIC_CP,)


def _other_auto_schedulers(inputs: Inputs) -> list[str] | None:
    wanted = [kind_name(k) for k in inputs.at(Place("planner config", "auto_schedulers")) or ()]
    return [name for name in wanted if name not in [k.value for k in VERL_SCHEDULERS]] or None


def _ranks_without_sample(inputs: Inputs) -> str | None:
    empty = [(i, [r for g in mb.cp_groups if not g.sample_ids for r in range(g.first_rank, g.first_rank + g.size)])
             for i, mb in enumerate(inputs.plan.micro_batches)]
    return next((f"micro-batch {i}: DPxCP ranks {ranks} have no sample" for i, ranks in empty if ranks), None)


def _unaligned_group(inputs: Inputs) -> str | None:
    groups = (g for mb in inputs.plan.micro_batches for g in mb.cp_groups if g.first_rank % g.size)
    return next((f"CP group of ranks {list(range(g.first_rank, g.first_rank + g.size))} (sample ids {list(g.sample_ids)}), "
                 f"first rank {g.first_rank}" for g in groups), None)


# verl's dynamic CP runs bf16 only (verl's docs: no FP8 with dynamic CP), and the drop-in runs what verl
# runs (its plans pad for verl's engine): FP8, which the planner pads for with Megatron-LM and Bridge,
# stays refused here.
_NO_FP8 = ("verl's dynamic CP runs bf16 only (verl's docs: no FP8), and verl's drop-in runs what verl runs; "
           "the planner pads for FP8 with the Megatron-LM and Bridge drop-ins only: ")


def _not_bf16(value, _) -> bool:
    return value is not None and kind_name(value) != Precision.BF16.value


ROWS = (
    Rule(Place("planner config", "precision"), "not bf16", _NO_FP8 + "drop precision from the planner settings (or set bf16)",
         _not_bf16, needs=(SOURCE,)),
    Rule(Place("plan", "precision"), "not bf16", _NO_FP8 + "plan with precision bf16", _not_bf16, needs=(SOURCE,),
         error=UnrunnablePlanError),
    Rule(Place("planner config", "scheduler"), "not dynamic_cp or auto", "verl's engine runs the dynamic-CP contract (docs/verl.md): "
         "set scheduler to dynamic_cp or auto",
         lambda v, _: kind_name(v) not in [k.value for k in (*VERL_SCHEDULERS, SchedulerKind.AUTO)], needs=(SOURCE,)),
    Rule(Place("planner config", "auto_schedulers"), "names a scheduler other than dynamic_cp", "auto may choose only plans verl's "
         "engine runs: set auto_schedulers to [dynamic_cp] or leave it unset", lambda v, _: v is not None, read=_other_auto_schedulers,
         needs=(SOURCE,)),
    Rule(Place("plan", "micro_batches"), "a micro-batch in which a DPxCP rank runs no sample",
         "verl's engine runs every rank of the DPxCP group on a sample in every micro-batch; plan with dynamic_cp "
         "(its groups cover every rank)", lambda v, _: v is not None, read=_ranks_without_sample, needs=(SOURCE,),
         error=UnrunnablePlanError),
    Rule(Place("plan", "cp_groups"), "a CP group whose first rank is not a multiple of its size",
         "verl's engine runs CP groups of aligned ranks only (its per-size DPxCP groups); plan with dynamic_cp",
         lambda v, _: v is not None, read=_unaligned_group, needs=(SOURCE,), error=UnrunnablePlanError),
)

REFUSALS = TableSource(SOURCE, "verl's drop-in", ROWS)
