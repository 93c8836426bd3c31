"""Errors the planning core raises, each with the gRPC status code it maps to.

The core knows nothing of gRPC; it names codes by the strings grpc.StatusCode uses, so the server
translates them one-to-one and the trainer's fallback can tell "your fault" from "our fault".
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"


class PlanningError(Exception):
    """A request that cannot be planned, with a message a person can act on."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequestError(PlanningError):
    """The caller's request is malformed: retrying it will not help."""

    code = ErrorCode.INVALID_ARGUMENT


class SchedulerUnavailableError(PlanningError):
    """The installed Megatron-Core lacks the scheduler asked for."""

    code = ErrorCode.FAILED_PRECONDITION


class SchedulerFailedError(PlanningError):
    """Megatron-Core's scheduler raised on input that passed validation."""

    code = ErrorCode.INTERNAL


class InvariantViolationError(PlanningError):
    """The scheduler returned a plan that breaks a plan invariant; it is never sent."""

    code = ErrorCode.INTERNAL

    def __init__(self, invariant: str, message: str):
        super().__init__(f"plan invariant {invariant} violated: {message}")
        self.invariant = invariant
