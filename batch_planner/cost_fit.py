"""Fitting the cost model to measured units: a robust, bounded, non-negative least squares on
relative residuals (scipy), used by the trainer client's closed-loop calibration
(trainer_client/service/calibration.py) and by the offline preset fit (bench/gpu/calibrate.py). Features come
in COEFFICIENT_NAMES order (`batch_planner.cost.unit_features`); docs/trainer-client.md, "Calibration".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares, nnls

from batch_planner.cost import price
from batch_planner.cost_spec import COEFFICIENT_BOUNDS, COEFFICIENT_NAMES, CostModel, validate_coefficients
from batch_planner.errors import InvalidRequestError

# A coefficient is fitted when its feature is non-zero in at least this many distinct units.
MIN_UNITS_PER_TERM = 3
SIGNIFICANT_DIGITS = 4  # fitted coefficients travel rounded: readable, and stable across ranks
# The Cauchy loss's scale, in robust standard deviations of the residuals: 95% efficiency on
# Gaussian noise, while a unit many deviations off (a stall) weighs next to nothing.
CAUCHY_C = 2.385
MAX_FIT_EVALUATIONS = 60


def price_vector(model: CostModel, features: Sequence[float]) -> float:
    """`batch_planner.cost.price` of features given in COEFFICIENT_NAMES order (`features_of`)."""
    return price(model, dict(zip(COEFFICIENT_NAMES, features)))


@dataclass(frozen=True)
class FitResult:
    """`model`: the fitted coefficients, or None when `result` is not "updated"."""

    result: str  # updated, insufficient_data, not_converged or out_of_bounds (fits_total's label)
    model: CostModel | None = None
    observations: int = 0  # distinct units the fit saw
    fitted_terms: tuple[str, ...] = ()
    relative_error_scale: float = 0.0  # robust scale (1.4826 MAD) of the relative residuals
    reason: str = ""


def fit_cost_model(
    features: np.ndarray,
    seconds: np.ndarray,
    prior: CostModel,
    min_observations: int,
    max_iterations: int = MAX_FIT_EVALUATIONS,
) -> FitResult:
    """A robust, bounded, non-negative fit of the coefficients to timed units.

    Rows: units (features in COEFFICIENT_NAMES order, seconds measured). Residuals are relative
    (each unit weighs by 1 / its time: short and long units count alike, as multiplicative noise
    does). scipy's NNLS gives the least-squares start; scipy's bounded least squares (coefficients
    >= 0) with a Cauchy loss, scaled to the start's robust residual scale, then fits so that a few
    stalled units (a GC pause, a straggler) do not move the fit. `max_iterations` bounds its
    evaluations. A coefficient whose feature is non-zero in fewer than MIN_UNITS_PER_TERM distinct
    units keeps the prior's value."""
    x = np.asarray(features, dtype=float).reshape(-1, len(COEFFICIENT_NAMES))
    y = np.asarray(seconds, dtype=float)
    distinct = {tuple(np.round(row, 6)) for row in x}
    if len(distinct) < min_observations:
        return FitResult("insufficient_data", observations=len(distinct),
                         reason=f"{len(distinct)} distinct units, {min_observations} needed")
    prior_values = np.array([getattr(prior, name) for name in COEFFICIENT_NAMES])
    nonzero_rows = [{tuple(np.round(row, 6)) for row in x[x[:, j] != 0]} for j in range(x.shape[1])]
    fitted = np.array([len(rows) >= MIN_UNITS_PER_TERM for rows in nonzero_rows])
    if not fitted.any():
        return FitResult("insufficient_data", observations=len(distinct), reason="no term is exercised")
    # What the fixed terms explain is taken off; the rest is fitted, relative to each unit's time.
    target = y - x[:, ~fitted] @ prior_values[~fitted]
    z = x[:, fitted] / y[:, None]
    t = target / y
    scale = np.abs(z).max(axis=0)
    scale[scale == 0] = 1.0
    z = z / scale
    start, _ = nnls(z, t)  # the least-squares start
    fit = least_squares(lambda c: z @ c - t, start, jac=lambda c: z, bounds=(0.0, np.inf), method="trf", loss="cauchy",
                        f_scale=CAUCHY_C * _robust_scale(t - z @ start), max_nfev=max_iterations)
    if fit.status <= 0 or not np.isfinite(fit.x).all():
        return FitResult("not_converged", observations=len(distinct), reason=f"no convergence in {max_iterations} evaluations")
    solution = np.where(fit.active_mask < 0, 0.0, fit.x)  # at its bound: exactly 0, not an interior 1e-19
    residual_scale = _robust_scale(t - z @ solution)
    values = prior_values.copy()
    values[fitted] = solution / scale
    names = tuple(n for n, f in zip(COEFFICIENT_NAMES, fitted) if f)
    rounded = {name: _round(float(v)) for name, v in zip(COEFFICIENT_NAMES, values)}
    over = [f"{name}={rounded[name]:g} > {COEFFICIENT_BOUNDS[name]:g}" for name in names if rounded[name] > COEFFICIENT_BOUNDS[name]]
    if over:
        return FitResult("out_of_bounds", observations=len(distinct), fitted_terms=names, reason=", ".join(over))
    try:
        model = validate_coefficients(CostModel(**rounded), "calibration")
    except (InvalidRequestError, ValueError) as error:
        return FitResult("out_of_bounds", observations=len(distinct), fitted_terms=names, reason=str(error))
    return FitResult("updated", model, len(distinct), names, residual_scale)


def _robust_scale(residual: np.ndarray) -> float:
    """1.4826 x the median absolute deviation: the residuals' standard deviation, stalled units aside."""
    return max(1.4826 * float(np.median(np.abs(residual - np.median(residual)))), 1e-6)


def _round(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if value > 0 else 0.0
