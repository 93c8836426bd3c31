"""Closed-loop calibration: time what each plan really cost, fit the job's cost model to it, and
plan the job's next steps with what was measured (docs/trainer-client.md, "Calibration").

Measure (`UnitTimer`: CUDA events on a GPU, the monotonic clock otherwise), gather over the DPxCP
group every `update_interval_steps` steps so that every rank fits identical data and holds the
identical model (`Calibrator.end_step`), fit (`batch_planner.cost_fit`), and use the new model
from a step no rank has prefetched yet, in every request: the server keeps no state. Bad
measurements are dropped and counted (`DROP_REASONS`), never fitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from batch_planner.cost import unit_features
from batch_planner.cost_derivation import resolve_cost_model
from batch_planner.cost_fit import FitResult, fit_cost_model, price_vector
from batch_planner.cost_spec import COEFFICIENT_NAMES, CostModel, CostModelSpec
from batch_planner.plan import Plan
from batch_planner.request import PlanningOptions
from trainer_client.plans.distributed import is_distributed
from trainer_client.errors import UsageError
from trainer_client.plans.together import fail_together

log = logging.getLogger(__name__)

# Why a measurement was dropped (the `reason` label of batch_planner_client_calibration_dropped_total).
DROP_REASONS = (
    "empty_step",  # no rank of the group timed a unit in a step
    "rank_reported_nothing",  # one rank timed no unit in a step others timed
    "non_positive_time",  # a unit's time <= 0
    "not_finite",  # a unit's time or features NaN or infinite
    "no_work",  # a unit with no tokens
)


def features_of(unit: Any) -> tuple[float, ...]:
    """A timed unit's features in COEFFICIENT_NAMES order: one pass over its CP group of
    `local_cp_size`, its whole sequences' padded lengths and real lengths."""
    lengths = [int(n) for n in unit.sequence_lengths]
    padded = unit.cu_seqlens_padded
    padded = padded.tolist() if hasattr(padded, "tolist") else list(padded)
    padded_tokens = int(padded[-1] - padded[0]) if len(padded) > 1 else 0
    values = unit_features(padded_tokens, sum(n * n for n in lengths), int(unit.local_cp_size), 1 if lengths else 0)
    return tuple(values[name] for name in COEFFICIENT_NAMES)


def model_digest(model: CostModel) -> str:
    values = [getattr(model, name).hex() for name in COEFFICIENT_NAMES]
    return hashlib.blake2b(json.dumps(values).encode(), digest_size=8).hexdigest()


# ---------------------------------------------------------------------------------------- measure


@dataclass
class _Timing:
    micro_batch_index: int
    features: tuple[float, ...]
    seconds: float | None = None  # perf_counter timings, and CUDA timings once read
    events: tuple[Any, Any] | None = None  # (start, end) CUDA events, read at collect time


class UnitTimer:
    """This rank's timed units, by step, until they are collected for a gather."""

    def __init__(self) -> None:
        self._steps: dict[int, list[_Timing]] = {}

    @contextmanager
    def timed(self, step: int, unit: Any, cuda: bool | None = None) -> Iterator[None]:
        """Times the body as `unit`'s forward+backward on this rank. cuda: time with CUDA events on
        the current stream (default: when CUDA is initialised in this process or the unit's tokens
        are on a GPU); else the monotonic clock."""
        if cuda is None:
            cuda = _runs_on_cuda(unit)
        timing = _Timing(int(getattr(unit, "micro_batch_index", 0)), features_of(unit))
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            timing.events = (start, end)
        else:
            started = time.perf_counter()
            yield
            timing.seconds = time.perf_counter() - started
        self._steps.setdefault(step, []).append(timing)

    def record(self, step: int, unit: Any, seconds: float) -> None:
        """A unit timed by the trainer itself."""
        self._steps.setdefault(step, []).append(_Timing(int(getattr(unit, "micro_batch_index", 0)), features_of(unit), float(seconds)))

    def collect(self, steps: Sequence[int]) -> list[list[tuple[int, tuple[float, ...], float]]]:
        """Per step of `steps`: (micro-batch index, features, seconds) of each unit, in timing order.
        CUDA timings are read here, after one synchronisation on the last event recorded."""
        taken = [self._steps.pop(step, []) for step in steps]
        events = [t.events for timings in taken for t in timings if t.events is not None]
        if events:
            events[-1][1].synchronize()
        out = []
        for timings in taken:
            rows = []
            for t in timings:
                seconds = t.seconds if t.events is None else t.events[0].elapsed_time(t.events[1]) / 1e3
                rows.append((t.micro_batch_index, t.features, float(seconds)))  # type: ignore[arg-type]
            out.append(rows)
        for step in [s for s in self._steps if s < min(steps, default=0)]:
            self._steps.pop(step)  # steps never ended (skipped) are not kept forever
        return out


