"""Server settings: one typed dataclass, filled from flags, environment variables or defaults.

Every setting has a flag `--name-with-dashes` and an environment variable `PLANNER_NAME`; a flag
beats the environment, the environment beats the default.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields

from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.cost_spec import CostModel, preset_names
from batch_planner.exact.verified import SchedulerImplementation
from batch_planner.validation import RequestLimits
from planner_server import __version__


@dataclass(frozen=True)
class ServerConfig:
    host: str = "[::]"
    port: int = 50051
    metrics_port: int = 9400
    probe_port: int = 50052  # plaintext health only, for the kubelet; -1 = none
    workers: int = 0  # planning processes; 0 = one per available core
    max_queued_requests: int = 64  # beyond workers; more in flight gets RESOURCE_EXHAUSTED
    max_job_share: float = 0.5  # of the in-flight bound one job may hold; 1.0 = no per-job bound
    max_receive_message_bytes: int = 4 * 1024 * 1024
    inline_max_samples: int = 128  # plan requests this small in the gRPC thread; 0 = always a worker
    inline_max_ranks: int = 16  # ... when they also ask for at most this many DPxCP ranks
    drain_seconds: float = 20.0
    default_deadline_seconds: float = 60.0  # for callers that set no deadline
    max_job_labels: int = 64
    extra_concurrent_rpcs: int = 64  # calls gRPC accepts beyond the in-flight bound
    max_connection_age_seconds: float = 300.0  # 0 = connections live for ever
    log_level: str = "INFO"
    log_format: str = "text"  # or json: one object per line
    violations_dir: str = "/tmp/batch-planner-violations"  # "" = keep none
    violations_kept: int = 32
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # set to require client certificates (mutual TLS)
    # The default cost model's preset (batch_planner/cost_spec.py, e.g. llama3-8b-h200); empty:
    # the coefficient flags below. Requests that carry their own cost model use theirs.
    cost_model_preset: str = ""
    # Which code plans: "exact" (batch_planner/exact, byte-identical to Megatron-Core's, where the
    # installed build is a verified one) or "upstream" (always Megatron-Core's own code).
    scheduler_implementation: str = "exact"
    limits: RequestLimits = field(default_factory=RequestLimits)
    cost_model: CostModel = field(default_factory=CostModel)

    @property
    def worker_count(self) -> int:
        if self.workers > 0:
            return self.workers
        return max(1, len(os.sched_getaffinity(0)))


_HELP = {
    "host": "address to listen on",
    "port": "gRPC port (0 picks a free port)",
    "metrics_port": "Prometheus /metrics HTTP port (0 picks a free port, -1 disables)",
    "probe_port": "plaintext port serving only grpc.health.v1 for Kubernetes probes, even with TLS: service "
    "'' is readiness (SERVING once warmed up, NOT_SERVING while draining), 'liveness' is liveness "
    "(0 picks a free port, -1 disables)",
    "workers": "planning worker processes (0 = one per available core)",
    "max_queued_requests": "requests that may wait for a worker before new ones get RESOURCE_EXHAUSTED",
    "max_job_share": "fraction of the in-flight bound (--workers + --max-queued-requests) one job (the "
    "request's job name) may hold; past it that job gets RESOURCE_EXHAUSTED while others are admitted; 1.0 = off",
    "max_receive_message_bytes": "largest request message accepted, in bytes",
    "inline_max_samples": "plan requests of at most this many samples (and --inline-max-ranks ranks) in the "
    "gRPC handler thread, skipping the hop to a worker process; they still count against the in-flight "
    "bound (0 = every request goes to a worker)",
    "inline_max_ranks": "largest DPxCP rank count a request planned in the gRPC handler thread may ask for",
    "drain_seconds": "on SIGTERM, how long in-flight requests may run before the server exits",
    "default_deadline_seconds": "deadline applied to requests that carry none",
    "max_job_labels": "distinct training_job label values in metrics before new jobs count as training_job=\"other\"",
    "extra_concurrent_rpcs": "calls gRPC accepts beyond --workers + --max-queued-requests (health checks, "
    "capability calls, requests refused at once); past it gRPC answers RESOURCE_EXHAUSTED, counted in "
    "batch_planner_rpc_limit_rejections_total",
    "max_connection_age_seconds": "close each client connection after about this long (clients reconnect "
    "at once and re-resolve DNS, so replicas added by the autoscaler get traffic; 0 = never)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "text or json (one JSON object per line; each request's line carries plan_id, "
    "request_digest, training_job, scheduler, samples, ranks, latency_ms and status as fields)",
    "violations_dir": "where the requests whose plans broke an invariant are kept, as <digest>.pb with "
    "the violation in <digest>.txt (empty: kept nowhere)",
    "violations_kept": "how many such requests violations_dir keeps (the newest)",
    "tls_cert_file": "PEM server certificate chain; with --tls-key-file enables TLS",
    "tls_key_file": "PEM server private key",
    "tls_client_ca_file": "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)",
    "max_samples_per_request": "largest batch (samples) one request may carry",
    "max_dp_cp_size": "largest DPxCP rank count a request may ask for",
    "max_sequence_length": "longest sample (tokens) a request may carry",
    "max_tensor_parallel_size": "largest tensor-parallel size a request may ask for",
    "max_micro_batch_group_size": "largest virtual-pipeline micro-batch group size",
    "cost_model_preset": "default cost model for requests that name none: a preset "
    "(GetCapabilities lists them; e.g. llama3-8b-h200); empty: the coefficient flags",
    "scheduler_implementation": "exact: Megatron-Core's algorithms through the planner's exact, faster "
    "execution (the same plans byte for byte) where the installed Megatron-Core is a build it was verified "
    "against, else Megatron-Core's own code; upstream: always Megatron-Core's own code",
    "seconds_per_token": "cost model: seconds per (padded) token per rank",
    "seconds_per_attention_token_pair": "cost model: seconds per L^2 attention unit per rank",
    "cp_seconds_per_micro_batch": "cost model: fixed seconds per forward pass over a CP group > 1",
    "cp_seconds_per_token": "cost model: CP communication seconds per token",
    "seconds_per_pass": "cost model: fixed seconds per forward+backward pass over any group (CP1 included)",
}


def _env_name(name: str) -> str:
    return "PLANNER_" + name.upper()


def _add(parser: argparse.ArgumentParser, name: str, default) -> None:
    env = os.environ.get(_env_name(name))
    kind = type(default)
    try:
        value = kind(env) if env is not None else default
    except ValueError:
        parser.error(f"environment variable {_env_name(name)}={env!r} is not a valid {kind.__name__}")
    parser.add_argument(
        "--" + name.replace("_", "-"),
        dest=name,
        type=kind,
        default=value,
        help=f"{_HELP.get(name, name)} (env {_env_name(name)}; default {default!r})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="planner-server",
        description="Batch planner: Megatron-Core's context-parallel schedulers behind gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    defaults = ServerConfig()
    for f in fields(ServerConfig):
        if f.name in ("limits", "cost_model"):
            continue
        _add(parser, f.name, getattr(defaults, f.name))
    for nested in (defaults.limits, defaults.cost_model):
        for f in fields(nested):
            _add(parser, f.name, getattr(nested, f.name))
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
_PORT = (0, 65535)
_COUNT = (0, 1 << 31)
_AT_LEAST_ONE = (1, 1 << 62)
# Allowed ranges, inclusive; floats must also be finite. Every number without an entry here must
# be >= 0 (the cost model's coefficients).
_RANGES = {
    "port": _PORT,
    "metrics_port": (-1, 65535),
    "probe_port": (-1, 65535),
    "workers": (0, 4096),
    "max_queued_requests": _COUNT,
    "max_job_share": (0.01, 1.0),
    "max_receive_message_bytes": (1, (1 << 31) - 1),
    "inline_max_samples": _COUNT,
    "inline_max_ranks": _COUNT,
    "drain_seconds": (0.0, 86400.0),
    "default_deadline_seconds": (0.001, 86400.0),
    "max_job_labels": _COUNT,
    "extra_concurrent_rpcs": _COUNT,
    "max_connection_age_seconds": (0.0, 86400.0 * 365),
    "violations_kept": (0, 100_000),
    **{f.name: _AT_LEAST_ONE for f in fields(RequestLimits)},
}


def _range_error(name: str, value) -> str | None:
    flag = f"--{name.replace('_', '-')} (env {_env_name(name)})"
    if name == "log_level":
        if value.upper() not in LOG_LEVELS:
            return f"{flag}: {value!r} is not a log level; allowed: {', '.join(LOG_LEVELS)}"
        return None
    if name == "cost_model_preset":
        if value and value not in preset_names():
            return f"{flag}: {value!r} is not a preset; allowed: {', '.join(preset_names())}"
        return None
    if name == "scheduler_implementation":
        allowed = [v.value for v in SchedulerImplementation]
        if value not in allowed:
            return f"{flag}: {value!r} is not an implementation; allowed: {', '.join(allowed)}"
        return None
    if name == "log_format":
        if value not in LOG_FORMATS:
            return f"{flag}: {value!r} is not a log format; allowed: {', '.join(LOG_FORMATS)}"
        return None
    if not isinstance(value, (int, float)):
        return None
    low, high = _RANGES.get(name, (0, float("inf")))
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag}: {value!r} is not allowed; expected a finite number in {low}..{high}"
    if not low <= value <= high:
        return f"{flag}: {value!r} is out of range; allowed: {low}..{high}"
    return None


def config_from_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    for name, value in args.items():
        error = _range_error(name, value)
        if error:
            parser.error(error)
    args["log_level"] = args["log_level"].upper()
    limits = RequestLimits(**{f.name: args.pop(f.name) for f in fields(RequestLimits)})
    cost_model = CostModel(**{f.name: args.pop(f.name) for f in fields(CostModel)})
    if args["cost_model_preset"]:
        cost_model = cost_model_for_preset(args["cost_model_preset"])
    return ServerConfig(limits=limits, cost_model=cost_model, **args)
