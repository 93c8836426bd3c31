"""The planning core against the real Megatron-Core, in-process (no gRPC)."""

from __future__ import annotations

import pytest
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

from batch_planner.cost import static_cp_step_cost
from tests.support.cost_support import group_seconds
from batch_planner.cost_spec import CostModel
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.errors import InvariantViolationError
from batch_planner.padding import group_padded_lengths, padded_length
from batch_planner.plan import CpGroup, MicroBatch, Plan, check_plan_invariants
from batch_planner.planner import plan_batch
from batch_planner.request import CapacityBound, CpLayout, PaddingRule, PlanRequest, SchedulerKind
from batch_planner.schedulers import _DpCpGroupSize, valid_cp_sizes
from tests.support.megatron_builds import require_scheduler


def megatron_hybrid_cp(lengths, dp_cp, max_per_rank):
    """Megatron-Core's own answer, called directly: [micro_batch][rank] -> sample ids."""
    scheduler = BalancedCPScheduler(max_per_rank, _DpCpGroupSize(dp_cp))
    _, groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return groups


def megatron_dynamic_cp(lengths, request: PlanRequest):
    """Megatron-Core's DefaultDynamicCPScheduler, called directly: [micro_batch][rank] -> sample ids."""
    from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler

    scheduler = DefaultDynamicCPScheduler(
        request.max_seqlen_per_dp_cp_rank, request.context_parallel_size, request.data_parallel_size,
        request.micro_batch_group_size, min_cp_size=request.min_cp_size or 1,
    )
    return scheduler.get_groups_and_subsamples(list(enumerate(lengths)))


def rank_view(plan: Plan) -> list[list[list[int]]]:
    return [
        [list(mb.group_of_rank(rank).sample_ids) for rank in range(plan.dp_cp_size)]
        for mb in plan.micro_batches
    ]


@pytest.mark.parametrize("dp,cp,samples", [(4, 2, 64), (16, 4, 1024)])
def test_plan_is_megatron_cores_schedule(dp, cp, samples):
    lengths = sample_lengths("long_tail_16k", samples, seed=3)
    request = PlanRequest.of(tuple(lengths), dp, cp, max_seqlen_per_dp_cp_rank=4096)
    plan = plan_batch(request)
    assert rank_view(plan) == megatron_hybrid_cp(lengths, dp * cp, 4096)
    assert plan.scheduler_class == "BalancedCPScheduler"
    assert plan.capacity_bound is CapacityBound.PER_SAMPLE
    # Long samples got CP > 1, short ones CP1: the point of dynamic CP.
    sizes = plan.sample_cp_sizes()
    assert sorted(sizes) == list(range(samples))
    assert max(sizes.values()) >= 2 and min(sizes.values()) == 1


def test_same_request_same_plan_and_id():
    lengths = tuple(sample_lengths("lognormal_32k", 256, seed=1))
    first = plan_batch(PlanRequest.of(lengths, 16, 2, 16384))
    again = plan_batch(PlanRequest.of(lengths, 16, 2, 16384, job="another-job"))
    assert first == again and first.plan_id == again.plan_id
    other = plan_batch(PlanRequest.of(lengths, 16, 2, 16384, cp_layout=CpLayout.CONTIGUOUS))
    assert other.plan_id != first.plan_id


def test_statistics_add_up():
    lengths = tuple(sample_lengths("long_tail_16k", 256, seed=2))
    request = PlanRequest.of(lengths, 8, 4, 8192, tensor_parallel_size=2)
    plan = plan_batch(request)
    s = plan.statistics
    assert s.real_tokens == sum(lengths)
    sizes = plan.sample_cp_sizes()
    expected_padded = sum(padded_length(lengths[i], sizes[i], 2, CpLayout.ZIGZAG) for i in range(len(lengths)))
    assert s.padded_tokens == expected_padded > s.real_tokens
    assert s.padding_ratio == pytest.approx((expected_padded - s.real_tokens) / expected_padded)
    assert sum(n for _, n, _ in s.cp_size_mix) == len(lengths)
    assert sum(t for _, _, t in s.cp_size_mix) == sum(lengths)
    assert s.micro_batch_count == len(plan.micro_batches)
    assert 0 < s.lower_bound_cost <= s.predicted_step_cost
    assert s.balance_efficiency == pytest.approx(s.lower_bound_cost / s.predicted_step_cost)
    assert s.static_cp_step_cost == pytest.approx(static_cp_step_cost(request, CostModel()))
    assert s.predicted_speedup_over_static_cp == pytest.approx(s.static_cp_step_cost / s.predicted_step_cost)


