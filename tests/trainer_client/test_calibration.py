"""The calibration's parts on one process: unit features are the planner's own arithmetic, the
robust fit recovers known coefficients (noise, outliers, zeros, bounds), bad measurements are
dropped and counted, a failed fit keeps the previous model, and the fitted model reaches the
requests only from a step no rank has prefetched."""

from __future__ import annotations

import logging
import math
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from scipy.optimize import nnls

from batch_planner.cost import unit_features
from tests.support.cost_support import group_seconds
from batch_planner.cost_spec import COEFFICIENT_BOUNDS, COEFFICIENT_NAMES, CostModel, CostModelSpec
from batch_planner.planner import plan_batch
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind
from trainer_client.plans.apply import micro_batches_for_rank
from trainer_client.plans.batch import unbind_batch
from batch_planner.cost_fit import fit_cost_model, price_vector
from trainer_client.service.calibration import Calibrator, features_of
from trainer_client.service.metrics import TrainerMetrics

HIDDEN = CostModel(
    seconds_per_token=2e-6, seconds_per_attention_token_pair=1e-9, cp_seconds_per_micro_batch=3e-3,
    cp_seconds_per_token=1e-6, seconds_per_pass=1e-3,
)


def _unit(lengths, cp, micro_batch_index=0, padded=None):
    padded = padded or [-(-n // (2 * cp)) * 2 * cp if cp > 1 else n for n in lengths]
    cu = [0]
    for p in padded:
        cu.append(cu[-1] + p)
    return SimpleNamespace(sequence_lengths=tuple(lengths), cu_seqlens_padded=cu, local_cp_size=cp,
                           micro_batch_index=micro_batch_index, token_fields={})


def _synthetic(n, model=HIDDEN, noise=0.03, seed=0, cp_sizes=(1, 2, 4)):
    rng = random.Random(seed)
    rows, seconds = [], []
    for _ in range(n):
        cp = rng.choice(cp_sizes)
        lengths = [rng.randint(64, 4000) for _ in range(rng.choice((1, 1, 2, 3)))]
        features = features_of(_unit(lengths, cp))
        rows.append(features)
        seconds.append(price_vector(model, features) * math.exp(rng.gauss(0.0, noise)))
    return np.array(rows), np.array(seconds)


def _within(fitted: CostModel, hidden: CostModel, tolerance: float) -> dict[str, float]:
    errors = {n: abs(getattr(fitted, n) / getattr(hidden, n) - 1) for n in COEFFICIENT_NAMES if getattr(hidden, n)}
    assert all(e <= tolerance for e in errors.values()), errors
    return errors


def test_planner_and_calibration_share_the_unit_features():
    """What the planner predicts for a plan is what the trainer's timed units' features price to."""
    model = HIDDEN
    for lengths, cp, packed in (([1000, 37], 1, True), ([5000, 77, 3], 4, False), ([2048], 2, True)):
        for layout in CpLayout:
            direct = group_seconds(model, lengths, cp, 1, layout, packed)
            from batch_planner.padding import padded_length

            padded = sum(padded_length(n, cp, 1, layout) for n in lengths)
            passes = 1 if packed else len(lengths)
            assert price_vector(model, tuple(unit_features(padded, sum(n * n for n in lengths), cp, passes).values())) == pytest.approx(direct, rel=1e-12)
    assert tuple(unit_features(1, 1, 1, 1)) == COEFFICIENT_NAMES == tuple(CostModel.__dataclass_fields__)
    import torch
    from tensordict import TensorDict

    lengths = (3000, 1500, 1800, 700, 500, 301, 900, 97, 1000, 64, 333, 1)
    batch = unbind_batch(TensorDict({"input_ids": torch.nested.nested_tensor(
        [torch.arange(n) for n in lengths], layout=torch.jagged)}, batch_size=[len(lengths)]))
    for scheduler in (SchedulerKind.HYBRID_CP, SchedulerKind.STATIC_PACKING, SchedulerKind.AUTO):
        cp = 2 if scheduler is SchedulerKind.STATIC_PACKING else 1
        request = PlanRequest.of(lengths, 4 // cp, cp, 4096 if cp == 2 else 1024,
                                 scheduler=scheduler, cost_model=CostModelSpec(coefficients=model))
        plan = plan_batch(request)
        per_mb: dict[int, float] = {}
        for rank in range(4):
            mine: dict[int, float] = {}
            for unit in micro_batches_for_rank(plan, batch, rank):
                mine[unit.micro_batch_index] = mine.get(unit.micro_batch_index, 0.0) + price_vector(model, features_of(unit))
            for index, seconds in mine.items():
                per_mb[index] = max(per_mb.get(index, 0.0), seconds)
        assert sum(per_mb.values()) == pytest.approx(plan.statistics.predicted_step_cost, rel=1e-9), scheduler


def test_fit_recovers_known_coefficients_from_noisy_units():
    x, y = _synthetic(300, noise=0.03)
    fit = fit_cost_model(x, y, CostModel(), min_observations=24)
    assert fit.result == "updated" and set(fit.fitted_terms) == set(COEFFICIENT_NAMES)
    _within(fit.model, HIDDEN, 0.05)
    assert fit.relative_error_scale == pytest.approx(0.03, rel=0.3)


def test_fit_ignores_stalled_units():
    x, y = _synthetic(300, noise=0.02, seed=1)
    stalled = np.random.default_rng(0).choice(len(y), 24, replace=False)
    y[stalled] *= 6.0  # 8% of the units stalled (a GC pause, a straggler)
    least_squares = fit_cost_model(x, y, CostModel(), 24, max_iterations=60)
    assert least_squares.result == "updated"
    _within(least_squares.model, HIDDEN, 0.05)


def test_fit_is_non_negative_and_a_zero_term_stays_near_zero():
    hidden = CostModel(seconds_per_token=2e-6, seconds_per_attention_token_pair=1e-9, cp_seconds_per_micro_batch=2e-3,
                       cp_seconds_per_token=0.0, seconds_per_pass=1e-3)
    x, y = _synthetic(300, model=hidden, noise=0.05, seed=2)
    fit = fit_cost_model(x, y, CostModel(), 24)
    assert fit.result == "updated"
    assert all(getattr(fit.model, n) >= 0 for n in COEFFICIENT_NAMES)
    assert fit.model.cp_seconds_per_token < 0.05 * hidden.seconds_per_token
    _within(fit.model, hidden, 0.1)


def test_nnls_matches_the_constrained_optimum():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(40, 4))
    b = a @ np.array([1.0, -2.0, 0.5, 0.0]) + rng.normal(scale=0.01, size=40)
    x, ok = nnls(a, b)
    assert ok and (x >= 0).all() and x[1] == 0.0
    free = np.linalg.lstsq(a[:, [0, 2, 3]], b, rcond=None)[0]
    # KKT: the unconstrained fit of the other columns, and a negative gradient where x is 0.
    assert np.allclose(np.delete(x, 1)[np.delete(x, 1) > 0], free[free > 0], atol=1e-6) or (x >= 0).all()
    assert (a.T @ (b - a @ x))[x == 0].max() <= 1e-8


def test_terms_the_units_do_not_exercise_keep_the_prior():
    prior = CostModel()
    x, y = _synthetic(120, noise=0.02, cp_sizes=(1,))
    fit = fit_cost_model(x, y, prior, 24)
    assert fit.result == "updated"
    assert fit.model.cp_seconds_per_micro_batch == prior.cp_seconds_per_micro_batch
    assert fit.model.cp_seconds_per_token == prior.cp_seconds_per_token
    assert "cp_seconds_per_micro_batch" not in fit.fitted_terms
    assert fit.model.seconds_per_token == pytest.approx(HIDDEN.seconds_per_token, rel=0.05)


def test_too_few_distinct_units_out_of_bounds_and_no_convergence_fit_nothing():
    x, y = _synthetic(10)
    assert fit_cost_model(x, y, CostModel(), 24).result == "insufficient_data"
    same = np.repeat(x[:1], 50, axis=0)
    assert fit_cost_model(same, np.full(50, y[0]), CostModel(), 24).result == "insufficient_data"
    huge = CostModel(seconds_per_token=COEFFICIENT_BOUNDS["seconds_per_token"] * 10, seconds_per_attention_token_pair=1e-9,
                     cp_seconds_per_micro_batch=1e-3, cp_seconds_per_token=0.0, seconds_per_pass=1e-3)
    x2, y2 = _synthetic(100, model=huge, noise=0.01)
    out = fit_cost_model(x2, y2, CostModel(), 24)
    assert out.result == "out_of_bounds" and out.model is None and "seconds_per_token" in out.reason
    x3, y3 = _synthetic(200, noise=0.2, seed=4)
    assert fit_cost_model(x3, y3, CostModel(), 24, max_iterations=2).result == "not_converged"


def _calibrator(**kw):
    from batch_planner.request import PlanningOptions

    metrics = TrainerMetrics(CollectorRegistry(), job="t")
    defaults = dict(window_steps=20, min_observations=24, update_interval_steps=2, metrics=metrics)
    defaults.update(kw)
    return Calibrator(PlanningOptions(max_seqlen_per_dp_cp_rank=4096, scheduler=SchedulerKind.AUTO), **defaults), metrics


def _run_steps(calibrator, steps, first=0, model=HIDDEN, corrupt=None):
    rng = random.Random(first)
    reports = []
    for step in range(first, first + steps):
        calibrator.begin_step(step)
        for index in range(12):
            unit = _unit([rng.randint(64, 4000)], rng.choice((1, 2, 4)), index)
            seconds = price_vector(model, features_of(unit)) * math.exp(rng.gauss(0, 0.02))
            calibrator.record(unit, corrupt(step, index, seconds) if corrupt else seconds)
        reports.append(calibrator.end_step())
    return reports


def _sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, {"training_job": "t", **labels}) or 0.0


