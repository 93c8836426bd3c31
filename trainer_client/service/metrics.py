"""The trainer client's Prometheus metrics: served on a port or registered into the trainer's own
registry. Labels: training_job (one per trainer process; not `job`, Prometheus's target label), source (service | fallback), reason (bounded)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Lead: how long a plan was ready before its step asked for it; 0 (the first bucket) when it was late.
LEAD_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RELATIVE_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# Each metric: its attribute of TrainerMetrics -> (type, name, help, labels after training_job[, histogram buckets]).
_METRICS = {
    "plan_wait": (Histogram, "batch_planner_client_plan_wait_seconds",
        "Time the training loop actually waited for a step's plan (near zero when planned ahead).", (), LATENCY_BUCKETS),
    "plan_lead": (Histogram, "batch_planner_client_plan_lead_seconds",
        "Time between a step's plan arriving and the step asking for it; 0 when the step had to wait (a lead shrinking toward 0 means planning no longer keeps "
        "up with the step rate).", (), LEAD_BUCKETS),
    "late_plans": (Counter, "batch_planner_client_late_plans_total",
        "Steps whose plan had not arrived when the step asked for it (planned ahead too late, or not at all).", ()),
    "plan_ahead_depth": (Gauge, "batch_planner_client_plan_ahead_depth", "Configured plan-ahead depth (future steps planned at once).", ()),
    "rpc_latency": (Histogram, "batch_planner_client_rpc_latency_seconds",
        "Plan RPC latency seen by the client, per call (gRPC's retries inside it).", (), LATENCY_BUCKETS),
    "plans": (Counter, "batch_planner_client_plans_total", "Plans obtained, by source (service or fallback).", ("source",)),
    "fallbacks": (Counter, "batch_planner_client_fallbacks_total",
        "Steps planned in-process because the planner was unreachable, too slow or failing.", ("reason",)),
    "failovers": (Counter, "batch_planner_client_failovers_total",
        "Plan calls sent again to another replica within the plan's deadline, by reason: stalled (no answer after hedge_after_seconds) or the lower-cased gRPC "
        "status of the call that failed.", ("reason",)),
    "service_failures": (Counter, "batch_planner_client_service_failures_total",
        "Plans that no replica answered, by scope: service (no replica connected, or a second call failed too: the fallback cooldown starts) or replica (the "
        "deadline ran out on one call: this step only).", ("scope",)),
    "tokens": (Counter, "batch_planner_client_tokens_total", "Real tokens processed by this rank.", ()),
    "padding_tokens": (Counter, "batch_planner_client_padding_tokens_total", "Padding tokens processed by this rank.", ()),
    "tokens_per_second": (Gauge, "batch_planner_client_tokens_per_second", "Real tokens per second of the last step (this rank).", ()),
    "step_time": (Histogram, "batch_planner_client_step_seconds", "Training step time.", (), STEP_BUCKETS),
    "micro_batches": (Gauge, "batch_planner_client_micro_batches", "Micro-batches in the current step's plan.", ()),
    # Calibration (trainer_client/service/calibration.py): the same values on every rank of the DPxCP group (from the group's
    # gathered timings); counters and the error histogram count on the group's first rank only, so a sum over ranks is the group's.
    "calibration_predicted_step": (Gauge, "batch_planner_client_calibration_predicted_step_seconds",
        "The last gathered step's time as the cost model that planned it predicted (timed units).", ()),
    "calibration_measured_step": (Gauge, "batch_planner_client_calibration_measured_step_seconds",
        "The last gathered step's measured time: per micro-batch the slowest rank's timed units, summed.", ()),
    "calibration_error": (Histogram, "batch_planner_client_calibration_relative_error_ratio",
        "|predicted - measured| / measured step time, per gathered step.", (), RELATIVE_ERROR_BUCKETS),
    "calibration_coefficients": (Gauge, "batch_planner_client_calibration_coefficient",
        "The cost-model coefficients the job's plan requests carry (seconds), by coefficient.", ("coefficient",)),
    "calibration_dropped": (Counter, "batch_planner_client_calibration_dropped_total",
        "Measurements dropped and never fitted, by reason (bounded: see trainer_client/service/calibration.py).", ("reason",)),
    "calibration_fits": (Counter, "batch_planner_client_calibration_fits_total",
        "Calibration fits, by result (updated, insufficient_data, not_converged, out_of_bounds).", ("result",)),
}


class TrainerMetrics:
    """The client's metrics, each an attribute named as in `_METRICS` (`metrics.plan_wait.labels(metrics.job)`)."""

    def __init__(self, registry: CollectorRegistry | None = None, job: str = ""):
        self.registry = registry or CollectorRegistry()
        self.job = job or "unnamed"
        for attribute, (kind, name, doc, labels, *buckets) in _METRICS.items():
            extra = {"buckets": buckets[0]} if buckets else {}
            setattr(self, attribute, kind(name, doc, ["training_job", *labels], registry=self.registry, **extra))
