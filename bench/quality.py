"""Plan quality under the documented cost model (batch_planner/cost.py), in process.

    python -m bench.quality --out docs/bench

For every distribution and batch size, every scheduler of our API (Megatron-Core's, when the
installed release has it) and the static-CP estimate at CP 2, 4 and 8 (`cost.static_cp_step_cost`
on the same batch with context_parallel_size 2/4/8): predicted step cost / lower bound (1.00: no
imbalance left to recover), padding ratio, micro-batch count, CP-size mix (samples per CP size) and
the predicted speedup over static CP. The cost model is deterministic: one run per cell, no spread
to report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from batch_planner.cost import plan_statistics, single_rank_work, static_cp_step_cost
from batch_planner.cost_spec import CostModel
from batch_planner.errors import PlanningError
from batch_planner.padding import padded_length
from batch_planner.plan import Plan
from batch_planner.auto import Outcome, candidates, plan_serially, serve
from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.planner import plan_batch, plan_one_scheduler
from batch_planner.validation import RequestLimits
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import discover_schedulers, megatron_core_version
from bench.common import (
    DISTRIBUTION_NAMES,
    MAX_SEQLEN_PER_DP_CP_RANK,
    SIZES,
    SMOKE_SIZES,
    BatchSize,
    Report,
    argument_parser,
    make_request,
    markdown_table,
    pyplot,
    save_figure,
    write_report,
)

STATIC_CP_SIZES = (2, 4, 8)
SCHEDULER_NAMES = {
    SchedulerKind.HYBRID_CP: "hybrid CP",
    SchedulerKind.DYNAMIC_CP: "dynamic CP",
    SchedulerKind.STATIC_PACKING: "static packing",
    SchedulerKind.AUTO: "auto",
}
# auto is shown under these cost models (batch_planner/cost_spec.py): today's calibration of
# the 4-layer benchmark model and three real model shapes on H200.
AUTO_PRESETS = ("h200-bench-calibrated", "llama3-8b-h200", "llama3-70b-h200", "qwen3-30b-a3b-h200")
BEST_STATIC_CP_SIZES = (1, 2, 4, 8)
FAR_FROM_BOUND = 1.10
CP_COLOURS = {1: "#9ecae1", 2: "#fdae6b", 4: "#e6550d", 8: "#a63603", 16: "#756bb1", 32: "#54278f"}
PICTURE_DISTRIBUTION, PICTURE_SIZE = "lognormal_32k", BatchSize(64, 8)


@dataclass(frozen=True)
class Row:
    distribution: str
    size: BatchSize
    name: str
    cost_over_bound: float | None  # None: not available
    padding_ratio: float | None = None
    micro_batches: int | None = None
    cp_mix: str = ""
    speedups: tuple[float, ...] = ()  # over static CP 2, 4, 8
    note: str = ""


def static_cp_packs(request: PlanRequest) -> list[list[int]]:
    """The packs `cost.static_cp_step_cost` forms (its docstring: in order, up to the per-replica
    budget), for the micro-batch count only: the cost itself always comes from cost.py."""
    budget = request.max_seqlen_per_dp_cp_rank * request.context_parallel_size
    packs: list[list[int]] = []
    for length in request.sequence_lengths:
        if packs and sum(packs[-1]) + length <= budget:
            packs[-1].append(length)
        else:
            packs.append([length])
    return packs


def static_cp_row(distribution: str, size: BatchSize, request: PlanRequest, cp: int, model: CostModel) -> Row:
    static = request.replace(context_parallel_size=cp, data_parallel_size=size.ranks // cp)
    cost = static_cp_step_cost(static, model)
    packs = static_cp_packs(static)
    dp = static.data_parallel_size
    lengths = static.sequence_lengths
    assert [n for pack in packs for n in pack] == list(lengths), "packs must keep every sample, in order"
    padded = sum(padded_length(n, cp, static.tensor_parallel_size, static.cp_layout, static.padding) for n in lengths)
    lower = single_rank_work(model, lengths) / size.ranks
    too_long = [n for n in lengths if n > MAX_SEQLEN_PER_DP_CP_RANK * cp]
    note = (
        f"{len(too_long)} sample(s) up to {max(too_long):,} tokens exceed CP{cp}'s {MAX_SEQLEN_PER_DP_CP_RANK * cp:,}"
        "-token budget: static CP at this size could not run this batch (estimate packs them alone)"
        if too_long
        else ""
    )
    # Micro-batches: packs per DP replica (pack k runs on replica k % DP), the busiest replica's.
    return Row(
        distribution, size, f"static CP{cp} (estimate)", cost / lower, (padded - sum(lengths)) / padded,
        -(-len(packs) // dp), f"{cp}:{len(lengths)}", note=note,
    )


def scheduler_row(distribution: str, size: BatchSize, kind: SchedulerKind, static_costs: list[float], model: CostModel) -> tuple[Row, Plan | None]:
    availability = discover_schedulers()[kind]
    if not availability.available:
        return Row(distribution, size, SCHEDULER_NAMES[kind], None,
                   note=f"not available in Megatron-Core {megatron_core_version()}"), None
    try:
        plan = plan_batch(make_request(distribution, size, scheduler=kind), cost_model=model)
    except PlanningError as refused:  # e.g. static packing: a sample longer than CP x the budget
        return Row(distribution, size, SCHEDULER_NAMES[kind], None, note=f"refused: {refused}"), None
    s = plan.statistics
    mix = ", ".join(f"{cp}:{samples}" for cp, samples, _ in s.cp_size_mix)
    return Row(
        distribution, size, SCHEDULER_NAMES[kind], s.predicted_step_cost / s.lower_bound_cost,
        s.padding_ratio, s.micro_batch_count, mix,
        tuple(c / s.predicted_step_cost for c in static_costs),
    ), plan


@dataclass(frozen=True)
class AutoRow:
    """auto's plan for one batch under one preset, against the best static CP (1, 2, 4 or 8)."""

    distribution: str
    size: BatchSize
    preset: str
    winner: str
    cost_over_bound: float
    best_static: str  # the cheapest static-CP candidate, or "-" when none can run the batch
    speedup_over_best_static: float | None
    speedup_over_job_static: float


