"""The plan statistics' lower bound (batch_planner/lower_bound.py) against the real planner: no
served plan costs less, on the differential corpus for every scheduler the installed Megatron-Core
has and for auto; nor does any other plan that keeps the invariants (random plans built here, and
every plan of tiny batches, searched through); each term on hand-made batches, computed by hand and
reached by a plan priced by cost.step_cost; and the demo's batch.

Costs are float sums in different orders on the two sides, so "not below" allows a relative
1e-9 (`TOLERANCE`): far above their rounding, far below any term of the bound.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import statistics

import numpy as np
import pytest

from batch_planner.auto import lower_bound as auto_skip_bound
from batch_planner.cost import group_work_seconds, single_rank_work, step_cost
from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.cost_spec import CostModel, preset_names
from batch_planner.distributions import sample_lengths
from batch_planner.errors import PlanningError
from batch_planner.lower_bound import LowerBound, step_lower_bound
from batch_planner.padding import PlanPadding
from batch_planner.plan import MicroBatch, Plan, check_plan_invariants, groups_from_rank_assignment
from batch_planner.planner import plan_batch
from batch_planner.request import CapacityBound, CpLayout, PlanRequest, SchedulerKind
from batch_planner.schedulers import SCHEDULER_SPECS, valid_cp_sizes
from tests.support.exact_corpus import corpus
from tests.support.megatron_builds import require_scheduler

TOLERANCE = 1e-9
CONCRETE = (SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING, SchedulerKind.HYBRID_CP)
CORPUS_CASES = {SchedulerKind.DYNAMIC_CP: 400, SchedulerKind.STATIC_PACKING: 1600, SchedulerKind.HYBRID_CP: 400, SchedulerKind.AUTO: 80}
# Fixed costs far above the work terms, so that the pass and CP terms of the bound decide.
FIXED_HEAVY = CostModel(seconds_per_token=1e-9, seconds_per_attention_token_pair=0.0, cp_seconds_per_micro_batch=1e-2,
                        cp_seconds_per_token=1e-9, seconds_per_pass=1e-3)
MODELS = (CostModel(), FIXED_HEAVY, *(cost_model_for_preset(name) for name in preset_names()))


def _bound(request: PlanRequest, model: CostModel) -> LowerBound:
    return step_lower_bound(request, SCHEDULER_SPECS[request.scheduler].capacity_bound, model)


def _corpus_request(case, kind: SchedulerKind, rng: random.Random) -> PlanRequest:
    options: dict = {"scheduler": kind}
    if kind in (SchedulerKind.DYNAMIC_CP, SchedulerKind.AUTO) and case.min_cp_size > 1:
        options["min_cp_size"] = case.min_cp_size
    if kind is not SchedulerKind.HYBRID_CP:
        options["micro_batch_group_size"] = case.micro_batch_group_size
    if kind is SchedulerKind.STATIC_PACKING and rng.random() < 0.3:
        options["max_seqs_per_micro_batch"] = rng.choice((1, 2, 3, 8))
    options["tensor_parallel_size"] = rng.choice((1, 1, 2))
    options["cp_layout"] = rng.choice(tuple(CpLayout))
    return PlanRequest.of(case.lengths, case.dp, case.cp, case.max_seqlen, **options)


@pytest.mark.parametrize("kind", [*CONCRETE, SchedulerKind.AUTO], ids=lambda k: k.value)
def test_no_served_plan_of_the_corpus_costs_less_than_its_lower_bound(kind, capsys):
    if kind is SchedulerKind.AUTO:
        require_scheduler(SchedulerKind.STATIC_PACKING)  # auto's first candidate
    else:
        require_scheduler(kind)
    rng = random.Random(f"lower-bound:{kind.value}")
    efficiencies = []
    for case in corpus(CORPUS_CASES[kind], seed=3):
        model = rng.choice(MODELS)
        request = _corpus_request(case, kind, rng)
        try:
            plan = plan_batch(request, cost_model=model)
        except PlanningError:
            continue  # refused: no plan to check
        s = plan.statistics
        assert s.predicted_step_cost >= s.lower_bound_cost * (1 - TOLERANCE), case.describe()
        assert s.lower_bound_cost >= single_rank_work(model, request.sequence_lengths) / request.dp_cp_size * (1 - TOLERANCE)
        assert s.balance_efficiency == s.lower_bound_cost / s.predicted_step_cost
        if kind is not SchedulerKind.AUTO:
            _check_terms(plan, request, model)
        efficiencies.append(s.balance_efficiency)
    with capsys.disabled():
        print(f"\nlower bound, {kind.value}: {len(efficiencies)} served plans of the corpus at or above their bound; balance "
              f"efficiency min {min(efficiencies):.3f}, median {statistics.median(efficiencies):.3f}, "
              f"{sum(e > 1 - 1e-6 for e in efficiencies)} at the bound")
    assert len(efficiencies) >= (40 if kind is SchedulerKind.AUTO else 150)


def _check_terms(plan: Plan, request: PlanRequest, model: CostModel) -> None:
    """What the bound assumes of a served plan: at least its fewest micro-batches, a multiple of
    micro_batch_group_size (packing schedulers), and hybrid CP's bound at least auto's skip bound."""
    bound = step_lower_bound(request, plan.capacity_bound, model)
    assert len(plan.micro_batches) >= bound.fewest_micro_batches
    if plan.capacity_bound is CapacityBound.PER_RANK_SUM:
        assert len(plan.micro_batches) % (request.micro_batch_group_size or 1) == 0
    skip = auto_skip_bound(request, model)
    if skip is not None:
        assert bound.cost >= skip * (1 - TOLERANCE)


# Random plans that keep the invariants: the bound holds for every plan, not only the scheduler's.

def _layout(rng: random.Random, ranks: int, sizes: list[int]) -> list[int] | None:
    """Aligned CP group sizes covering `ranks`, drawn at random from `sizes`; None when stuck."""
    layout, start = [], 0
    while start < ranks:
        fitting = [c for c in sizes if start % c == 0 and start + c <= ranks]
        if not fitting:
            return None
        layout.append(rng.choice(fitting))
        start += layout[-1]
    return layout


def _random_plan(request: PlanRequest, packed: bool, rng: random.Random) -> list[list[tuple[int, list[int]]]] | None:
    """Micro-batches of (CP size, sample ids) groups in rank order, every group holding a sample,
    within the capacity rule; None when the draw gets stuck."""
    lengths, limit, ranks = request.sequence_lengths, request.max_seqlen_per_dp_cp_rank, request.dp_cp_size
    sizes = sorted(valid_cp_sizes(request.scheduler, ranks, request.context_parallel_size, request.min_cp_size))
    pool = list(range(len(lengths)))
    rng.shuffle(pool)
    dense = rng.random() < 0.5
    plan: list[list[tuple[int, list[int]]]] = []

    def place(sample: int, groups: list[tuple[int, list[int]]]) -> bool:
        for c, ids in rng.sample(groups, len(groups)):
            held = [lengths[i] for i in ids] + [lengths[sample]]
            if (sum(held) if packed else max(held)) <= limit * c:
                ids.append(sample)
                return True
        return False

    while pool:
        layout = _layout(rng, ranks, sizes) if rng.random() < 0.8 else [ranks] if ranks in sizes else None
        if layout is None:
            return None
        anchors: list[int | None] = []
        for c in layout:
            anchors.append(next((s for s in pool if lengths[s] <= limit * c and s not in anchors), None))
        if None in anchors and ranks in sizes:
            layout, anchors = [ranks], pool[:1]  # one group of every rank: one sample fills it
        if None in anchors:
            # No new micro-batch fills every group: the rest go into the groups there are, or the draw fails.
            every_group = [group for mb in plan for group in mb]
            return plan if all(place(s, every_group) for s in pool) else None
        groups = [(c, [s]) for c, s in zip(layout, anchors) if s is not None]  # a sample for every group: no idle rank
        for s in anchors:
            pool.remove(s)
        for s in list(pool) if dense else rng.sample(pool, rng.randint(0, len(pool))):
            if place(s, groups):
                pool.remove(s)
        plan.append(groups)
    return plan


def _priced(request: PlanRequest, capacity: CapacityBound, micro_batches: list[list[tuple[int, list[int]]]], model: CostModel) -> float:
    """cost.step_cost of a plan given as (CP size, sample ids) per group, after checking its invariants."""
    padding = PlanPadding.for_request(request)
    built = tuple(
        MicroBatch(groups_from_rank_assignment([ids for c, ids in mb for _ in range(c)], padding)) for mb in micro_batches
    )
    plan = Plan("", request.scheduler, "", "", request.dp_cp_size, request.tensor_parallel_size, request.cp_layout, capacity, built)
    check_plan_invariants(plan, request, valid_cp_sizes(request.scheduler, request.dp_cp_size, request.context_parallel_size, request.min_cp_size))
    return step_cost(built, request, model, capacity is CapacityBound.PER_RANK_SUM)


def _random_request(rng: random.Random, kind: SchedulerKind) -> PlanRequest:
    ranks = rng.choice((2, 4, 8, 16) if kind is SchedulerKind.HYBRID_CP else (2, 4, 6, 8, 12, 16, 20))
    cp = rng.choice([c for c in (1, 2, 4) if ranks % c == 0])
    limit = rng.choice((64, 100, 256))
    top = limit * (cp if kind is SchedulerKind.STATIC_PACKING else max(c for c in (1, 2, 4, 8, 16) if c <= ranks // 2 or c == 1))
    lengths = [min(top, max(1, int(rng.paretovariate(1.2) * limit / 4))) for _ in range(rng.randint(max(1, ranks // 3), 6 * ranks))]
    min_cp = rng.choice((None, None, 2)) if kind is SchedulerKind.DYNAMIC_CP else None
    return PlanRequest.of(lengths, ranks // cp, cp, limit, scheduler=kind, min_cp_size=min_cp,
                          tensor_parallel_size=rng.choice((1, 2)), cp_layout=rng.choice(tuple(CpLayout)))


@pytest.mark.parametrize("kind", CONCRETE, ids=lambda k: k.value)
def test_no_plan_that_keeps_the_invariants_costs_less_than_the_bound(kind, capsys):
    """Plans drawn at random within the capacity rule, not the scheduler's: the bound is of every
    plan of the request, so none of them may cost less."""
    rng = random.Random(f"random-plans:{kind.value}")
    capacity = SCHEDULER_SPECS[kind].capacity_bound
    ratios = []
    for _ in range(400):
        request = _random_request(rng, kind)
        model = rng.choice(MODELS)
        bound = step_lower_bound(request, capacity, model).cost
        for _ in range(4):
            drawn = _random_plan(request, capacity is CapacityBound.PER_RANK_SUM, rng)
            if drawn is None:
                continue
            cost = _priced(request, capacity, drawn, model)
            assert cost >= bound * (1 - TOLERANCE), (request, drawn)
            ratios.append(bound / cost)
    checked, closest = len(ratios), max(ratios)
    with capsys.disabled():
        print(f"\nlower bound, {kind.value}: {checked} random plans within the invariants at or above it (closest: bound/cost {closest:.3f})")
    assert checked > 400


def _layouts(ranks: int, sizes: list[int]) -> list[tuple[int, ...]]:
    """Every aligned way to cover `ranks` with CP groups of `sizes`."""
    if ranks == 0:
        return [()]
    found = []

    def extend(start: int, layout: tuple[int, ...]) -> None:
        if start == ranks:
            found.append(layout)
        for c in sizes:
            if start % c == 0 and start + c <= ranks:
                extend(start + c, layout + (c,))

    extend(0, ())
    return found


def _cheapest_plan(request: PlanRequest, model: CostModel) -> float:
    """The cheapest step cost of every plan of a tiny request: every way to split its samples into
    micro-batches of aligned groups, each group holding a sample within the capacity rule (and, as
    the schedulers guarantee, static packing's cap on samples per pack and a multiple of
    micro_batch_group_size micro-batches)."""
    capacity = SCHEDULER_SPECS[request.scheduler].capacity_bound
    packed = capacity is CapacityBound.PER_RANK_SUM
    lengths, limit = request.sequence_lengths, request.max_seqlen_per_dp_cp_rank
    layouts = _layouts(request.dp_cp_size, sorted(valid_cp_sizes(request.scheduler, request.dp_cp_size, request.context_parallel_size, request.min_cp_size)))
    cap = request.max_seqs_per_micro_batch or len(lengths)
    group_size = request.micro_batch_group_size or 1
    padding = PlanPadding.for_request(request)

    def fits(c: int, ids: list[int]) -> bool:
        held = [lengths[i] for i in ids]
        return len(ids) <= cap and (sum(held) if packed else max(held)) <= limit * c

    def micro_batch(layout: tuple[int, ...], members: tuple[int, ...]):
        for assignment in itertools.product(range(len(layout)), repeat=len(members)):
            groups: list[list[int]] = [[] for _ in layout]
            for sample, g in zip(members, assignment):
                groups[g].append(sample)
            if all(groups) and all(fits(c, ids) for c, ids in zip(layout, groups)):
                yield max(group_work_seconds(model, padding.padded_tokens(ids, c), sum(lengths[i] ** 2 for i in ids), c, len(ids), packed)
                          for c, ids in zip(layout, groups))

    @functools.cache
    def cheapest(remaining: frozenset[int], count: int) -> float:
        if not remaining:
            return 0.0 if count % group_size == 0 else math.inf
        first, rest = min(remaining), sorted(remaining - {min(remaining)})
        best = math.inf
        for layout in layouts:
            for k in range(len(rest) + 1):
                for others in itertools.combinations(rest, k):
                    members = (first, *others)
                    for seconds in micro_batch(layout, members):
                        best = min(best, seconds + cheapest(remaining - set(members), (count + 1) % group_size))
        return best

    return cheapest(frozenset(range(len(lengths))), 0)


def test_no_plan_of_a_tiny_batch_costs_less_than_the_bound(capsys):
    """Up to 5 samples on 2 or 4 ranks: every plan there is, searched through; the cheapest is
    still at or above the bound."""
    rng = random.Random(11)
    checked, tightest = 0, 0.0
    for _ in range(300):
        kind = rng.choice(CONCRETE)
        ranks = rng.choice((2, 4))
        cp = rng.choice([c for c in (1, 2, 4) if ranks % c == 0]) if kind is SchedulerKind.STATIC_PACKING else 1
        limit = rng.choice((50, 100))
        top = limit * (cp if kind is SchedulerKind.STATIC_PACKING else ranks)
        lengths = tuple(rng.randint(1, min(top, rng.choice((limit // 2, limit, 2 * limit, top)))) for _ in range(rng.randint(1, 5)))
        options = {
            "micro_batch_group_size": rng.choice((None, None, 2)) if kind is not SchedulerKind.HYBRID_CP else None,
            "min_cp_size": rng.choice((None, 2)) if kind is SchedulerKind.DYNAMIC_CP and ranks > 2 else None,
            "max_seqs_per_micro_batch": rng.choice((None, 1, 2)) if kind is SchedulerKind.STATIC_PACKING else None,
            "tensor_parallel_size": rng.choice((1, 2)),
            "cp_layout": rng.choice(tuple(CpLayout)),
        }
        request = PlanRequest.of(lengths, ranks // cp, cp, limit, scheduler=kind, **options)
        model = rng.choice(MODELS)
        cheapest = _cheapest_plan(request, model)
        if math.isinf(cheapest):
            continue  # no plan at all
        bound = _bound(request, model).cost
        assert cheapest >= bound * (1 - TOLERANCE), (request, model)
        checked, tightest = checked + 1, max(tightest, bound / cheapest)
    with capsys.disabled():
        print(f"\nlower bound: {checked} tiny batches, every plan searched; the cheapest at or above it (tightest: bound/cheapest {tightest:.3f})")
    assert checked > 200


# Each term by hand: a batch whose bound is computed here, and a plan that reaches it.

def _model(**coefficients: float) -> CostModel:
    zero = dict(seconds_per_token=0.0, seconds_per_attention_token_pair=0.0, cp_seconds_per_micro_batch=0.0,
                cp_seconds_per_token=0.0, seconds_per_pass=0.0)
    return CostModel(**{**zero, **coefficients})


def test_even_work_counts_padding_at_the_cheapest_cp_size():
    model = _model(seconds_per_token=1e-6)
    request = PlanRequest.of((101, 300, 301, 500), 2, 1, 1000, scheduler=SchedulerKind.DYNAMIC_CP, tensor_parallel_size=2)
    bound = _bound(request, model)
    # CP1 pads to multiples of TP 2: 102 + 300 + 302 + 500 tokens over 2 ranks.
    assert bound.even == pytest.approx(1e-6 * 1204 / 2, rel=1e-12)
    # 500 split over 2 ranks (zigzag: padded to 504) is one sample's cheapest own pass.
    assert bound.single == pytest.approx(1e-6 * 504 / 2, rel=1e-12)
    assert bound.cost == bound.even
    reached = _priced(request, CapacityBound.PER_RANK_SUM, [[(1, [0, 3]), (1, [1, 2])]], model)
    assert reached == pytest.approx(bound.cost, rel=1e-12)


def test_every_micro_batch_of_the_fewest_costs_a_pass_on_every_rank():
    model = _model(seconds_per_token=1e-6, seconds_per_pass=1e-3)
    request = PlanRequest.of((100,) * 8, 2, 1, 100, scheduler=SchedulerKind.DYNAMIC_CP)
    bound = _bound(request, model)
    assert bound.fewest_micro_batches == 4  # 800 tokens, 2 ranks of 100 a micro-batch
    assert bound.even == pytest.approx(1e-6 * 800 / 2 + 4 * 1e-3, rel=1e-12)
    reached = _priced(request, CapacityBound.PER_RANK_SUM, [[(1, [2 * k]), (1, [2 * k + 1])] for k in range(4)], model)
    assert reached == pytest.approx(bound.cost, rel=1e-12)
    # Virtual pipeline: the count is a multiple of micro_batch_group_size.
    vpp = _bound(request.replace(micro_batch_group_size=3), model)
    assert vpp.fewest_micro_batches == 6
    assert vpp.even == pytest.approx(1e-6 * 800 / 2 + 6 * 1e-3, rel=1e-12)


def test_the_planner_reaches_the_bound_where_the_batch_divides_evenly():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    model = _model(seconds_per_token=1e-6, seconds_per_pass=1e-3)
    plan = plan_batch(PlanRequest.of((100,) * 8, 2, 1, 100, scheduler=SchedulerKind.DYNAMIC_CP), cost_model=model)
    assert plan.statistics.balance_efficiency == pytest.approx(1.0, rel=1e-12)


def test_static_packing_counts_its_cap_on_sequences_and_its_cp_group_on_every_rank():
    model = _model(seconds_per_token=1e-6, seconds_per_pass=1e-3, cp_seconds_per_micro_batch=1e-2)
    request = PlanRequest.of((10,) * 12, 2, 2, 1000, scheduler=SchedulerKind.STATIC_PACKING, max_seqs_per_micro_batch=2)
    bound = _bound(request, model)
    # 12 samples, at most 2 a pack, 2 packs (DP replicas) a micro-batch: 3 micro-batches.
    assert bound.fewest_micro_batches == 3
    assert bound.rank_passes == bound.cp_rank_passes == 4 * 3  # CP2 everywhere: every rank pays the CP fixed term
    # Each sample on CP2, zigzag: padded to 12.
    assert bound.even == pytest.approx((1e-6 * 12 * 12 + 1e-2 * 12) / 4 + 3 * 1e-3, rel=1e-12)
    micro_batches = [[(2, [4 * k, 4 * k + 1]), (2, [4 * k + 2, 4 * k + 3])] for k in range(3)]
    assert _priced(request, CapacityBound.PER_RANK_SUM, micro_batches, model) == pytest.approx(bound.cost, rel=1e-12)


@pytest.mark.parametrize(
    ("lengths", "ranks"),
    [
        ((350, 150, 150), 8),  # 650 tokens fill 7 ranks' budgets; CP sizes are even: 8
        ((350,), 4),  # 3.5 ranks' budgets, and the smallest group 350 fits is 4
        ((150,), 2),  # 1.5 budgets: a CP2 group
        ((101, 101, 101), 4),  # 3.03 budgets: 4
    ],
)
def test_samples_longer_than_one_rank_pay_the_cp_fixed_term_on_the_ranks_they_fill(lengths, ranks):
    model = _model(seconds_per_token=1e-9, cp_seconds_per_micro_batch=1e-2)
    shorts = (10,) * 8
    request = PlanRequest.of(lengths + shorts, 8, 1, 100, scheduler=SchedulerKind.DYNAMIC_CP, cp_layout=CpLayout.CONTIGUOUS)
    bound = _bound(request, model)
    assert bound.cp_rank_passes == ranks
    # A CP group of c pads to a multiple of 2c (contiguous too); each long sample at its cheapest size.
    padded = {350: 352, 150: 152, 101: 104}
    tokens = sum(padded[n] for n in lengths) + sum(shorts)
    assert bound.even == pytest.approx((1e-9 * tokens + 1e-2 * ranks) / 8, rel=1e-12)


@pytest.mark.parametrize("kind", [SchedulerKind.DYNAMIC_CP, SchedulerKind.HYBRID_CP], ids=lambda k: k.value)
def test_fewer_samples_than_ranks_put_ranks_into_cp_groups(kind):
    """No rank idles: a micro-batch's CP1 groups hold a sample each, so with 3 samples on 8 ranks
    at least 5 ranks are in CP groups; CP sizes are even, so 6."""
    model = _model(seconds_per_token=1e-9, seconds_per_pass=1e-3, cp_seconds_per_micro_batch=1e-2)
    request = PlanRequest.of((10, 10, 10), 8, 1, 100, scheduler=kind, cp_layout=CpLayout.CONTIGUOUS)
    bound = _bound(request, model)
    assert bound.rank_passes == 8  # every rank runs a pass
    assert bound.cp_rank_passes == 6
    assert bound.even == pytest.approx((1e-9 * 30 + 1e-3 * 8 + 1e-2 * 6) / 8, rel=1e-12)
    # 8 ranks in 3 aligned groups: CP4 and two CP2 at best.
    reached = _priced(request, SCHEDULER_SPECS[kind].capacity_bound, [[(4, [0]), (2, [1]), (2, [2])]], model)
    assert reached >= bound.cost


def test_a_minimum_cp_size_puts_the_cp_fixed_term_on_every_rank():
    model = _model(seconds_per_token=1e-9, cp_seconds_per_micro_batch=1e-2)
    request = PlanRequest.of((10,) * 16, 8, 1, 100, scheduler=SchedulerKind.DYNAMIC_CP, min_cp_size=2)
    bound = _bound(request, model)
    assert bound.fewest_micro_batches == 1
    assert bound.cp_rank_passes == 8
    assert bound.even == pytest.approx((1e-9 * 16 * 12 + 1e-2 * 8) / 8, rel=1e-12)  # zigzag CP2 pads 10 to 12


def test_hybrid_cp_counts_each_samples_own_pass_on_the_smallest_group_it_fits():
    model = _model(seconds_per_token=1e-6, seconds_per_pass=1e-3, cp_seconds_per_micro_batch=1e-2)
    request = PlanRequest.of((350, 150, 50, 50), 4, 1, 100, scheduler=SchedulerKind.HYBRID_CP)
    bound = _bound(request, model)
    assert bound.fewest_micro_batches == 1
    assert (bound.rank_passes, bound.cp_rank_passes) == (4 + 2 + 1 + 1, 4 + 2)
    # 350 on CP4 (zigzag: 352), 150 on CP2 (152), 50 and 50 on CP1; each its own pass on every rank of its group.
    work = 1e-6 * (352 + 152 + 50 + 50)
    passes = 4 * (1e-3 + 1e-2) + 2 * (1e-3 + 1e-2) + 2 * 1e-3
    assert bound.even == pytest.approx((work + passes) / 4, rel=1e-12)
    assert bound.cost >= auto_skip_bound(request, model)
    # The plan: 350 on all 4 ranks; then 150 on ranks 0-1 beside 50 and 50 alone.
    reached = _priced(request, CapacityBound.PER_SAMPLE, [[(4, [0])], [(2, [1]), (1, [2]), (1, [3])]], model)
    assert reached >= bound.cost


def test_a_long_sample_on_a_static_cp_group_bounds_the_step_by_its_own_pass():
    model = _model(seconds_per_token=1e-6, seconds_per_attention_token_pair=1e-9, seconds_per_pass=1e-3, cp_seconds_per_micro_batch=1e-2)
    request = PlanRequest.of((4000,) + (10,) * 7, 2, 4, 1000, scheduler=SchedulerKind.STATIC_PACKING)
    bound = _bound(request, model)
    own = (1e-6 * 4000 + 1e-9 * 4000**2) / 4 + 1e-3 + 3 * 1e-2  # CP4: three ring steps
    assert bound.single == pytest.approx(own, rel=1e-12)
    assert bound.cost == bound.single > bound.even
    reached = _priced(request, CapacityBound.PER_RANK_SUM, [[(4, [0]), (4, list(range(1, 8)))]], model)
    assert reached == pytest.approx(bound.cost, rel=1e-12)
    # A second micro-batch is forced (11,000 tokens, 8,000 a micro-batch): one more pass, on CP4.
    longer = request.replace(sequence_lengths=(4000,) + (1000,) * 7)
    assert _bound(longer, model).single == pytest.approx(own + 1e-3 + 3 * 1e-2, rel=1e-12)


def test_the_bound_prices_a_sample_as_the_cost_model_does():
    """One sample alone on each CP size: the bound's single-sample term is the cheapest of
    cost.step_cost's prices of those one-group plans."""
    rng = random.Random(5)
    for model in MODELS:
        for _ in range(20):
            length = rng.randint(1, 4000)
            request = PlanRequest.of((length,), 1, 4, 1000, scheduler=SchedulerKind.STATIC_PACKING,
                                     tensor_parallel_size=rng.choice((1, 2, 4)), cp_layout=rng.choice(tuple(CpLayout)))
            priced = _priced(request, CapacityBound.PER_RANK_SUM, [[(4, [0])]], model)
            assert _bound(request, model).single == pytest.approx(priced, rel=1e-12)


