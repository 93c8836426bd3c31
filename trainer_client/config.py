"""The trainer client's settings: one typed dataclass, loadable from a dict or a YAML file.

It drops into a trainer's config file as one section, e.g.

    batch_planner:
      planner_endpoint: dns:///batch-planner.default.svc.cluster.local:50051
      max_seqlen_per_dp_cp_rank: 16384
      deadline_seconds: 2.0
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from batch_planner.cost_spec import spec_from_mapping
from batch_planner.errors import InvalidRequestError
from batch_planner.exact.verified import SchedulerImplementation
from batch_planner.request import PlanningOptions, SchedulerKind


class WhoAsks(str, Enum):
    """Which ranks of the DPxCP group call the planner for a step."""

    LEADER = "leader"  # rank 0 asks and broadcasts the plan; the default
    ALL_RANKS = "all_ranks"  # every rank asks; the plan ids are then compared


class ConfigError(ValueError):
    """A setting with a bad value or an unknown name; the message names the key and what is allowed."""


@dataclass(frozen=True)
class PlannerClientConfig(PlanningOptions):
    """The planning options of the job (batch_planner.request.PlanningOptions: the per-rank token
    budget, the static CP size, the scheduler, ...; each documented there) and how to reach the
    planner. DPxCP comes from the process group, DP = DPxCP / CP."""

    # The client asks for auto (the cheapest of Megatron-Core's plans and the job's static CP under
    # the job's cost model) unless the config names one scheduler. `cost_model` names the job's
    # model: a preset ("llama3-8b-h200"), or {coefficients: ...}, or {model: ..., hardware: ...}.
    scheduler: SchedulerKind = SchedulerKind.AUTO
    # Where the planner listens: "host:port", or "dns:///name:port" to balance round-robin over
    # every address the name resolves to (all replicas behind a headless Kubernetes service).
    # Empty: never call a service, always plan in-process.
    planner_endpoint: str = ""
    job: str = ""
    who_asks: WhoAsks = WhoAsks.LEADER
    # How many future steps `prefetch` may have planned at once (1..MAX_PLAN_AHEAD_DEPTH): that
    # many Plan RPCs in flight, spread over the planner's replicas and workers, and at most
    # depth + 1 plans held in memory. Set it so that step time x depth exceeds one plan's latency
    # (docs/trainer-client.md, "Planning far enough ahead"); 1 plans only the next step.
    plan_ahead_depth: int = 1

    # One RPC attempt may take this long before it counts as failed.
    deadline_seconds: float = 2.0
    # Attempts per plan, the first included, on the codes batch_planner.errors.CLIENT_ACTION marks
    # RETRY (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...); never on INVALID_ARGUMENT.
    max_attempts: int = 2
    initial_backoff_seconds: float = 0.05
    max_backoff_seconds: float = 1.0
    backoff_multiplier: float = 2.0

    # Plan in-process with the same Megatron-Core scheduler when the service fails. Off: a
    # failure raises PlannerUnavailableError.
    fallback: bool = True
    # After a failure, plan in-process for this long without calling the service (so steps do not
    # each wait a full deadline while it is down); then the next step probes the service again.
    fallback_cooldown_seconds: float = 5.0
    # How fast the gRPC channel reconnects to a planner that comes back.
    max_reconnect_backoff_seconds: float = 1.0
    # Which code plans in this process (the fallback): "exact", the planner's exact and faster
    # execution of Megatron-Core's algorithm where the installed build is one it was verified
    # against (the same plan, byte for byte, as Megatron-Core's own code), or "upstream",
    # Megatron-Core's own code always. The service's setting is its --scheduler-implementation.
    scheduler_implementation: SchedulerImplementation = SchedulerImplementation.EXACT

    # TLS: off by default, like the chart's server (helm values tls.enabled); a mismatch with the
    # server raises TlsMismatchError on the first call instead of falling back. ca_file: the CA
    # that signed the server (empty: system roots). cert_file + key_file: this client's
    # certificate for mutual TLS.
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name_override: str = ""

    # Closed-loop calibration (trainer_client/calibration.py, docs/trainer-client.md): units the
    # trainer times (`client.timed(unit)`) fit the job's cost-model coefficients over the last
    # `calibration_window_steps` steps, gathered over the DPxCP group every
    # `calibration_update_interval_steps` steps (`client.end_step()`, a collective); once
    # `calibration_min_observations` distinct units are in the window the fitted coefficients
    # travel in the job's plan requests (`cost_model`), the preset (or `cost_model`) until then.
    # On by default: a trainer that never calls `end_step` plans with its preset and runs no
    # collective for it; `calibration: false` turns timing, gathering and fitting off.
    calibration: bool = True
    calibration_window_steps: int = 50
    calibration_min_observations: int = 24
    calibration_update_interval_steps: int = 5

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PlannerClientConfig:
        if not isinstance(values, dict):
            raise ConfigError(f"batch planner client config must be a mapping, got {type(values).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}; allowed keys: {sorted(known)}")
        converted = {name: _convert(known[name], value) for name, value in values.items()}
        return cls(**converted)

    @classmethod
    def from_yaml(cls, path: str | Path, section: str | None = None) -> PlannerClientConfig:
        """Loads the file, or one top-level `section` of it (e.g. "batch_planner")."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if section is not None:
            if not isinstance(data, dict) or section not in data:
                raise ConfigError(f"{path}: no top-level section {section!r}")
            data = data[section] or {}
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: (v.value if isinstance(v, Enum) else v.canonical() if hasattr(v, "canonical") else v) for k, v in values.items()}