def _runs_on_cuda(unit: Any) -> bool:
    ids = getattr(unit, "token_fields", {}).get("input_ids") if hasattr(unit, "token_fields") else None
    if ids is not None and ids.is_cuda:
        return True
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class StepReport:
    """One gathered step: the group's measured time and the prediction of the model that planned it."""

    step: int
    predicted_seconds: float
    measured_seconds: float

    @property
    def relative_error(self) -> float:
        return abs(self.predicted_seconds - self.measured_seconds) / self.measured_seconds


@dataclass
class CalibrationReport:
    """What one `end_step` gathered and decided (None when it did not gather)."""

    steps: list[StepReport] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    fit: FitResult | None = None
    effective_step: int | None = None  # the step the new model plans from, when one was adopted
    model_digest: str = ""


class Calibrator:
    """The job's calibration on one rank: times units, gathers, fits, and says which planning
    options each step's request carries. Every rank of the DPxCP group runs the same one."""

    def __init__(
        self,
        options: PlanningOptions,
        window_steps: int,
        min_observations: int,
        update_interval_steps: int,
        plan_ahead_depth: int = 1,
        metrics: Any = None,
        group: Any = None,
    ) -> None:
        self.base_options = options
        spec = options.cost_model
        # The prior: the job's own cost model; without one, the server's default preset (CostModel()).
        self.prior = resolve_cost_model(spec, CostModel(), options.tensor_parallel_size)
        self.window_steps, self.min_observations = window_steps, min_observations
        self.update_interval_steps, self.plan_ahead_depth = update_interval_steps, max(1, plan_ahead_depth)
        self.metrics, self.group = metrics, group
        self.timer = UnitTimer()
        self.window: deque[list[tuple[int, tuple[float, ...], float]]] = deque(maxlen=window_steps)
        # (first step, model, options): the model in force from that step on, oldest first.
        self._schedule: list[tuple[int, CostModel, PlanningOptions]] = [(0, self.prior, options)]
        self._current_step: int | None = None
        self._ended: list[int] = []
        self._served: tuple[int, str, int] | None = None  # (step, winner, schedule entry's first step)
        self._set_coefficient_gauges(self.prior)

    # -- what each step plans with

    def entry_for(self, step: int | None) -> tuple[int, CostModel, PlanningOptions]:
        if step is None:
            return self._schedule[-1] if self._current_step is None else self.entry_for(self._current_step + 1)
        return next((entry for entry in reversed(self._schedule) if entry[0] <= step), self._schedule[0])

    def options_for(self, step: int | None) -> PlanningOptions:
        return self.entry_for(step)[2]

    def model_for(self, step: int | None) -> CostModel:
        return self.entry_for(step)[1]

    @property
    def model(self) -> CostModel:
        """The newest model (in force from its first step)."""
        return self._schedule[-1][1]

    # -- measure

    def begin_step(self, step: int, plan: Plan | None = None) -> None:
        self._current_step = step
        if plan is not None:
            self._note_winner(step, plan)

    def timed(self, unit: Any, cuda: bool | None = None):
        return self.timer.timed(self._step(), unit, cuda)

    def record(self, unit: Any, seconds: float) -> None:
        self.timer.record(self._step(), unit, seconds)

    def _step(self) -> int:
        if self._current_step is None:
            raise UsageError("calibration: no step is planned yet; time units after client.plan_step(step, ...)")
        return self._current_step

    # -- gather and fit

    def end_step(self) -> CalibrationReport | None:
        """Ends the current step; every `update_interval_steps` steps gathers the buffered steps
        over the DPxCP group (a collective: every rank calls it at the same steps) and fits."""
        step = self._step()
        if not self._ended or self._ended[-1] != step:
            self._ended.append(step)
        if (step + 1) % self.update_interval_steps:
            return None
        steps, self._ended = self._ended, []
        mine = self.timer.collect(steps)
        latest = self._schedule[-1]
        payload = (steps, mine, model_digest(latest[1]), [getattr(latest[1], n) for n in COEFFICIENT_NAMES])
        everyone = fail_together(None, self.group, payload)
        report = CalibrationReport()
        self._check_models(everyone)
        first_rank = not is_distributed(self.group) or dist.get_rank(self.group) == 0
        for index, gathered_step in enumerate(steps):
            per_rank = [entry[1][index] if index < len(entry[1]) and entry[0] == steps else [] for entry in everyone]
            kept = self._clean(per_rank, report.dropped)
            if kept is None:
                continue
            self.window.append([row for rank_rows in kept for row in rank_rows])
            if all(kept):  # every rank's units: the step's time is known
                report.steps.append(self._step_report(gathered_step, kept))
        self._count(report, first_rank)
        rows = [row for step_rows in self.window for row in step_rows]
        if rows:
            features = np.array([r[1] for r in rows], dtype=float)
            seconds = np.array([r[2] for r in rows], dtype=float)
            fit = fit_cost_model(features, seconds, self.model, self.min_observations)  # unexercised terms keep the newest model's value
        else:
            fit = FitResult("insufficient_data", reason="no measurement in the window")
        report.fit = fit
        if self.metrics is not None and first_rank:
            self.metrics.calibration_fits.labels(self.metrics.job, fit.result).inc()
        if fit.result == "updated" and fit.model is not None and fit.model != latest[1]:
            effective = step + 1 + self.plan_ahead_depth
            self._adopt(fit.model, effective)
            report.effective_step = effective
            log.info(
                "calibration: step %d: fitted the cost model to %d distinct units of %d steps (terms %s, "
                "relative scatter %.3f); plans from step %d on use %s",
                step, fit.observations, len(self.window), ", ".join(fit.fitted_terms), fit.relative_error_scale,
                effective, _coefficients_text(fit.model),
            )
        elif fit.result in ("not_converged", "out_of_bounds"):
            log.warning("calibration: step %d: fit %s (%s); keeping the previous model", step, fit.result, fit.reason)
        report.model_digest = model_digest(self.model)
        return report

    def _adopt(self, model: CostModel, effective: int) -> None:
        spec = CostModelSpec(coefficients=model)
        options = replace(self.base_options, cost_model=spec)
        self._schedule = [e for e in self._schedule if e[0] < effective] + [(effective, model, options)]
        # Entries no step can use any more (an earlier step's successor already started) go.
        if self._current_step is not None:
            while len(self._schedule) > 1 and self._schedule[1][0] <= self._current_step:
                self._schedule.pop(0)
        self._set_coefficient_gauges(model)

    def _check_models(self, everyone: list[Any]) -> None:
        """Every rank fitted identical data; should a rank still hold other bits (another BLAS),
        all adopt rank 0's newest model, so that every request of the group stays identical."""
        digests = [entry[2] for entry in everyone]
        if len(set(digests)) == 1:
            return
        log.warning("calibration: ranks hold different models (digests by rank %s); adopting rank 0's", digests)
        model = CostModel(**dict(zip(COEFFICIENT_NAMES, everyone[0][3])))
        first = self._schedule[-1][0]
        options = replace(self.base_options, cost_model=CostModelSpec(coefficients=model))
        self._schedule[-1] = (first, model, options)

    def _clean(self, per_rank: list[list[tuple]], dropped: dict[str, int]) -> list[list[tuple]] | None:
        """The step's good units by rank; None when the step has none. Counts what it drops."""
        if not any(per_rank):
            _bump(dropped, "empty_step")
            return None
        kept: list[list[tuple]] = []
        for rows in per_rank:
            if not rows:
                _bump(dropped, "rank_reported_nothing")
            good = []
            for row in rows:
                index, features, seconds = row
                if not all(math.isfinite(v) for v in (*features, seconds)):
                    _bump(dropped, "not_finite")
                elif seconds <= 0:
                    _bump(dropped, "non_positive_time")
                elif features[0] <= 0:
                    _bump(dropped, "no_work")
                else:
                    good.append((int(index), tuple(float(v) for v in features), float(seconds)))
            kept.append(good)
        if not any(kept):
            return None
        return kept

    def _step_report(self, step: int, kept: list[list[tuple]]) -> StepReport:
        """Per micro-batch the slowest rank's units, summed over micro-batches: the cost model's
        own definition of a step (docs/cost-model.md), measured, and as the step's model priced it."""
        model = self.model_for(step)
        measured: dict[int, float] = {}  # by micro-batch: the slowest rank's
        predicted: dict[int, float] = {}
        for rows in kept:
            mine_measured: Counter[int] = Counter()
            mine_predicted: Counter[int] = Counter()
            for index, features, seconds in rows:
                mine_measured[index] += seconds
                mine_predicted[index] += price_vector(model, features)
            for index in mine_measured:
                measured[index] = max(measured.get(index, 0.0), mine_measured[index])
                predicted[index] = max(predicted.get(index, 0.0), mine_predicted[index])
        return StepReport(step, sum(predicted.values()), sum(measured.values()))

    def _count(self, report: CalibrationReport, first_rank: bool) -> None:
        m = self.metrics
        if m is None:
            return
        if first_rank:
            for reason, n in report.dropped.items():
                m.calibration_dropped.labels(m.job, reason).inc(n)
            for s in report.steps:
                m.calibration_error.labels(m.job).observe(s.relative_error)
        if report.steps:
            m.calibration_predicted_step.labels(m.job).set(report.steps[-1].predicted_seconds)
            m.calibration_measured_step.labels(m.job).set(report.steps[-1].measured_seconds)

    def _set_coefficient_gauges(self, model: CostModel) -> None:
        if self.metrics is not None:
            for name in COEFFICIENT_NAMES:
                self.metrics.calibration_coefficients.labels(self.metrics.job, name).set(getattr(model, name))

    def _note_winner(self, step: int, plan: Plan) -> None:
        """An INFO line when the first plan under a new model serves another winner than the last
        plan under the model before it."""
        served = [c.name for c in plan.candidates if c.served]
        winner = served[0] if served else plan.scheduler.value
        first = self.entry_for(step)[0]
        previous = self._served
        if previous is not None and previous[2] != first and previous[1] != winner:
            log.info(
                "calibration: step %d: the calibrated cost model changed the served plan from %s (step %d, "
                "previous model) to %s (predicted step %.4g s)",
                step, previous[1], previous[0], winner,
                plan.statistics.predicted_step_cost if plan.statistics else float("nan"),
            )
        self._served = (step, winner, first)


def _bump(counts: dict[str, int], reason: str) -> None:
    counts[reason] = counts.get(reason, 0) + 1


def _coefficients_text(model: CostModel) -> str:
    return ", ".join(f"{name}={getattr(model, name):.4g}" for name in COEFFICIENT_NAMES)


