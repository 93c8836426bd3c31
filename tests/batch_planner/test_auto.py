"""The auto policy against the real Megatron-Core: it never serves a plan predicted dearer than the
job's own static CP, is deterministic, lists every candidate (and why one has no plan), follows the
cost model it is given, and refuses clearly when no candidate can plan. Through a real server:
tests/planner_server/test_auto_served.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_planner.auto import candidates
from batch_planner.cost_spec import CostModel, CostModelSpec
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.errors import InvalidRequestError
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest, SchedulerKind
from tests.support.megatron_builds import require_scheduler

AUTO = SchedulerKind.AUTO
PROFILE = settings(derandomize=True, database=None, deadline=None, max_examples=40,
                   suppress_health_check=[HealthCheck.too_slow])


def auto_request(distribution="lognormal_32k", samples=64, dp=4, cp=2, limit=8192, seed=0, **options) -> PlanRequest:
    return PlanRequest.of(tuple(sample_lengths(distribution, samples, seed)), dp, cp, limit, scheduler=AUTO, **options)


def served(plan):
    (winner,) = [c for c in plan.candidates if c.served]
    return winner


@PROFILE
@given(
    distribution=st.sampled_from(sorted(DISTRIBUTIONS)),
    samples=st.integers(8, 96),
    layout=st.sampled_from([(4, 1), (2, 2), (4, 2), (2, 4), (8, 2), (3, 2), (6, 2)]),
    limit=st.sampled_from([4096, 8192, 16384]),
    seed=st.integers(0, 10_000),
    per_token=st.sampled_from([1.0, 20.0]),  # today's calibration, and a 20x heavier model
)
def test_auto_never_predicts_worse_than_the_jobs_static_cp_and_is_deterministic(distribution, samples, layout, limit, seed, per_token):
    require_scheduler(SchedulerKind.STATIC_PACKING)
    dp, cp = layout
    base = CostModel()
    model = CostModel(seconds_per_token=base.seconds_per_token * per_token,
                      seconds_per_attention_token_pair=base.seconds_per_attention_token_pair * per_token)
    request = auto_request(distribution, samples, dp, cp, limit, seed, cost_model=CostModelSpec(coefficients=model))
    try:
        plan = plan_batch(request)
    except InvalidRequestError as refused:  # no candidate holds the batch: said, with every reason
        assert "static_cp" in str(refused) and "dynamic_cp" in str(refused)
        return
    again = plan_batch(request)
    assert again == plan and again.plan_id == plan.plan_id and again.candidates == plan.candidates
    job_static = plan.candidates[0]
    assert job_static.name == f"static_cp{cp}"
    if job_static.predicted_step_cost is not None:
        assert plan.statistics.predicted_step_cost <= job_static.predicted_step_cost
        assert plan.statistics.predicted_speedup_over_static_cp >= 1.0
    planned = [c.predicted_step_cost for c in plan.candidates if c.predicted_step_cost is not None]
    assert plan.statistics.predicted_step_cost == min(planned) == served(plan).predicted_step_cost
    assert plan.scheduler is served(plan).scheduler and plan.scheduler is not AUTO


def test_candidates_are_the_documented_ones_in_order():
    names = [c.name for c in candidates(auto_request(dp=4, cp=2, limit=8192))]
    assert names == [
        "static_cp2",
        "dynamic_cp max_seqlen=8192", "dynamic_cp max_seqlen=8192 min_cp=2",
        "dynamic_cp max_seqlen=6144", "dynamic_cp max_seqlen=6144 min_cp=2",
        "dynamic_cp max_seqlen=4096", "dynamic_cp max_seqlen=4096 min_cp=2",
        "hybrid_cp max_seqlen=8192", "hybrid_cp max_seqlen=6144", "hybrid_cp max_seqlen=4096",
        "static_cp1", "static_cp4", "static_cp8",
    ]
    restricted = auto_request(auto_schedulers=(SchedulerKind.DYNAMIC_CP,))
    assert {c.request.scheduler for c in candidates(restricted)} == {SchedulerKind.DYNAMIC_CP}


def test_a_candidate_that_cannot_plan_is_listed_with_its_reason_and_never_served():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    plan = plan_batch(auto_request(samples=96, dp=12, cp=2))  # 24 ranks: 0.19's hybrid CP cannot plan it
    hybrid = [c for c in plan.candidates if c.scheduler is SchedulerKind.HYBRID_CP]
    assert hybrid and all(c.predicted_step_cost is None and "power of two" in c.not_planned_reason for c in hybrid)
    assert not any(c.served for c in hybrid)
    assert served(plan).predicted_step_cost is not None


def test_the_cost_model_decides_the_winner():
    require_scheduler(SchedulerKind.DYNAMIC_CP)
    request = auto_request("long_tail_16k", 128, dp=4, cp=2, limit=8192)
    # On the toy engine's coefficients (a 4-layer stack: per-token work small beside a CP cost of 5 s).
    from dataclasses import replace

    from batch_planner.cost_spec import TOY_ENGINE_COEFFICIENTS

    cheap_cp = replace(TOY_ENGINE_COEFFICIENTS, cp_seconds_per_micro_batch=0.0, seconds_per_pass=0.0)
    dear_cp = replace(TOY_ENGINE_COEFFICIENTS, cp_seconds_per_micro_batch=5.0, cp_seconds_per_token=1e-3)
    cheap, dear = (plan_batch(request.replace(cost_model=CostModelSpec(coefficients=m))) for m in (cheap_cp, dear_cp))
    assert served(cheap).name != served(dear).name
    # Dear CP: as few samples on CP > 1 as the budget allows (those longer than 8,192 tokens).
    on_cp = {name: sum(size > 1 for size in p.sample_cp_sizes().values()) for name, p in (("cheap", cheap), ("dear", dear))}
    assert on_cp["dear"] == sum(n > 8192 for n in request.sequence_lengths) < on_cp["cheap"], on_cp
    assert plan_batch(request.replace(cost_model=CostModelSpec(preset="llama3-70b-h200"))).statistics.predicted_step_cost > (
        plan_batch(request).statistics.predicted_step_cost
    )


def test_no_candidate_left_is_a_clear_error():
    request = PlanRequest.of((100_000,), 2, 1, 1024, scheduler=AUTO)  # more than 2 ranks x 1,024 hold
    with pytest.raises(InvalidRequestError) as refused:
        plan_batch(request)
    assert refused.value.field == "scheduler"
    assert "auto found no candidate" in str(refused.value) and "static_cp1:" in str(refused.value)