def test_bad_measurements_are_dropped_counted_and_never_fitted():
    def corrupt(step, index, seconds):
        return {0: float("nan"), 1: 0.0, 2: -1e-3, 3: float("inf")}.get(index, seconds)

    calibrator, metrics = _calibrator()
    reports = _run_steps(calibrator, 6, corrupt=corrupt)
    calibrator.begin_step(6)  # a step with no unit timed
    calibrator.end_step()
    calibrator.begin_step(7)
    report = calibrator.end_step()
    assert report.dropped == {"empty_step": 2}
    assert _sample(metrics, "batch_planner_client_calibration_dropped_total", reason="not_finite") == 12
    assert _sample(metrics, "batch_planner_client_calibration_dropped_total", reason="non_positive_time") == 12
    assert _sample(metrics, "batch_planner_client_calibration_dropped_total", reason="empty_step") == 2
    assert all(math.isfinite(s) and s > 0 for step in calibrator.window for _, _, s in step)
    assert sum(len(step) for step in calibrator.window) == 6 * 8
    assert any(r.fit.result == "updated" for r in reports if r)
    _within(calibrator.model, HIDDEN, 0.1)
    # A rank that reports nothing in a step others timed: counted, its step's time not reported.
    dropped: dict[str, int] = {}
    unit = (0, features_of(_unit([100], 1)), 1e-3)
    kept = calibrator._clean([[unit], [], [unit]], dropped)
    assert dropped == {"rank_reported_nothing": 1} and kept == [[unit], [], [unit]]
    assert calibrator._clean([[], []], dropped) is None and dropped["empty_step"] == 1
    no_work = (0, features_of(_unit([], 1)), 1e-3)
    calibrator._clean([[no_work]], dropped)
    assert dropped["no_work"] == 1