# Read off the fields: every enum-typed setting, every optional count of the planning options.
_ENUMS = {f.name: type(f.default) for f in fields(PlannerClientConfig) if isinstance(f.default, Enum)}
_OPTIONAL_INTS = tuple(f.name for f in fields(PlanningOptions) if f.default is None and "int" in str(f.type))
_POSITIVE_INTS = (
    "max_seqlen_per_dp_cp_rank", "context_parallel_size", "tensor_parallel_size", "max_attempts", "plan_ahead_depth",
    "calibration_window_steps", "calibration_min_observations", "calibration_update_interval_steps",
)
# Plans held in memory are bounded by the depth: a 16,384-sample plan is a few MB.
MAX_PLAN_AHEAD_DEPTH = 16
_POSITIVE_FLOATS = ("deadline_seconds", "backoff_multiplier", "max_reconnect_backoff_seconds")
_NON_NEGATIVE_FLOATS = ("initial_backoff_seconds", "max_backoff_seconds", "fallback_cooldown_seconds")


def _convert(f, value: Any) -> Any:
    name = f.name
    if name == "auto_schedulers":
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"auto_schedulers: {value!r} is not a list of scheduler names")
        return tuple(_convert(next(f for f in fields(PlanningOptions) if f.name == "scheduler"), v) for v in value)
    if name == "cost_model":
        if value is None:
            return None
        try:
            return spec_from_mapping(value)
        except InvalidRequestError as error:
            raise ConfigError(str(error)) from None
    if name in _ENUMS:
        enum = _ENUMS[name]
        if isinstance(value, enum):
            return value
        try:
            return enum(value)
        except ValueError:
            raise ConfigError(
                f"{name}: {value!r} is not allowed; allowed: {[e.value for e in enum]}"
            ) from None
    default = f.default if f.default is not MISSING else None
    if name in _OPTIONAL_INTS:
        return None if value is None else _strict(name, value, int)
    if isinstance(default, bool):
        return _strict(name, value, bool)
    if isinstance(default, int):
        return _strict(name, value, int)
    if isinstance(default, float):
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        return _strict(name, value, float)
    return _strict(name, value, str)


def _strict(name: str, value: Any, kind: type) -> Any:
    # bool is an int in Python; "true" in YAML for a count is a mistake worth naming.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{name}: {value!r} is a {type(value).__name__}; expected a {kind.__name__}")
    return value


def _check(c: PlannerClientConfig) -> None:
    object.__setattr__(c, "auto_schedulers", _convert(next(f for f in fields(c) if f.name == "auto_schedulers"), c.auto_schedulers))
    if c.cost_model is not None:
        object.__setattr__(c, "cost_model", _convert(next(f for f in fields(c) if f.name == "cost_model"), c.cost_model))
    for name in _ENUMS:
        if not isinstance(getattr(c, name), _ENUMS[name]):
            object.__setattr__(c, name, _convert(next(f for f in fields(c) if f.name == name), getattr(c, name)))
    for name in _POSITIVE_INTS:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            hint = " (required: the job's per-rank token budget)" if name == "max_seqlen_per_dp_cp_rank" else ""
            raise ConfigError(f"{name}: {value!r} is not allowed; expected an integer >= 1{hint}")
    for name in _OPTIONAL_INTS:
        value = getattr(c, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}: {value!r} is not allowed; expected null or an integer >= 1")
    for name in _POSITIVE_FLOATS:
        value = getattr(c, name)
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name}: {value!r} is not allowed; expected a number > 0")
    for name in _NON_NEGATIVE_FLOATS:
        value = getattr(c, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}: {value!r} is not allowed; expected a number >= 0")
    if c.plan_ahead_depth > MAX_PLAN_AHEAD_DEPTH:
        raise ConfigError(
            f"plan_ahead_depth: {c.plan_ahead_depth!r} is not allowed; expected 1..{MAX_PLAN_AHEAD_DEPTH}"
        )
    if c.backoff_multiplier < 1:
        raise ConfigError(f"backoff_multiplier: {c.backoff_multiplier!r} is not allowed; expected >= 1")
    endpoint = c.planner_endpoint
    if endpoint:
        # dns://AUTHORITY/name:port asks that DNS server (gRPC's syntax); dns:///name:port the system's.
        target = endpoint.removeprefix("dns://").partition("/")[2] if endpoint.startswith("dns://") else endpoint
        host, sep, port = target.rpartition(":")
        if "://" in endpoint and not endpoint.startswith("dns://"):
            raise ConfigError(
                f"planner_endpoint: {endpoint!r} is not allowed; expected 'host:port' or 'dns:///name:port'"
            )
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"planner_endpoint: {endpoint!r} has no valid port; expected 'host:port' or 'dns:///name:port'"
            )
    if bool(c.tls_cert_file) != bool(c.tls_key_file):
        raise ConfigError("tls_cert_file and tls_key_file: set both (mutual TLS) or neither")
    if not c.tls and (c.tls_ca_file or c.tls_cert_file or c.tls_server_name_override):
        raise ConfigError("tls: False (plaintext) but TLS files or a server name override are set; drop them or set tls: true")