def reprice(outcomes: list[Outcome], model: CostModel) -> list[Outcome]:
    """The same candidates' plans priced under another cost model (the plans do not depend on it)."""
    return [
        o if o.plan is None else replace(o, plan=replace(o.plan, statistics=plan_statistics(
            o.plan.micro_batches, o.candidate.request, o.plan.capacity_bound, model)))
        for o in outcomes
    ]


def auto_rows(distribution: str, size: BatchSize) -> list[AutoRow]:
    """auto's candidates planned once, then priced under each preset (the plans do not depend on
    the cost model; only the choice does)."""
    request = make_request(distribution, size, scheduler=SchedulerKind.AUTO)
    outcomes = plan_serially(candidates(request), partial(plan_one_scheduler, limits=RequestLimits(), cost_model=CostModel()))
    rows = []
    for preset in AUTO_PRESETS:
        model = cost_model_for_preset(preset)
        priced = reprice(outcomes, model)
        plan = serve(request, priced, model, megatron_core_version())
        s = plan.statistics
        statics = [o for o in priced if o.cost is not None and o.candidate.name in {f"static_cp{c}" for c in BEST_STATIC_CP_SIZES}]
        best = min(statics, key=lambda o: o.cost) if statics else None
        winner = next(c.name for c in plan.candidates if c.served)
        rows.append(AutoRow(
            distribution, size, preset, winner, s.predicted_step_cost / s.lower_bound_cost,
            best.candidate.name if best else "-", best.cost / s.predicted_step_cost if best else None,
            s.predicted_speedup_over_static_cp,
        ))
    return rows