def test_timed_units_on_the_host_clock_are_kept_under_their_step_with_their_features():
    calibrator, _ = _calibrator()
    with pytest.raises(RuntimeError, match="no step is planned yet"):
        calibrator.timed(_unit([100], 1))
    calibrator.begin_step(3)
    units = [_unit([300, 200], 2, micro_batch_index=0), _unit([900], 1, micro_batch_index=1)]
    for unit in units:  # tokens on the CPU and CUDA never initialised: the monotonic clock
        with calibrator.timed(unit):
            time.sleep(0.002)
    ((first, second),) = calibrator.timer.collect([3])
    assert (first[0], first[1]) == (0, features_of(units[0])) and (second[0], second[1]) == (1, features_of(units[1]))
    assert first[2] >= 0.002 and second[2] >= 0.002  # at least the body's time: the clock spans it
    assert calibrator.timer.collect([3]) == [[]]  # collected once


def test_preset_until_enough_units_then_the_fit_from_a_step_not_prefetched(caplog):
    calibrator, metrics = _calibrator(min_observations=30, update_interval_steps=1)
    reports = _run_steps(calibrator, 2)  # 24 distinct units: not yet
    assert [r.fit.result for r in reports] == ["insufficient_data", "insufficient_data"]
    assert calibrator.options_for(5).cost_model is None and calibrator.model == CostModel()
    with caplog.at_level(logging.INFO, logger="trainer_client.service.calibration"):
        (report,) = _run_steps(calibrator, 1, first=2)
    assert report.fit.result == "updated" and report.effective_step == 4  # step 3 may be prefetched
    assert calibrator.options_for(3).cost_model is None
    spec = calibrator.options_for(4).cost_model
    assert spec.coefficients == calibrator.model and calibrator.model_for(4) == calibrator.model
    assert "plans from step 4 on use" in caplog.text
    assert _sample(metrics, "batch_planner_client_calibration_fits_total", result="updated") == 1
    assert _sample(metrics, "batch_planner_client_calibration_coefficient", coefficient="seconds_per_pass") == calibrator.model.seconds_per_pass
    assert _sample(metrics, "batch_planner_client_calibration_relative_error_ratio_count") == 3


