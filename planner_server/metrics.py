"""The planner's Prometheus metrics (served on their own HTTP port).

Labels stay bounded: scheduler (3 values), code (gRPC status names), precision (the proto's
Precision values), training_job (bounded by
--max-job-labels; later jobs are counted under training_job="other"). Not `job`: that is
Prometheus's own target label, and a clash would rename ours to exported_job.
"""

from __future__ import annotations

import threading

from batch_planner.request import SchedulerKind
from batch_planner.substitute import SubstituteReason

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

# A `_created` series per counter and histogram doubles the series and no query of ours reads it.
disable_created_metrics()

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
EFFICIENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)
SPEEDUP_BUCKETS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)

OTHER_JOB = "other"
NO_JOB = "unnamed"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_job_labels: int = 64):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # Resident memory, CPU time and open files of the gRPC process, as every exporter has them.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.max_job_labels = max_job_labels
        self._jobs: set[str] = set()
        self._jobs_lock = threading.Lock()
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}
        self.requests = Counter(
            "batch_planner_requests_total", "Plan requests answered, by scheduler and gRPC status code.",
            ["scheduler", "code", "training_job"], registry=r,
        )
        self.plan_latency = Histogram(
            "batch_planner_plan_latency_seconds", "Time from receiving a Plan request to answering it.",
            ["scheduler"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.scheduler_latency = Histogram(
            "batch_planner_scheduler_seconds",
            "Time the planning core took for one plan: validation, Megatron-Core's scheduler, the plan's invariants "
            "and statistics; for auto, all its candidates together (on the workers, their summed time).",
            ["scheduler"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.planned_tokens = Counter(
            "batch_planner_planned_tokens_total", "Real (unpadded) tokens in the plans served.",
            ["scheduler", "training_job"], registry=r,
        )
        self.padding_tokens = Counter(
            "batch_planner_padding_tokens_total", "Padding tokens the plans served add (padded minus real).",
            ["scheduler", "training_job"], registry=r,
        )
        self.alignment_padding_tokens = Counter(
            "batch_planner_alignment_padding_tokens_total",
            "Of the padding tokens, those the precision's row alignment adds (FP8: every rank's rows of a pass a multiple "
            "of what its GEMMs take), by precision (bf16 adds none and is not counted).",
            ["scheduler", "precision", "training_job"], registry=r,
        )
        self.planned_samples = Counter(
            "batch_planner_planned_samples_total", "Samples in the plans served, by the CP size they got.",
            ["scheduler", "cp_size"], registry=r,
        )
        self.micro_batches = Counter(
            "batch_planner_micro_batches_total", "Micro-batches in the plans served.", ["scheduler"], registry=r,
        )
        self.padding_ratio = Histogram(
            "batch_planner_padding_ratio", "Padding tokens / padded tokens, per plan.",
            ["scheduler"], buckets=RATIO_BUCKETS, registry=r,
        )
        self.balance_efficiency = Histogram(
            "batch_planner_balance_efficiency_ratio",
            "Lower bound (what no plan of the request can avoid) / predicted step cost, per plan: "
            "1 = no imbalance left to recover.",
            ["scheduler"], buckets=EFFICIENCY_BUCKETS, registry=r,
        )
        self.speedup = Histogram(
            "batch_planner_predicted_speedup_over_static_cp_ratio",
            "Predicted step cost under static CP / predicted step cost of the plan, per plan.",
            ["scheduler"], buckets=SPEEDUP_BUCKETS, registry=r,
        )
        self.last_speedup = Gauge(
            "batch_planner_last_predicted_speedup_over_static_cp_ratio",
            "Predicted speedup over static CP of the latest plan, per job.", ["scheduler", "training_job"], registry=r,
        )
        self.auto_winners = Counter(
            "batch_planner_auto_winners_total",
            "auto requests answered, by the Megatron-Core scheduler of the plan served.", ["scheduler"], registry=r,
        )
        self.auto_not_planned = Counter(
            "batch_planner_auto_candidates_not_planned_total",
            "auto candidates without a plan (refused, failed, breaking an invariant, or skipped by their lower bound), by their scheduler.", ["scheduler"],
            registry=r,
        )
        self.substituted = Counter(
            "batch_planner_substituted_total",
            "Plans served as the substitute (Megatron-Core's static-packing plan of the batch) because the requested "
            "scheduler's plan of the batch was not valid, by that scheduler and why (upstream_error, upstream_loop, "
            "unbuildable_cp_group).", ["scheduler", "reason"], registry=r,
        )
        self.invariant_violations = Counter(
            "batch_planner_invariant_violations_total",
            "Plans withheld because Megatron-Core's output broke a plan invariant.",
            ["scheduler", "invariant"], registry=r,
        )
        self.in_flight = Gauge(
            "batch_planner_in_flight_requests",
            "Slots of the in-flight bound held now: requests planned, queued, or whose worker is being stopped.",
            registry=r,
        )
        self.busy_workers = Gauge(
            "batch_planner_busy_workers", "Planning worker processes running a plan now.", registry=r,
        )
        self.live_workers = Gauge(
            "batch_planner_live_workers",
            "Planning worker processes started and running; while 0, a Plan call that needs a worker is answered "
            "UNAVAILABLE at once (the client tries another replica).", registry=r,
        )
        self.queue_rejections = Counter(
            "batch_planner_overload_rejections_total",
            "Plan requests refused with RESOURCE_EXHAUSTED because the planning queue was full.", registry=r,
        )
        self.job_share_rejections = Counter(
            "batch_planner_job_share_rejections_total",
            "Plan requests refused with RESOURCE_EXHAUSTED because their job held its share of the "
            "in-flight bound (--max-job-share) while other jobs were still admitted.",
            ["training_job"], registry=r,
        )
        self.rpc_limit_rejections = Counter(
            "batch_planner_rpc_limit_rejections_total",
            "Calls gRPC refused with RESOURCE_EXHAUSTED \"Concurrent RPC limit exceeded!\" before any "
            "handler ran (any method, health checks included).", registry=r,
        )
        self.worker_restarts = Counter(
            "batch_planner_worker_restarts_total",
            "Planning worker processes replaced: reason=died (crashed, killed) or abandoned (killed because "
            "the caller of the plan it ran went away).",
            ["reason"], registry=r,
        )
        for reason in ("died", "abandoned"):  # both series exist from the start, for rate()
            self.worker_restarts.labels(reason)
        for reason in SubstituteReason:  # every reason's series exists from the start, for rate()
            self.substituted.labels(SchedulerKind.DYNAMIC_CP.value, reason.value)
        self.scheduler_available = Gauge(
            "batch_planner_scheduler_available", "1 if the installed Megatron-Core provides the scheduler.",
            ["scheduler"], registry=r,
        )
        self.scheduler_exact_path = Gauge(
            "batch_planner_scheduler_exact_path",
            "1 if the scheduler plans on the exact path (batch_planner/exact: Megatron-Core's algorithm, faster, "
            "verified against this build), 0 if Megatron-Core's own code plans it.",
            ["scheduler"], registry=r,
        )
        self.build_info = Info(
            "batch_planner", "Server version, Megatron-Core version and available schedulers.", registry=r,
        )

    def track_pool(self, pool) -> None:
        """The pool's own counts, read at scrape time: what really holds a slot or a worker."""
        self.in_flight.set_function(lambda: pool.in_flight)
        self.busy_workers.set_function(lambda: pool.busy)
        self.live_workers.set_function(lambda: pool.live)

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, looked up once per label set: prometheus_client's labels()
        checks the values and takes the metric's lock on every call, a few microseconds each, and a
        Plan call updates a dozen series. Bounded as the labels are (no series is ever removed)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children.setdefault(key, metric.labels(*labels))
        return found

    def job_label(self, job: str) -> str:
        """Bounds the job label's cardinality: the first max_job_labels names, then 'other'."""
        if not job:
            return NO_JOB
        with self._jobs_lock:
            if job in self._jobs:
                return job
            if len(self._jobs) < self.max_job_labels:
                self._jobs.add(job)
                return job
        return OTHER_JOB