def test_padding_rules():
    # Megatron-Core's: a multiple of 2c * tp on a CP group, in either layout (it converts contiguous
    # input to zigzag, which needs 2c); CP1 to tp. verl's: contiguous to c * tp only.
    assert padded_length(1001, 1, 1, CpLayout.ZIGZAG) == 1001
    assert padded_length(1001, 2, 1, CpLayout.ZIGZAG) == 1004
    assert padded_length(1001, 2, 1, CpLayout.CONTIGUOUS) == 1004
    assert padded_length(1001, 4, 2, CpLayout.ZIGZAG) == 1008
    assert padded_length(1001, 4, 2, CpLayout.CONTIGUOUS) == 1008
    assert padded_length(1001, 1, 2, CpLayout.ZIGZAG) == 1002
    assert padded_length(1001, 2, 1, CpLayout.CONTIGUOUS, PaddingRule.VERL) == 1002
    assert padded_length(1001, 2, 1, CpLayout.ZIGZAG, PaddingRule.VERL) == 1004
    assert padded_length(1001, 1, 2, CpLayout.CONTIGUOUS, PaddingRule.VERL) == 1002
    # verl's min_local_rows tops the group's buffer up through its last sequence.
    assert group_padded_lengths([3, 5], 2, 1, CpLayout.CONTIGUOUS, PaddingRule.VERL, min_local_rows=8) == [4, 12]
    assert group_padded_lengths([30, 5], 2, 1, CpLayout.CONTIGUOUS, PaddingRule.VERL, min_local_rows=8) == [30, 6]


def test_cost_model_rejects_bad_coefficients():
    with pytest.raises(ValueError, match="seconds_per_token"):
        CostModel(seconds_per_token=-1.0)
    with pytest.raises(ValueError, match="cp_seconds_per_micro_batch"):
        CostModel(cp_seconds_per_micro_batch=float("nan"))


def test_static_cp_estimate_counts_cp_overhead():
    # One 32K sample + eight 4K samples on 2 ranks: static CP2 pays the CP fixed cost; CP1 does not.
    lengths = (32768,) + (4096,) * 8
    model = CostModel()
    cp2 = static_cp_step_cost(PlanRequest.of(lengths, 1, 2, 65536), model)
    cp1 = static_cp_step_cost(PlanRequest.of(lengths, 2, 1, 65536), model)
    assert cp2 > 0 and cp1 > 0 and cp2 != cp1


def test_pass_term_is_paid_per_sample_unpacked_and_once_per_pack():
    # CP1 included: many short passes cost more than the same tokens in one packed pass.
    lengths = [1024, 2048, 4096]
    base = CostModel(seconds_per_pass=0.0)
    with_pass = CostModel(seconds_per_pass=0.002)
    for cp in (1, 2):
        unpacked = group_seconds(with_pass, lengths, cp, 1, CpLayout.ZIGZAG, packed=False)
        packed = group_seconds(with_pass, lengths, cp, 1, CpLayout.ZIGZAG, packed=True)
        assert unpacked - group_seconds(base, lengths, cp, 1, CpLayout.ZIGZAG, packed=False) == pytest.approx(0.006)
        assert packed - group_seconds(base, lengths, cp, 1, CpLayout.ZIGZAG, packed=True) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="seconds_per_pass"):
        CostModel(seconds_per_pass=-1e-3)


def test_static_cp_estimate_is_the_slowest_replicas_sum():
    # DP=2, CP1, budget 4096 per replica: packs [4096], [1024], [4096], [1024] go to replicas
    # 0, 1, 0, 1; no barrier between micro-batches, so replica 0's two packs set the step.
    model = CostModel(seconds_per_token=1e-6, seconds_per_attention_token_pair=0.0, seconds_per_pass=1e-3)
    step = static_cp_step_cost(PlanRequest.of((4096, 1024, 4096, 1024), 2, 1, 4096), model)
    assert step == pytest.approx(2 * (4096e-6 + 1e-3))