def measure(sizes, model: CostModel) -> tuple[list[Row], dict[tuple[str, int], Plan]]:
    rows: list[Row] = []
    plans: dict[tuple[str, int], Plan] = {}
    for distribution in DISTRIBUTION_NAMES:
        for size in sizes:
            request = make_request(distribution, size)
            static_rows = [static_cp_row(distribution, size, request, cp, model) for cp in STATIC_CP_SIZES]
            static_costs = [
                static_cp_step_cost(request.replace(context_parallel_size=cp, data_parallel_size=size.ranks // cp), model)
                for cp in STATIC_CP_SIZES
            ]
            for kind in (k for k in SchedulerKind if k is not SchedulerKind.AUTO):  # auto: its own table
                row, plan = scheduler_row(distribution, size, kind, static_costs, model)
                rows.append(row)
                if plan is not None:
                    plans[(distribution, size.samples, kind)] = plan
            rows += static_rows
    return rows, plans


def plot_cost_ratios(rows: list[Row], sizes, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey=False)
    names = list(dict.fromkeys(r.name for r in rows if r.cost_over_bound is not None))
    missing = sorted({r.name for r in rows} - set(names))
    colours = ["#4c72b0", "#dd8452", "#c44e52", "#8c564b", "#55a868", "#8172b3"]
    width = 0.8 / len(names)
    for ax, distribution in zip(axes.flat, DISTRIBUTION_NAMES):
        for k, name in enumerate(names):
            values = [  # NaN: no bar where the scheduler refused this batch
                next(r.cost_over_bound for r in rows if r.distribution == distribution and r.size == s and r.name == name)
                or float("nan")  # refused for this cell (see the table's note)
                for s in sizes
            ]
            ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(sizes))], values, width,
                   label=name, color=colours[k % len(colours)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sizes)), [s.label for s in sizes])
        ax.set_title(distribution)
        ax.set_ylabel("predicted step cost / lower bound")
    axes.flat[0].legend(fontsize=8)
    title = "Plan quality (lower is better; 1.0 = no imbalance left to recover)"
    if missing:
        title += f"\nnot available in Megatron-Core {megatron_core_version()}: {', '.join(missing)}"
    fig.suptitle(title)
    save_figure(fig, path)