def test_an_empty_batch_has_a_zero_bound():
    request = PlanRequest.of((), 2, 1, 100, scheduler=SchedulerKind.DYNAMIC_CP)
    assert _bound(request, CostModel()) == LowerBound(0.0, 0.0, 0, 0.0, 0.0)
    assert np.isfinite(_bound(request.replace(sequence_lengths=(5,)), CostModel()).cost)


def test_the_demo_batch_has_most_of_its_gap_to_the_bound_explained():
    """planner-demo's batch (256 long-tail samples on 32 ranks, auto serving dynamic CP): the bound
    counts the passes of its 3 micro-batches and the CP fixed term of its samples over 8K tokens."""
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    require_scheduler(SchedulerKind.STATIC_PACKING)
    lengths = tuple(sample_lengths("long_tail_16k", 256, 0))
    request = PlanRequest.of(lengths, 8, 4, 8192, scheduler=SchedulerKind.AUTO, cp_layout=CpLayout.ZIGZAG, job="demo")
    s = plan_batch(request).statistics
    assert s.balance_efficiency > 0.691
    assert s.lower_bound_cost <= s.predicted_step_cost


def test_the_bounds_shortcuts_are_the_minimum_and_maximum_they_stand_for():
    """lower_bound's two shortcuts, taken where the coefficients and lengths let the seconds only
    grow with the size and the length: each sample's cheapest size is the smallest it fits (when
    each padding multiple divides the next), and the dearest own pass is the longest sample's. Both
    give the bits of the minimum over every size and the maximum over every sample."""
    from batch_planner import lower_bound
    from batch_planner.cost_spec import COEFFICIENT_NAMES

    rng = random.Random(21)
    taken = divisible = 0
    for case in range(300):
        model = CostModel(**{name: rng.choice((0.0, 1e-9, 2.2e-6, 8.7e-11, 1.1e-2, rng.random() * 1e-3)) for name in COEFFICIENT_NAMES})
        kind = rng.choice(CONCRETE)
        dp_cp = rng.choice((2, 8, 12, 20, 24, 64, 256))
        cp = rng.choice([c for c in (1, 2, 4) if dp_cp % c == 0])
        lengths = sample_lengths(rng.choice(("lognormal_32k", "bimodal", "megatron_dcp")), rng.choice((1, 7, 300, 2000)), seed=case)
        options = {"scheduler": kind, "tensor_parallel_size": rng.choice((1, 2, 3)), "cp_layout": rng.choice(tuple(CpLayout))}
        request = PlanRequest.of(lengths, dp_cp // cp, cp, rng.choice((1024, 8192, 40960)), **options)
        samples = lower_bound._sample_sizes(request)
        work = lower_bound._Work(model, samples)
        if not work.monotone:
            continue
        taken += 1
        passes = lower_bound._pass_seconds(model, samples.sizes)
        own = [seconds / size + fixed for seconds, size, fixed in zip(work.columns, samples.sizes, passes)]
        assert lower_bound._longest_samples_own_pass(samples, work, passes) == float(lower_bound._cheapest(own, samples.fits).max())
        multiples = samples.multiples.tolist()
        if all(b % a == 0 for a, b in zip(multiples, multiples[1:])):
            divisible += 1
            everywhere = lower_bound._cheapest(work.columns, samples.fits)
            assert np.array_equal(work.at_smallest_fit().view(np.int64), everywhere.view(np.int64))
    assert taken > 100 and divisible > 50
