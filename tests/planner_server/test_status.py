"""batch_planner.errors.status_of and planner_server/status.py: every refusal's code is the one it
carries, anything else is INTERNAL, and each code ends a call as the gRPC status of the same name."""

from __future__ import annotations

import grpc
import pytest

from batch_planner.errors import ErrorCode, InvalidRequestError, PlanningError, status_of
from planner_server.admission import JobShareExceeded, PoolOverloaded
from planner_server.process_pool import WorkersLost
from planner_server.status import abort


@pytest.mark.parametrize("error, code", [
    (InvalidRequestError("layout: got 0"), ErrorCode.INVALID_ARGUMENT),
    (PlanningError("the caller cancelled the request", code=ErrorCode.CANCELLED), ErrorCode.CANCELLED),
    (PoolOverloaded("9 slots in flight"), ErrorCode.RESOURCE_EXHAUSTED),
    (JobShareExceeded("job 'a' holds 4 slots", "a"), ErrorCode.RESOURCE_EXHAUSTED),
    (WorkersLost("died 3 times"), ErrorCode.UNAVAILABLE),
])
def test_a_refusal_answers_the_code_it_carries_with_its_own_words(error, code):
    assert status_of(error) == (code, str(error))


def test_anything_else_is_our_bug():
    code, message = status_of(KeyError("sample 3"))
    assert code is ErrorCode.INTERNAL and message == "planner failure: KeyError: 'sample 3'"


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.OK])
def test_every_code_ends_a_call_as_the_grpc_status_of_its_name(code):
    with pytest.raises(Aborted) as aborted:
        abort(Context(), code, "why")
    assert aborted.value.args == (getattr(grpc.StatusCode, code.value), "why")
