"""Server settings: one typed dataclass, filled from flags, environment variables or defaults.

Every setting has a flag `--name-with-dashes` and an environment variable `PLANNER_NAME`; a flag
beats the environment, the environment beats the default. Each setting is declared once, as a field
with its help and its allowed range: ServerConfig's own, the request limits (RequestLimits,
batch_planner/validation.py) and the default cost model's coefficients (CostModel,
batch_planner/cost_spec.py). argparse gets the flags from those fields; pydantic-settings reads the
environment and validates every setting, flags included, as one flat model (`_SETTINGS`); a refused
value stops the server (exit 2) with a message naming the flag, the variable, the value and what is
allowed (`_refusal`).
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Iterable
from dataclasses import field, fields
from typing import Annotated, Any

from annotated_types import Ge, Le
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from batch_planner.cost_derivation import cost_model_for_preset
from batch_planner.cost_spec import CostModel, preset_names
from batch_planner.exact.verified import DEFAULT_IMPLEMENTATION, SchedulerImplementation
from batch_planner.validation import RequestLimits
from planner_server import __version__

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


def _one_of(choices: Callable[[], Iterable[str]], or_empty: bool = False) -> AfterValidator:
    def check(value: str) -> str:
        allowed = tuple(choices())
        if value not in allowed and not (or_empty and value == ""):
            raise PydanticCustomError("not_allowed", "{allowed}", {"allowed": ", ".join(allowed)})
        return value

    return AfterValidator(check)


def _setting(default: Any, doc: str, low: float | None = None, high: float | None = None) -> Any:
    return Field(default, ge=low, le=high, description=doc)


PORT, OPTIONAL_PORT, COUNT = (0, 65535), (-1, 65535), (0, 1 << 31)  # OPTIONAL_PORT: -1 = none


@dataclass(frozen=True, config=ConfigDict(extra="forbid", allow_inf_nan=False))
class ServerConfig:
    host: str = _setting("[::]", "address to listen on")
    port: int = _setting(50051, "gRPC port (0 picks a free port)", *PORT)
    metrics_port: int = _setting(9400, "Prometheus /metrics HTTP port (0 picks a free port, -1 disables)", *OPTIONAL_PORT)
    probe_port: int = _setting(
        50052, "plaintext port serving only grpc.health.v1 for Kubernetes probes, even with TLS: service '' is readiness (SERVING once warmed "
        "up, NOT_SERVING while draining), 'liveness' is liveness (0 picks a free port, -1 disables)", *OPTIONAL_PORT)
    workers: int = _setting(0, "planning worker processes (0 = one per available core)", 0, 4096)
    max_queued_requests: int = _setting(64, "requests that may wait for a worker before new ones get RESOURCE_EXHAUSTED", *COUNT)
    max_job_share: float = _setting(
        0.5, "fraction of the in-flight bound (--workers + --max-queued-requests) one job (the request's job name) may hold; past it that job "
        "gets RESOURCE_EXHAUSTED while others are admitted; 1.0 = off", 0.01, 1.0)
    max_receive_message_bytes: int = _setting(4 * 1024 * 1024, "largest request message accepted, in bytes", 1, (1 << 31) - 1)
    inline_max_samples: int = _setting(
        128, "plan requests of at most this many samples (and --inline-max-ranks ranks) in the gRPC handler thread, skipping the hop to a "
        "worker process; they still count against the in-flight bound (0 = every request goes to a worker)", *COUNT)
    inline_max_ranks: int = _setting(16, "largest DPxCP rank count a request planned in the gRPC handler thread may ask for", *COUNT)
    drain_seconds: float = _setting(20.0, "on SIGTERM, how long in-flight requests may run before the server exits", 0.0, 86400.0)
    default_deadline_seconds: float = _setting(60.0, "deadline applied to requests that carry none", 0.001, 86400.0)
    max_job_labels: int = _setting(64, 'distinct training_job label values in metrics before new jobs count as training_job="other"', *COUNT)
    extra_concurrent_rpcs: int = _setting(
        64, "calls gRPC accepts beyond --workers + --max-queued-requests (health checks, capability calls, requests refused at once); past "
        "it gRPC answers RESOURCE_EXHAUSTED, counted in batch_planner_rpc_limit_rejections_total", *COUNT)
    max_connection_age_seconds: float = _setting(
        300.0, "close each client connection after about this long (clients reconnect at once and re-resolve DNS, so replicas added by "
        "the autoscaler get traffic; 0 = never)", 0.0, 86400.0 * 365)
    log_level: Annotated[str, BeforeValidator(str.upper), _one_of(lambda: LOG_LEVELS)] = _setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: Annotated[str, _one_of(lambda: LOG_FORMATS)] = _setting(
        "text", "text or json (one JSON object per line; each request's line carries plan_id, request_digest, training_job, scheduler, "
        "samples, ranks, latency_ms and status as fields)")
    violations_dir: str = _setting(
        "/tmp/batch-planner-violations", "where the requests whose plans broke an invariant are kept, as <digest>.pb with the violation in "
        "<digest>.txt (empty: kept nowhere)")
    violations_kept: int = _setting(32, "how many such requests violations_dir keeps (the newest)", 0, 100_000)
    tls_cert_file: str = _setting("", "PEM server certificate chain; with --tls-key-file enables TLS")
    tls_key_file: str = _setting("", "PEM server private key")
    tls_client_ca_file: str = _setting("", "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)")
    cost_model_preset: Annotated[str, _one_of(preset_names, or_empty=True)] = _setting(
        "", "default cost model for requests that name none: a preset (GetCapabilities lists them; e.g. llama3-8b-h200); empty: the "
        "coefficient flags")
    scheduler_implementation: Annotated[str, _one_of(lambda: (v.value for v in SchedulerImplementation))] = _setting(
        DEFAULT_IMPLEMENTATION.value, "compiled: Megatron-Core's algorithms through the planner's exact, faster execution (the same plans byte "
        "for byte), its hot loops compiled (numba) where the compiler is importable, where the installed Megatron-Core is a build it was "
        "verified against, else Megatron-Core's own code; exact: the same, always in pure Python; upstream: always Megatron-Core's own code")
    limits: RequestLimits = field(default_factory=RequestLimits)
    cost_model: CostModel = field(default_factory=CostModel)

    @property
    def worker_count(self) -> int:
        if self.workers > 0:
            return self.workers
        return max(1, len(os.sched_getaffinity(0)))


def _from_text(info: FieldInfo) -> FieldInfo:
    """A field as a flag or a variable gives it: text parsed to its type (a request's coefficients
    are strict numbers, cost_spec.py)."""
    lax = copy.copy(info)
    lax.metadata = [m for m in info.metadata if not isinstance(m, Strict)]
    return lax


_NESTED = {"limits": RequestLimits, "cost_model": CostModel}
# Every setting, flat: ServerConfig's own, then the limits, then the coefficients.
_FIELDS = {
    **{name: info for name, info in ServerConfig.__pydantic_fields__.items() if name not in _NESTED},
    **{name: _from_text(info) for nested in _NESTED.values() for name, info in nested.__pydantic_fields__.items()},
}


class _Environment(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLANNER_", extra="forbid", allow_inf_nan=False, frozen=True)


# The settings as pydantic-settings reads them: keyword arguments (the flags given), then PLANNER_*
# variables, then the defaults.
_SETTINGS = create_model("PlannerSettings", __base__=_Environment, **{name: (info.annotation, info) for name, info in _FIELDS.items()})


def _env_name(name: str) -> str:
    return "PLANNER_" + name.upper()


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')} (env {_env_name(name)})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="planner-server",
        description="Batch planner: Megatron-Core's context-parallel schedulers behind gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for name, info in _FIELDS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=info.annotation if info.annotation in (int, float) else str,
            default=argparse.SUPPRESS,  # not given: the environment's, else the default
            help=f"{info.description} (env {_env_name(name)}; default {info.default!r})",
        )
    return parser


def _refusal(error: ValidationError) -> str:
    """Pydantic's first error as "--flag (env PLANNER_FLAG): <value> <what is wrong>; <what is allowed>"."""
    first = error.errors(include_url=False)[0]
    name, value = str(first["loc"][0]), first["input"]
    kind = first["type"]
    if kind == "not_allowed":
        return f"{_flag(name)}: {value!r} is not allowed; allowed: {first['ctx']['allowed']}"
    if kind in ("int_parsing", "float_parsing", "int_from_float", "int_type", "float_type"):
        return f"{_flag(name)}: {value!r} is not a valid {_FIELDS[name].annotation.__name__}"
    metadata = _FIELDS[name].metadata
    low = next((m.ge for m in metadata if isinstance(m, Ge)), 0)
    high = next((m.le for m in metadata if isinstance(m, Le)), float("inf"))
    if kind == "finite_number":
        return f"{_flag(name)}: {value!r} is not allowed; expected a finite number in {low}..{high}"
    return f"{_flag(name)}: {value!r} is out of range; allowed: {low}..{high}"


def config_from_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    try:
        settings = _SETTINGS(**vars(parser.parse_args(argv))).model_dump()
    except ValidationError as error:
        parser.error(_refusal(error))
    nested = {key: kind(**{f.name: settings.pop(f.name) for f in fields(kind)}) for key, kind in _NESTED.items()}
    if settings["cost_model_preset"]:
        nested["cost_model"] = cost_model_for_preset(settings["cost_model_preset"])
    return ServerConfig(**settings, **nested)
