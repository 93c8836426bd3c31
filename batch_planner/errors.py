"""Status codes, the errors the planning core raises, and what a client does with each code.

This is the one home of the project's status vocabulary. The core knows nothing of gRPC: it names
codes by the strings grpc.StatusCode uses (`grpc.StatusCode[code.value]` is the gRPC code), so the
server translates them one-to-one, and `CLIENT_ACTION` below is the one table the trainer client
reads to decide between retrying, falling back to in-process planning and refusing the request.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Every status a Plan call can end with (gRPC's names)."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # the server's in-flight bound, or a message too large
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # this replica's Megatron-Core lacks the scheduler
    ABORTED = "ABORTED"
    # Megatron-Core's scheduler refused this batch on a layout it plans (batch_planner/domain.py,
    # BATCH_LIMITS: e.g. too few samples for the VPP micro-batch groups): bounded, upstream's reason
    # named; the same batch fails the same way everywhere, in-process too.
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    # Our own bug: an invariant violation in a plan we built, an unexpected exception in our code,
    # or an upstream failure on a layout batch_planner/domain.py accepts (the domain is then wrong).
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"  # transient and ours: draining, a planning worker lost or restarting
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class ClientAction(str, Enum):
    RETRY = "retry"  # transient: try again with backoff, then fall back
    FALLBACK = "fallback"  # a retry gets the same answer: plan in-process at once
    REJECT = "reject"  # the request itself is wrong: in-process planning would refuse it too


# What the trainer client does with each status of a Plan call. Codes missing here (OK aside)
# are treated as FALLBACK; tests/trainer_client/test_client_config.py checks every code is listed.
CLIENT_ACTION: dict[ErrorCode, ClientAction] = {
    ErrorCode.UNAVAILABLE: ClientAction.RETRY,
    ErrorCode.DEADLINE_EXCEEDED: ClientAction.RETRY,
    ErrorCode.RESOURCE_EXHAUSTED: ClientAction.RETRY,
    ErrorCode.ABORTED: ClientAction.RETRY,
    ErrorCode.UNKNOWN: ClientAction.RETRY,  # e.g. a proxy's or a dying connection's answer
    ErrorCode.INTERNAL: ClientAction.FALLBACK,  # deterministic: the same request fails the same way
    ErrorCode.FAILED_PRECONDITION: ClientAction.FALLBACK,  # the trainer's Megatron-Core may have it
    ErrorCode.CANCELLED: ClientAction.FALLBACK,
    ErrorCode.NOT_FOUND: ClientAction.FALLBACK,
    ErrorCode.ALREADY_EXISTS: ClientAction.FALLBACK,
    ErrorCode.PERMISSION_DENIED: ClientAction.FALLBACK,
    ErrorCode.UNIMPLEMENTED: ClientAction.FALLBACK,  # not a planner (or an older one) at that address
    ErrorCode.DATA_LOSS: ClientAction.FALLBACK,
    ErrorCode.UNAUTHENTICATED: ClientAction.FALLBACK,
    ErrorCode.INVALID_ARGUMENT: ClientAction.REJECT,
    # The batch is outside what the scheduler plans: in-process planning runs the same upstream
    # code and would refuse it too, so the trainer raises upstream's reason at once, on every rank.
    ErrorCode.OUT_OF_RANGE: ClientAction.REJECT,
}


class PlanningError(Exception):
    """A call that ends with a status other than OK (`code`), with a message a person can act on:
    every refusal, of the core and of the server, is one of these, and `status_of` reads it."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, code: ErrorCode | None = None):
        super().__init__(message)
        self.field = field
        if code is not None:
            self.code = code


class InvalidRequestError(PlanningError):
    """The caller's request is malformed: retrying it will not help."""

    code = ErrorCode.INVALID_ARGUMENT


class SchedulerUnavailableError(PlanningError):
    """The installed Megatron-Core lacks the scheduler asked for."""

    code = ErrorCode.FAILED_PRECONDITION


class SchedulerFailedError(PlanningError):
    """Megatron-Core's scheduler raised on input that passed validation, other than by one of the
    batch refusals batch_planner/domain.py lists: the domain let through a layout it should not."""

    code = ErrorCode.INTERNAL


class BatchNotPlannableError(PlanningError):
    """Megatron-Core's scheduler refused this batch, on a layout it plans, with one of its own
    bounded refusals (batch_planner/domain.py, BATCH_LIMITS); the message names upstream's reason
    and what to send instead. Deterministic: retrying or planning in-process fails the same way."""

    code = ErrorCode.OUT_OF_RANGE


class InvariantViolationError(PlanningError):
    """The scheduler returned a plan that breaks a plan invariant; it is never sent."""

    code = ErrorCode.INTERNAL

    def __init__(self, invariant: str, message: str):
        super().__init__(f"plan invariant {invariant} violated: {message}")
        self.invariant = invariant


def status_of(exc: BaseException) -> tuple[ErrorCode, str]:
    """The status a failed call answers with, and the message its caller reads: the one mapping.
    Anything that is not a PlanningError is our bug: INTERNAL."""
    if isinstance(exc, PlanningError):
        return exc.code, str(exc)
    return ErrorCode.INTERNAL, f"planner failure: {type(exc).__name__}: {exc}"


class SchedulerWouldNotTerminate(RuntimeError):
    """The exact scheduler path (batch_planner/exact) found that Megatron-Core's own code would loop
    for ever on this input; raised instead of looping, and reported like any scheduler failure."""
