"""auto skips a candidate only where its lower bound proves it cannot win, and then serves exactly
the plan that planning every candidate would serve (batch_planner/auto.py, docs/design.md)."""

from __future__ import annotations

import random
from functools import partial

from batch_planner.auto import candidates, lower_bound, plan_candidate, serve
from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.cost_spec import CostModel, preset_names
from batch_planner.distributions import DISTRIBUTIONS, sample_lengths
from batch_planner.planner import plan_batch, plan_one_scheduler
from batch_planner.request import PlanRequest, SchedulerKind
from batch_planner.schedulers import megatron_core_version
from batch_planner.validation import RequestLimits

LIMITS = RequestLimits()


def _every_candidate_planned(request: PlanRequest, model: CostModel):
    plan_one = partial(plan_one_scheduler, limits=LIMITS, cost_model=model)
    outcomes = [plan_candidate(c, plan_one) for c in candidates(request)]
    return serve(request, outcomes, model, megatron_core_version()), outcomes


def _requests(count: int, seed: int):
    rng = random.Random(seed)
    models = [CostModel()] + [cost_model_for_preset(name) for name in preset_names()]
    for _ in range(count):
        dp_cp = rng.choice((2, 4, 8, 16, 32, 64))
        cp = rng.choice([c for c in (1, 2, 4, 8) if dp_cp % c == 0])
        samples = rng.choice((8, 32, 64, 128, 256))
        budget = rng.choice((2048, 4096, 8192))
        lengths = sample_lengths(rng.choice(list(DISTRIBUTIONS)), samples, rng.randrange(1 << 30))
        lengths = [min(length, budget * dp_cp) for length in lengths]
        yield PlanRequest.of(lengths, dp_cp // cp, cp, budget, scheduler=SchedulerKind.AUTO), rng.choice(models)


def test_skipping_serves_the_plan_that_planning_every_candidate_serves(capsys):
    compared = skipped = bounds_checked = 0
    for request, model in _requests(160, seed=7):
        served = plan_batch(request, cost_model=model)
        full, outcomes = _every_candidate_planned(request, model)
        assert served.plan_id == full.plan_id
        assert served.micro_batches == full.micro_batches
        assert served.statistics == full.statistics
        for listed, every in zip(served.candidates, full.candidates, strict=True):
            if listed.skipped_lower_bound is None:
                assert listed == every
                continue
            skipped += 1
            # The bound held: the candidate, planned, costs at least that, more than the winner.
            assert every.predicted_step_cost is not None
            assert every.predicted_step_cost >= listed.skipped_lower_bound * (1 - 1e-12)
            assert every.predicted_step_cost > full.statistics.predicted_step_cost
        # The bound holds on every hybrid plan, skipped or not: the proof, checked.
        for outcome in outcomes:
            bound = lower_bound(outcome.candidate.request, model)
            if bound is not None and outcome.cost is not None:
                assert outcome.cost >= bound * (1 - 1e-12), outcome.candidate.name
                bounds_checked += 1
        compared += 1
    with capsys.disabled():
        print(f"\nauto with skipping vs every candidate planned: {compared} requests, {skipped} candidates skipped, "
              f"{bounds_checked} hybrid plans at or above their bound; the same plan served every time")
    assert skipped > 20 and bounds_checked > 100
