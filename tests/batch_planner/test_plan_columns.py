"""The planning core's numpy columns (batch_planner/columns.py) against the arithmetic they stand
for, bit for bit: the groups' tokens, the predicted step cost, the static-CP estimate and its
packing, the CP-size mix, the int64/object choice for huge lengths, the invariant check's
one-pass test against its group-by-group walk, and CpGroups built without their __init__.

The references here are the scalar forms (PlanPadding.padded_tokens, cost.group_work_seconds,
Python sums left to right), so `==`, never approx.
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from batch_planner.cost import group_work_seconds, pack_in_order, static_cp_step_cost, step_cost
from batch_planner.cost_spec import CostModel
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.padding import PlanPadding, padded_sum, padding_multiple
from batch_planner.plan import (
    CpGroup,
    MicroBatch,
    Plan,
    _raise_first_violation,
    check_plan_invariants,
    groups_from_rank_assignment,
    new_cp_group,
)
from batch_planner.planner import plan_batch
from batch_planner.request import CapacityBound, CpLayout, PlanRequest, SchedulerKind
from batch_planner.schedulers import valid_cp_sizes
from tests.support.megatron_builds import require_scheduler

MODELS = (
    CostModel(),
    CostModel(seconds_per_token=1.3e-6, seconds_per_attention_token_pair=3.1e-11, cp_seconds_per_micro_batch=7e-3,
              cp_seconds_per_token=2.5e-7, seconds_per_pass=1.7e-3),
)


def _requests(kind: SchedulerKind, count: int):
    rng = random.Random(f"columns:{kind.value}")
    for seed in range(count):
        dp_cp = rng.choice((8, 16, 32, 64))
        cp = rng.choice((1, 2, 4))
        options: dict = {"scheduler": kind, "tensor_parallel_size": rng.choice((1, 2, 3)), "cp_layout": rng.choice(tuple(CpLayout))}
        if kind is not SchedulerKind.HYBRID_CP and rng.random() < 0.3:
            options["micro_batch_group_size"] = 2
        count = rng.choice((16, 160, 512) if kind is not SchedulerKind.STATIC_PACKING else (160, 512))
        lengths = sample_lengths(rng.choice(tuple(DISTRIBUTIONS)), count, seed=seed)
        budget = rng.choice((8192, 16384, 40960)) if kind is not SchedulerKind.STATIC_PACKING else 40960
        yield PlanRequest.of(lengths, dp_cp // cp, cp, budget, **options)


def _step_cost_by_group(plan: Plan, request: PlanRequest, model: CostModel) -> float:
    packed = plan.capacity_bound is CapacityBound.PER_RANK_SUM
    total = 0.0
    for micro_batch in plan.micro_batches:
        slowest = 0.0
        for g in micro_batch.cp_groups:
            squares = sum(request.sequence_lengths[i] ** 2 for i in g.sample_ids)
            slowest = max(slowest, group_work_seconds(model, g.padded_tokens, squares, g.size, len(g.sample_ids), packed))
        total += slowest
    return total


def _packs_one_by_one(lengths, budget):
    packs, current, tokens = [], [], 0
    for sample_id, length in enumerate(lengths):
        if current and tokens + length > budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(sample_id)
        tokens += length
    return packs + [current] if current else packs


def _static_by_pack(request: PlanRequest, model: CostModel) -> float:
    cp, lengths = request.context_parallel_size, request.sequence_lengths
    multiple = padding_multiple(cp, request.tensor_parallel_size, request.cp_layout)
    replicas = [0.0] * request.data_parallel_size
    for k, pack in enumerate(_packs_one_by_one(lengths, request.max_seqlen_per_dp_cp_rank * cp)):
        padded = padded_sum((lengths[i] for i in pack), multiple)
        replicas[k % len(replicas)] += group_work_seconds(model, padded, sum(lengths[i] ** 2 for i in pack), cp, len(pack), True)
    return max(replicas)


@pytest.mark.parametrize("kind", [SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING])
def test_plans_price_and_pad_as_the_scalar_arithmetic(kind):
    require_scheduler(kind)
    for request in _requests(kind, 12):
        padding = PlanPadding.for_request(request)
        for model in MODELS:
            plan = plan_batch(request, cost_model=model)
            mix: dict[int, list[int]] = {}
            for g in (g for mb in plan.micro_batches for g in mb.cp_groups):
                assert g.real_tokens == sum(request.sequence_lengths[i] for i in g.sample_ids)
                assert g.padded_tokens == padding.padded_tokens(g.sample_ids, g.size)
                entry = mix.setdefault(g.size, [0, 0])
                entry[0] += len(g.sample_ids)
                entry[1] += g.real_tokens
            stats = plan.statistics
            assert stats.cp_size_mix == tuple((size, n, tokens) for size, (n, tokens) in sorted(mix.items()))
            assert stats.predicted_step_cost == _step_cost_by_group(plan, request, model)
            assert stats.static_cp_step_cost == _static_by_pack(request, model)


def test_packing_is_the_one_by_one_rule():
    rng = random.Random(5)
    for _ in range(300):
        lengths = [rng.choice((0, 1, 5, 100, 999, 4096)) for _ in range(rng.randrange(0, 40))]
        budget = rng.choice((-1, 0, 1, 100, 1000, 5000, 10**9))
        assert pack_in_order(lengths, budget) == _packs_one_by_one(lengths, budget)


@pytest.mark.parametrize("longest", [2**20, 2**40, 2**61])
def test_huge_lengths_keep_pythons_ints_and_floats(longest):
    """Lengths whose sums leave int64 or float64's exact integers are computed on Python's ints
    (object columns): the same values, and the same types."""
    rng = random.Random(longest)
    lengths = tuple(rng.randrange(1, longest) for _ in range(30))
    request = PlanRequest.of(lengths, 4, 2, longest, tensor_parallel_size=3)
    padding = PlanPadding.for_request(request)
    ranks = [[0, 1, 2], [0, 1, 2], [3], [4], [5, 6], [5, 6], [7, 8], [9, 10, 11]]
    groups = groups_from_rank_assignment(ranks, padding)
    for g in groups:
        assert type(g.real_tokens) is int and g.real_tokens == sum(lengths[i] for i in g.sample_ids)
        assert type(g.padded_tokens) is int and g.padded_tokens == padding.padded_tokens(g.sample_ids, g.size)
    plan = Plan("x", SchedulerKind.HYBRID_CP, "c", "v", 8, 3, CpLayout.ZIGZAG, CapacityBound.PER_RANK_SUM, (MicroBatch(groups),))
    for model in MODELS:
        cost = step_cost(plan.micro_batches, request, model, True)
        assert type(cost) is float and cost == _step_cost_by_group(plan, request, model)
        static = static_cp_step_cost(request, model)
        assert type(static) is float and static == _static_by_pack(request, model)


def test_ids_outside_the_request_count_for_no_tokens():
    padding = PlanPadding.for_request(PlanRequest.of((10, 20, 30), 2, 1, 100))
    groups = groups_from_rank_assignment([[0, 7], [-1, 2]], padding)
    assert [(g.sample_ids, g.real_tokens) for g in groups] == [((0, 7), 10), ((-1, 2), 30)]


def _mutations(plan: Plan, rng: random.Random):
    """Plans that break one invariant or more, or none."""
    for _ in range(20):
        micro_batches = [list(mb.cp_groups) for mb in plan.micro_batches]
        groups = micro_batches[rng.randrange(len(micro_batches))]
        j = rng.randrange(len(groups))
        g = groups[j]
        change = rng.randrange(8)
        if change == 0:
            groups[j] = dataclasses.replace(g, sample_ids=g.sample_ids + g.sample_ids[:1])
        elif change == 1:
            groups[j] = dataclasses.replace(g, sample_ids=())
        elif change == 2:
            groups[j] = dataclasses.replace(g, size=g.size * 3)
        elif change == 3:
            groups[j] = dataclasses.replace(g, first_rank=g.first_rank + 1)
        elif change == 4:
            groups[j] = dataclasses.replace(g, sample_ids=(plan.dp_cp_size * 1000,) + g.sample_ids)
        elif change == 5:
            del groups[j]
        elif change == 6:
            micro_batches.append([])
        yield dataclasses.replace(plan, micro_batches=tuple(MicroBatch(tuple(m)) for m in micro_batches),
                                  capacity_bound=rng.choice(tuple(CapacityBound)))


def _raised(check, *args) -> tuple[str, str] | None:
    try:
        check(*args)
    except Exception as exc:  # noqa: BLE001 - comparing whatever each side raises
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("kind", [SchedulerKind.HYBRID_CP, SchedulerKind.DYNAMIC_CP])
def test_invariant_check_reports_what_the_walk_reports(kind):
    """The one-pass check lets through only plans the group-by-group walk lets through, and on any
    other plan raises what the walk raises: the first invariant broken, with its message."""
    require_scheduler(kind)
    rng = random.Random(9)
    for request in _requests(kind, 6):
        plan = plan_batch(request)
        for sizes in (valid_cp_sizes(kind, request.dp_cp_size, request.context_parallel_size, None), frozenset({1, 2})):
            for bad in _mutations(plan, rng):
                walked = _raised(_raise_first_violation, bad, request, sizes)
                assert _raised(check_plan_invariants, bad, request, sizes) == walked


def test_new_cp_group_is_a_cp_group():
    """new_cp_group skips CpGroup's __init__: it must make the same object, which holds while
    CpGroup keeps exactly these fields, no defaults and no __post_init__."""
    assert [(f.name, f.default, f.default_factory) for f in dataclasses.fields(CpGroup)] == [
        (name, dataclasses.MISSING, dataclasses.MISSING) for name in ("first_rank", "size", "sample_ids", "real_tokens", "padded_tokens")
    ]
    assert not hasattr(CpGroup, "__post_init__")
    made, built = CpGroup(4, 2, (3, 1), 100, 104), new_cp_group(4, 2, (3, 1), 100, 104)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert list(vars(made).items()) == list(vars(built).items())
    assert pickle.dumps(made) == pickle.dumps(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.size = 8  # type: ignore[misc]