def _plan(groups_per_mb, dp_cp, bound=CapacityBound.PER_SAMPLE):
    return Plan("x", SchedulerKind.HYBRID_CP, "BalancedCPScheduler", "t", dp_cp, 1, CpLayout.ZIGZAG, bound,
                tuple(MicroBatch(tuple(g)) for g in groups_per_mb))


@pytest.mark.parametrize(
    "groups,invariant",
    [
        ([[CpGroup(0, 2, (0,), 10, 10), CpGroup(2, 2, (0,), 10, 10)]], "1"),  # sample twice
        ([[CpGroup(0, 2, (0,), 10, 10), CpGroup(2, 2, (), 0, 0)]], "2"),  # idle ranks
        ([[CpGroup(0, 2, (0,), 10, 10)]], "2"),  # ranks 2-3 in no group
        ([[CpGroup(0, 1, (0,), 10, 10), CpGroup(1, 2, (1,), 10, 10), CpGroup(3, 1, (2,), 10, 10)]], "3"),
        ([[CpGroup(0, 4, (0, 1, 2), 30, 30)]], "1"),  # sample 3 missing
    ],
)
def test_invariant_violations_are_named(groups, invariant):
    request = PlanRequest.of((10, 10, 10, 10), 2, 2, 100)
    with pytest.raises(InvariantViolationError) as err:
        check_plan_invariants(_plan(groups, 4), request, valid_cp_sizes(SchedulerKind.HYBRID_CP, 4, 2, None))
    assert err.value.invariant == invariant


def test_capacity_invariant_matches_execution():
    request = PlanRequest.of((100, 100), 1, 2, 80)
    groups = [[CpGroup(0, 2, (0, 1), 200, 200)]]
    sizes = valid_cp_sizes(SchedulerKind.HYBRID_CP, 2, 2, None)
    check_plan_invariants(_plan(groups, 2, CapacityBound.PER_SAMPLE), request, sizes)  # 50 per sample
    with pytest.raises(InvariantViolationError, match="invariant 4"):
        check_plan_invariants(_plan(groups, 2, CapacityBound.PER_RANK_SUM), request, sizes)  # 100 packed


def test_capacity_invariant_is_the_contracts_budget_in_real_tokens():
    """max_seqlen_per_dp_cp_rank bounds real tokens (the proto's contract); padding of
    less than a unit on top is fine, one real token past the budget is not."""
    sizes = valid_cp_sizes(SchedulerKind.HYBRID_CP, 2, 2, None)
    # CP2 zigzag pads to multiples of 4: 101 -> 104, 52 per rank, over a budget of 51 by padding only.
    within = PlanRequest.of((101,), 1, 2, 51)
    check_plan_invariants(_plan([[CpGroup(0, 2, (0,), 101, 104)]], 2), within, sizes)
    over = PlanRequest.of((103,), 1, 2, 51)  # 51.5 real tokens per rank
    with pytest.raises(InvariantViolationError, match="invariant 4"):
        check_plan_invariants(_plan([[CpGroup(0, 2, (0,), 103, 104)]], 2), over, sizes)


@pytest.mark.parametrize("kind", [SchedulerKind.DYNAMIC_CP, SchedulerKind.STATIC_PACKING])
def test_dev_branch_schedulers(kind):
    require_scheduler(kind)
    lengths = tuple(sample_lengths("long_tail_16k", 256, seed=4))
    plan = plan_batch(PlanRequest.of(lengths, 8, 4, 16384, scheduler=kind))
    assert plan.capacity_bound is CapacityBound.PER_RANK_SUM
    assert sorted(plan.sample_cp_sizes()) == list(range(256))


def test_distributions_are_seeded_and_in_range():
    for name in DISTRIBUTIONS:
        a, b = sample_lengths(name, 500, seed=7), sample_lengths(name, 500, seed=7)
        assert a == b and all(x >= 1 for x in a)
    assert max(sample_lengths("megatron_dcp", 2000)) <= 8192
    assert min(sample_lengths("lognormal_32k", 2000)) >= 256
    with pytest.raises(ValueError, match="unknown distribution"):
        sample_lengths("nope", 1)
