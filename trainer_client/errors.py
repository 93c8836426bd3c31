"""Every error the trainer client raises of its own, under one base class, `PlannerClientError`;
each is also the builtin it has always been (ValueError, RuntimeError), so an existing `except
ValueError` keeps catching it. The hierarchy: docs/trainer-client.md, "Errors".

Every one of them travels between ranks (`trainer_client.plans.together`): pickled with its message and
attributes whatever its constructor takes, so that every rank of a group raises the same error.
"""

from __future__ import annotations

import pickle
from typing import Any


class PlannerClientError(Exception):
    """The base of every error the trainer client raises of its own."""

    def __reduce__(self) -> tuple:
        # Exception's own reduce calls cls(*args), which fails for a constructor of other arguments
        # (PlanRejectedError(code, message)); this rebuilds the same object from its args and state.
        return (_restore, (type(self), self.args, _picklable(self.__dict__)))


def _restore(cls: type[PlannerClientError], args: tuple, state: dict[str, Any]) -> PlannerClientError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def _picklable(state: dict[str, Any]) -> dict[str, Any]:
    """The attributes that can travel (UnsupportedCombinationError's `rule` holds functions)."""
    kept = {}
    for name, value in state.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - pickle raises several types
            continue
        kept[name] = value
    return kept


class InvalidArgumentError(PlannerClientError, ValueError):
    """An argument of a public call has a value that is not allowed; the message names it and what is."""


class ArgumentTypeError(PlannerClientError, TypeError):
    """An argument of a public call is of a type that is not allowed; the message names it and what is."""


class ConfigError(PlannerClientError, ValueError):
    """A setting with a bad value or an unknown name; the message names the key and what is allowed."""


class TlsMismatchError(ConfigError):
    """The client's `tls` setting does not match the server's: no retry or fallback would fix it."""


class UnsupportedCombinationError(PlannerClientError, ValueError):
    """A feature dynamic CP cannot run with; `.option` names it, `.rule` is the row that refused it."""

    def __init__(self, option: str, value: Any, fix: str, rule: Any = None):
        self.option, self.value, self.fix, self.rule = option, value, fix, rule
        super().__init__(f"dynamic CP does not support {option}={value!r}: {fix}")


class UnrunnablePlanError(UnsupportedCombinationError, RuntimeError):
    """A plan the trainer's engine cannot run (verl's engine raises RuntimeError for these, so this is one too)."""


class PlanRejectedError(PlannerClientError, ValueError):
    """The planner (or the in-process planner) refused the request itself; retrying cannot help."""

    def __init__(self, code: str, message: str):
        super().__init__(f"the batch planner rejected the request ({code}): {message}")
        self.code = code
        self.server_message = message


class BatchMismatchError(PlannerClientError, ValueError):
    """The batch does not match the plan (sample count, lengths, field shapes)."""


class RouterReplayAlignmentError(BatchMismatchError):
    """Recorded routes of a sample have neither L-1 nor L rows for an input of L tokens."""


class DropInInputError(PlannerClientError, ValueError):
    """A step's input cannot be planned or routed; raised on every rank of the DPxCP group."""


class ServiceFailedError(PlannerClientError, RuntimeError):
    """The service did not produce a plan after all attempts; `reason` is a bounded metric label."""

    def __init__(self, reason: str, message: str, whole_service: bool = True):
        super().__init__(f"batch planner service failed ({reason}): {message}")
        self.reason = reason
        # False: one replica failed this plan while others are connected; no outage to wait out.
        self.whole_service = whole_service


class PlannerUnavailableError(PlannerClientError, RuntimeError):
    """The service failed and fallback is off (or the asking rank could not plan for another reason)."""


class PlanMismatchError(PlannerClientError, RuntimeError):
    """Ranks that must train one plan (of one DPxCP group, TP group or pipeline) hold different plans or batches."""


class OutputRestoreError(PlannerClientError, RuntimeError):
    """Some sample's output is missing or came back more than once, or a rank's outputs could not be read."""


class ProcessGroupError(PlannerClientError, RuntimeError):
    """The trainer's process groups (Megatron-Core's parallel_state) cannot run the plan's CP groups."""


class UsageError(PlannerClientError, RuntimeError):
    """A call came before what it needs (a plan, a planned step): the message names the call to make first."""


class MissingUpstreamError(PlannerClientError, ImportError):
    """The installed trainer lacks upstream names a drop-in calls outside its public API; `.missing` names them."""

    def __init__(self, message: str, missing: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


class RankFailedError(PlannerClientError, RuntimeError):
    """Another rank failed with an error that cannot travel (does not pickle): its type and message."""