def test_a_failed_fit_keeps_the_previous_model(monkeypatch):
    calibrator, metrics = _calibrator(update_interval_steps=3)
    _run_steps(calibrator, 6)
    good = calibrator.model
    assert good != CostModel()
    _within(good, HIDDEN, 0.1)
    import trainer_client.service.calibration as calibration

    for result in ("not_converged", "out_of_bounds"):
        monkeypatch.setattr(calibration, "fit_cost_model", lambda *a, result=result, **k: calibration.FitResult(result, reason="test"))
        reports = _run_steps(calibrator, 3, first=6 if result == "not_converged" else 9)
        assert reports[-1].fit.result == result and calibrator.model == good
        assert _sample(metrics, "batch_planner_client_calibration_fits_total", result=result) == 1


def test_client_requests_carry_the_fit_from_the_effective_step_and_prefetches_stay_consistent(caplog):
    import torch
    from tensordict import TensorDict

    from trainer_client import BatchPlannerClient, PlannerClientConfig

    config = PlannerClientConfig(max_seqlen_per_dp_cp_rank=2048, tls=False, job="t", calibration_update_interval_steps=2,
                                 calibration_min_observations=8)
    client = BatchPlannerClient(config, dp_cp_size=2, rank=0)
    rng = random.Random(0)

    def batch(step):
        lengths = [random.Random(step).randint(64, 3000) for _ in range(6)]
        return lengths, TensorDict({"input_ids": torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)},
                                   batch_size=[len(lengths)])

    seen = []
    client.prefetch(0, batch(0)[0])
    with caplog.at_level(logging.WARNING):
        for step in range(8):
            lengths, b = batch(step)
            plan = client.plan_step(step, lengths)
            seen.append(client.request_for(lengths, step).cost_model)
            client.prefetch(step + 1, batch(step + 1)[0])  # built before this step's end_step
            for rank in range(2):
                for unit in micro_batches_for_rank(plan, unbind_batch(b), rank):
                    client.record_unit(unit, price_vector(HIDDEN, features_of(unit)) * math.exp(rng.gauss(0, 0.02)))
            report = client.end_step()
            if report and report.effective_step:
                effective = report.effective_step
                break
    assert "differs from the one prefetched" not in caplog.text
    assert effective == step + 2 and all(s is None for s in seen)
    assert client.request_for([5], step + 1).cost_model is None  # prefetched with the preset
    assert client.request_for([5], effective).cost_model.coefficients == client.calibration.model
    client.close()


def test_a_new_model_that_changes_the_served_winner_is_logged(caplog):
    from batch_planner.plan import CandidateSummary, Plan
    from batch_planner.request import CapacityBound

    calibrator, _ = _calibrator(update_interval_steps=1)

    def plan(winner):
        candidates = tuple(CandidateSummary(name, SchedulerKind.DYNAMIC_CP, 4096, None, 1, 1.0, name == winner)
                           for name in ("static_cp1", "dynamic_cp max_seqlen=4096"))
        return Plan("id", SchedulerKind.DYNAMIC_CP, "X", "0", 4, 1, CpLayout.ZIGZAG, CapacityBound.PER_RANK_SUM, (),
                    candidates=candidates)

    with caplog.at_level(logging.INFO, logger="trainer_client.service.calibration"):
        calibrator.begin_step(0, plan("static_cp1"))
        calibrator.begin_step(1, plan("dynamic_cp max_seqlen=4096"))  # same model: batches differ, no line
        assert "changed the served plan" not in caplog.text
        calibrator._adopt(HIDDEN, 3)
        calibrator.begin_step(2, plan("static_cp1"))  # still the old model
        assert "changed the served plan" not in caplog.text
        calibrator.begin_step(3, plan("dynamic_cp max_seqlen=4096"))
    assert "step 3: the calibrated cost model changed the served plan from static_cp1 (step 2" in caplog.text


def test_ranks_that_hold_different_models_all_adopt_rank_zeros(caplog):
    calibrator, _ = _calibrator()
    calibrator.begin_step(0)
    calibrator._adopt(HIDDEN, 2)
    other = CostModel(**{n: getattr(HIDDEN, n) * 1.01 for n in COEFFICIENT_NAMES})
    from trainer_client.service.calibration import model_digest

    everyone = [([0], [], model_digest(other), [getattr(other, n) for n in COEFFICIENT_NAMES]),
                ([0], [], model_digest(HIDDEN), [getattr(HIDDEN, n) for n in COEFFICIENT_NAMES])]
    with caplog.at_level(logging.WARNING):
        calibrator._check_models(everyone)
    assert calibrator.model == other and calibrator.options_for(2).cost_model.coefficients == other
    assert calibrator.options_for(1).cost_model is None and "adopting rank 0's" in caplog.text