def plot_plan(plan: Plan, lengths: tuple[int, ...], path: Path) -> None:
    """Ranks across, micro-batches down; each sample a box as wide as its CP group and as tall as
    the tokens it puts on each rank, stacked per rank (hybrid CP runs them one after another)."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    n_mb = len(plan.micro_batches)
    fig, axes = plt.subplots(n_mb, 1, figsize=(10, 2.6 * n_mb + 0.8), squeeze=False)
    used: set[int] = set()
    for mb_index, (ax, micro_batch) in enumerate(zip(axes[:, 0], plan.micro_batches)):
        top = 0
        for group in micro_batch.cp_groups:
            bottom = 0.0
            for sample_id in group.sample_ids:
                height = padded_length(lengths[sample_id], group.size, plan.tensor_parallel_size, plan.cp_layout, plan.padding) / group.size
                colour = CP_COLOURS.get(group.size, "#636363")
                used.add(group.size)
                ax.add_patch(Rectangle((group.first_rank + 0.04, bottom), group.size - 0.08, height,
                                       facecolor=colour, edgecolor="white", linewidth=1.2))
                if height > 900:
                    ax.text(group.first_rank + group.size / 2, bottom + height / 2,
                            f"#{sample_id}\n{lengths[sample_id]:,}" if height > 2200 else f"#{sample_id}",
                            ha="center", va="center", fontsize=7)
                bottom += height
            top = max(top, bottom)
        ax.axhline(MAX_SEQLEN_PER_DP_CP_RANK, color="#c44e52", linestyle=":", linewidth=1)
        ax.set_xlim(0, plan.dp_cp_size)
        ax.set_ylim(0, max(top, MAX_SEQLEN_PER_DP_CP_RANK) * 1.05)
        ax.set_xticks([r + 0.5 for r in range(plan.dp_cp_size)], [f"rank {r}" for r in range(plan.dp_cp_size)])
        ax.set_ylabel(f"micro-batch {mb_index}\ntokens per rank")
    handles = [Patch(color=CP_COLOURS.get(c, "#636363"), label=f"CP{c}" + (" (alone on its rank)" if c == 1 else f" (split over {c} ranks)"))
               for c in sorted(used)]
    handles.append(plt.Line2D([], [], color="#c44e52", linestyle=":", label=f"max_seqlen_per_dp_cp_rank {MAX_SEQLEN_PER_DP_CP_RANK:,} (per sample)"))
    axes[0, 0].legend(handles=handles, fontsize=8, loc="upper right")
    s = plan.statistics
    fig.suptitle(
        f"{SCHEDULER_NAMES[plan.scheduler]} plan: {len(lengths)} samples ({PICTURE_DISTRIBUTION}) on {plan.dp_cp_size} ranks, "
        f"{len(plan.micro_batches)} micro-batches\n"
        f"boxes = samples (#id, length), stacked = {'packed into one pass' if plan.capacity_bound.value == 'per_rank_sum' else 'run one after another'}; "
        f"cost/lower bound {s.predicted_step_cost / s.lower_bound_cost:.2f}, padding {s.padding_ratio:.2%}"
    )
    save_figure(fig, path)


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def run(out: Path, smoke: bool = False) -> Report[Row | AutoRow]:
    sizes = SMOKE_SIZES if smoke else SIZES
    model = CostModel()
    rows, plans = measure(sizes, model)
    suffix = "_smoke" if smoke else ""
    header = ["distribution", "samples on ranks", "plan", "cost / lower bound", "padding ratio",
              "micro-batches", "CP-size mix (cp:samples)", "speedup over static CP2 / CP4 / CP8", "note"]
    table = markdown_table(header, [
        [r.distribution, r.size.label, r.name, fmt(r.cost_over_bound, "{:.2f}"), fmt(r.padding_ratio, "{:.2%}"),
         fmt(r.micro_batches, "{}"), r.cp_mix or "-",
         " / ".join(f"{x:.2f}x" for x in r.speedups) or "-", r.note or "-"]
        for r in rows
    ])
    plot_cost_ratios(rows, sizes, out / f"quality_cost_ratio{suffix}.png")
    autos = [a for distribution in DISTRIBUTION_NAMES for size in sizes for a in auto_rows(distribution, size)]
    auto_table = markdown_table(
        ["distribution", "samples on ranks", "cost model (preset)", "auto serves", "cost / lower bound",
         "best static CP (1/2/4/8)", "speedup over the best static CP", "speedup over the job's static CP2"],
        [[a.distribution, a.size.label, a.preset, a.winner, f"{a.cost_over_bound:.2f}", a.best_static,
          fmt(a.speedup_over_best_static, "{:.2f}x"), f"{a.speedup_over_job_static:.2f}x"] for a in autos],
    )
    far = [a for a in autos if a.cost_over_bound > FAR_FROM_BOUND]
    picture_kind = SchedulerKind.DYNAMIC_CP if (PICTURE_DISTRIBUTION, PICTURE_SIZE.samples, SchedulerKind.DYNAMIC_CP) in plans else SchedulerKind.HYBRID_CP
    picture = plans[(PICTURE_DISTRIBUTION, PICTURE_SIZE.samples, picture_kind)]
    plot_plan(picture, make_request(PICTURE_DISTRIBUTION, PICTURE_SIZE).sequence_lengths, out / f"plan_picture{suffix}.png")
    coefficients = ", ".join(f"{k} = {v:g}" for k, v in model.__dict__.items())
    return write_report(
        out, f"quality{suffix}", "Plan quality under the cost model",
        (__doc__ or "").split("\n\n", 2)[2].strip()
        + f"\n\nCost model (defaults of `CostModel`): {coefficients}. Requests: DPxCP ranks as listed, "
        f"max_seqlen_per_dp_cp_rank {MAX_SEQLEN_PER_DP_CP_RANK}, TP 1, zigzag layout, seed 0. "
        "The lower bound is the plan statistics' (docs/cost-model.md): what no plan of the request can "
        "avoid, the work spread evenly over all ranks, the passes of the fewest micro-batches and the CP terms "
        "of samples longer than one rank's budget. The static-CP estimates are not plans: their rows are "
        "measured against the total CP1 work spread evenly over all ranks.",
        [
            ("Results", table),
            ("auto under model presets", auto_table + "\n\n" + (
                f"{len(far)} of {len(autos)} auto cells are above {FAR_FROM_BOUND:.2f}x the lower bound "
                "(docs/benchmarks.md says why)." if far else f"Every auto cell is within {FAR_FROM_BOUND:.2f}x the lower bound.")),
            ("Cost / lower bound per distribution", f"![cost over lower bound](quality_cost_ratio{suffix}.png)"),
            ("One plan at a glance", f"![a {picture_kind.value} plan](plan_picture{suffix}.png)"),
        ],
        rows=rows + autos,
    )


def main(argv: list[str] | None = None) -> None:
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    print(run(args.out, args.smoke).path.read_text())


if __name__ == "__main__":
    main()
