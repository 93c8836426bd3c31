"""The trainer client's settings: one typed pydantic dataclass, loadable from a dict or a YAML
section (docs/trainer-client.md, "Configuration", lists every key).

Every setting is checked on construction, from a file or in Python: its type (a count is an int, not
a bool, a float or a string), its range, enums by value; an unknown key is refused. A bad one raises
ConfigError naming the key, the value and what is allowed (`_config_error` words every message).
"""

from __future__ import annotations

import functools
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, get_args

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from batch_planner.cost_spec import spec_from_mapping
from batch_planner.errors import InvalidRequestError
from batch_planner.exact.verified import DEFAULT_IMPLEMENTATION, SchedulerImplementation
from batch_planner.request import Count, PlanningOptions, SchedulerKind
from trainer_client.errors import ArgumentTypeError, ConfigError


class WhoAsks(str, Enum):
    """Which ranks of the DPxCP group call the planner for a step."""

    LEADER = "leader"  # rank 0 asks and broadcasts the plan; the default
    ALL_RANKS = "all_ranks"  # every rank asks; the plan ids are then compared


# Plans held in memory are bounded by the depth: a 16,384-sample plan is a few MB.
MAX_PLAN_AHEAD_DEPTH = 16
Seconds = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]


def _refuse(message: str) -> NoReturn:
    """A refusal from a validator, worded after the key (or whole, for a check of several keys)."""
    raise PydanticCustomError("refused", "{message}", {"message": message})


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class PlannerClientConfig(PlanningOptions):
    """The planning options of the job (batch_planner.request.PlanningOptions: the per-rank token
    budget, the static CP size, the scheduler, ...; each declared, documented and bounded there) and
    how to reach the planner. DPxCP comes from the process group, DP = DPxCP / CP."""

    # auto: the cheapest of Megatron-Core's plans and the job's static CP under the job's `cost_model`.
    scheduler: SchedulerKind = SchedulerKind.AUTO
    # "host:port", or "dns:///name:port" to balance round-robin over every address the name resolves to; empty: always plan in-process.
    planner_endpoint: str = ""
    job: str = ""
    who_asks: WhoAsks = WhoAsks.LEADER
    # Future steps `prefetch` may have planned at once: that many Plan RPCs in flight, at most depth + 1
    # plans held (docs/trainer-client.md, "Planning far enough ahead"); 1 plans only the next step.
    plan_ahead_depth: Annotated[int, Field(ge=1, le=MAX_PLAN_AHEAD_DEPTH)] = 1

    # Per Plan call, its retries included (gRPC retries within the call's deadline), before the client falls back.
    deadline_seconds: Positive = 2.0
    # Attempts per plan, the first included, on the codes batch_planner.errors.CLIENT_ACTION marks RETRY.
    # At most 5: gRPC's retryPolicy would lower a larger value to 5 without saying so.
    max_attempts: Annotated[int, Field(ge=1, le=5)] = 2
    initial_backoff_seconds: Seconds = 0.05
    max_backoff_seconds: Seconds = 1.0
    backoff_multiplier: Annotated[float, Field(ge=1)] = 2.0
    # A call unanswered after this long (and past twice the slowest of the last 20 answered calls), or
    # failed with time left, is sent once more to the next replica within `deadline_seconds`; the first
    # answer wins, the other is cancelled: at most two calls per plan. 0: never hedge.
    hedge_after_seconds: Seconds = 1.0

    # Plan in-process when the service fails. Off: a failure raises PlannerUnavailableError.
    fallback: bool = True
    # After a failure of the service as a whole, plan in-process this long before the next step probes
    # it again; one replica's failure within a plan's deadline is not an outage.
    fallback_cooldown_seconds: Seconds = 5.0
    # How fast the gRPC channel reconnects to a planner that comes back.
    max_reconnect_backoff_seconds: Positive = 1.0
    # What the in-process fallback runs: "compiled", "exact" or "upstream" (docs/trainer-client.md,
    # "Configuration"); the service's setting is its --scheduler-implementation.
    scheduler_implementation: SchedulerImplementation = DEFAULT_IMPLEMENTATION

    # TLS: off by default, like the chart's server; a mismatch with the server raises TlsMismatchError on
    # the first call instead of falling back. ca_file empty: system roots; cert_file + key_file: mutual TLS.
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name_override: str = ""

    # Closed-loop calibration of the cost model from timed units (docs/trainer-client.md, "Calibration").
    # A trainer that never calls `end_step` plans with its preset and runs no collective for it.
    calibration: bool = True
    calibration_window_steps: Count = 50
    calibration_min_observations: Count = 24
    calibration_update_interval_steps: Count = 5

    @field_validator("*", mode="before")
    @classmethod
    def _from_plain_data(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's forms of what is not plain data: an enum by its value, the list of schedulers, a
        cost model by its preset's name or as a mapping (batch_planner/cost_spec.py checks it)."""
        name = info.field_name or ""
        annotation = cls.__pydantic_fields__[name].annotation
        if name == "cost_model":
            return None if value is None else spec_from_mapping(value)
        if name == "auto_schedulers":
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                _refuse(f"{value!r} is not a list of scheduler names")
            return tuple(_member(SchedulerKind, v) for v in value)
        return _member(annotation, value) if isinstance(annotation, type) and issubclass(annotation, Enum) else value

    @field_validator("planner_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str) -> str:
        if endpoint:
            host, sep, port = endpoint_target(endpoint).rpartition(":")
            if "://" in endpoint and not endpoint.startswith("dns://"):
                _refuse(f"{endpoint!r} is not allowed; expected 'host:port' or 'dns:///name:port'")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                _refuse(f"{endpoint!r} has no valid port; expected 'host:port' or 'dns:///name:port'")
        return endpoint

    @model_validator(mode="after")
    def _tls_settings(self) -> PlannerClientConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            _refuse("tls_cert_file and tls_key_file: set both (mutual TLS) or neither")
        if not self.tls and (self.tls_ca_file or self.tls_cert_file or self.tls_server_name_override):
            _refuse("tls: False (plaintext) but TLS files or a server name override are set; drop them or set tls: true")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PlannerClientConfig:
        if not isinstance(values, dict):
            raise ConfigError(f"batch planner client config must be a mapping, got {type(values).__name__}")
        odd = [key for key in values if not isinstance(key, str)]
        if odd:
            raise ConfigError(f"key(s) {odd[:5]!r} are not names; allowed keys: {sorted(PlannerClientConfig.__pydantic_fields__)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, section: str | None = None) -> PlannerClientConfig:
        """Loads the file, or one top-level `section` of it (e.g. "batch_planner"); ConfigError
        naming the file when it is not YAML, not a mapping, or lacks the section."""
        import yaml

        if not isinstance(path, (str, Path)):
            raise ArgumentTypeError(f"path: got a {type(path).__name__}; expected the path of a YAML file (str or Path)")
        if section is not None and not isinstance(section, str):
            raise ArgumentTypeError(f"section: got a {type(section).__name__}; expected None or the name of a top-level section")
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: not a YAML file ({str(error).splitlines()[0]})") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping, got {type(data).__name__}; expected settings or sections")
        if section is not None:
            if section not in data:
                raise ConfigError(f"{path}: no top-level section {section!r}; sections: {sorted(map(str, data))}")
            data = data[section] or {}
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(data).__name__}; expected settings")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.__pydantic_fields__}
        return {k: (v.value if isinstance(v, Enum) else v.canonical() if hasattr(v, "canonical") else v) for k, v in values.items()}


def endpoint_target(endpoint: str) -> str:
    """The "host:port" of an endpoint: dns://AUTHORITY/name:port asks that DNS server (gRPC's
    syntax), dns:///name:port the system's."""
    return endpoint.removeprefix("dns://").partition("/")[2] if endpoint.startswith("dns://") else endpoint


def _member(enum: type[Enum], value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        _refuse(f"{value!r} is not allowed; allowed: {[e.value for e in enum]}")


def _config_error(error: ValidationError) -> ConfigError:
    """Pydantic's errors as one ConfigError: "<key>: <value> <what is wrong>; <what is allowed>"."""
    problems = error.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in problems if e["type"] == "unexpected_keyword_argument")
    if unknown:
        return ConfigError(f"unknown key(s) {unknown}; allowed keys: {sorted(PlannerClientConfig.__pydantic_fields__)}")
    return ConfigError("; ".join(_problem(e) for e in problems))


_TYPES = {"int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str"}
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<="}


def _problem(e: Any) -> str:
    if not e["loc"]:
        return e["ctx"]["message"]  # a check of several keys
    name, value, ctx = str(e["loc"][0]), e["input"], e.get("ctx") or {}
    if e["type"] == "refused":
        return f"{name}: {ctx['message']}"
    if e["type"] in _TYPES:  # bool is an int in Python; "true" in YAML for a count is a mistake worth naming
        return f"{name}: {value!r} is a {type(value).__name__}; expected a {_TYPES[e['type']]}"
    bound = next(((op, ctx[key]) for key, op in _BOUNDS.items() if key in ctx), None)
    if bound is None:
        return f"{name}: {value!r} is not allowed; expected a finite number"
    if isinstance(bound[1], float):  # pydantic gives a float key's bounds as floats
        value, expected = float(value), f"a number {bound[0]} {bound[1]:g}"
    else:
        expected = f"an integer {bound[0]} {bound[1]}"
    info = PlannerClientConfig.__pydantic_fields__[name]
    optional = "null or " if type(None) in get_args(info.annotation) else ""
    hint = f" ({info.description})" if info.description else ""
    return f"{name}: {value!r} is not allowed; expected {optional}{expected}{hint}"


def _refusing_with_config_error(cls: type[PlannerClientConfig]) -> type[PlannerClientConfig]:
    """Every construction (from_dict, from_yaml, the constructor, dataclasses.replace) raises
    ConfigError, worded by _config_error, or the cost model's own InvalidRequestError's message."""
    validated = cls.__init__

    @functools.wraps(validated)
    def __init__(self: PlannerClientConfig, *args: Any, **kwargs: Any) -> None:
        try:
            validated(self, *args, **kwargs)
        except ValidationError as error:
            raise _config_error(error) from None
        except InvalidRequestError as error:
            raise ConfigError(str(error)) from None

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


_refusing_with_config_error(PlannerClientConfig)
