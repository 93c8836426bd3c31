"""planner_server/servicer.py: the status each refusal of the Plan handler ends with, in the
handler alone (a stand-in pool and gRPC context): draining, a job name in the metadata that is not
one, the pool's overload, job share, timeout and lost workers, and GetCapabilities' bad request."""

from __future__ import annotations

import grpc
import pytest

from batch_planner.convert import JOB_METADATA_KEY
from planner_server.admission import JobShareExceeded, PoolOverloaded
from planner_server.config import ServerConfig
from planner_server.metrics import PlannerMetrics
from planner_server.process_pool import WorkersLost
from planner_server.servicer import PlannerServicer


class Aborted(Exception):
    pass


class Context:
    def __init__(self, metadata=(), active: bool = True):
        self.metadata, self.active = metadata, active

    def time_remaining(self):
        return 10.0

    def invocation_metadata(self):
        return self.metadata

    def is_active(self):
        return self.active

    def add_callback(self, callback):
        return True

    def abort(self, code, details):
        raise Aborted(code, details)


class Pool:
    def __init__(self, error: BaseException):
        self.error = error

    def plan(self, *args, **kwargs):
        raise self.error


def status(pool_error: BaseException, draining: bool = False, **context) -> tuple:
    servicer = PlannerServicer(ServerConfig(violations_dir=""), Pool(pool_error), PlannerMetrics())  # type: ignore[arg-type]
    if draining:
        servicer.draining.set()
    with pytest.raises(Aborted) as aborted:
        servicer.plan(b"", Context(**context))
    return aborted.value.args


@pytest.mark.parametrize("error, code, words", [
    (PoolOverloaded("9 slots in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED, "planner overloaded: 9 slots in flight"),
    (JobShareExceeded("job 'a' holds 4 slots", "a"), grpc.StatusCode.RESOURCE_EXHAUSTED, "planner overloaded by this job"),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED, "planning took longer than the deadline"),
    (WorkersLost("died 3 times"), grpc.StatusCode.UNAVAILABLE, "planning workers unavailable: died 3 times"),
    (KeyError("bug"), grpc.StatusCode.INTERNAL, "planner failure: KeyError"),
])
def test_each_pool_exception_has_its_status(error, code, words):
    got, message = status(error)
    assert got == code and words in message, message


def test_a_caller_gone_is_cancelled_not_timed_out():
    assert status(TimeoutError(), active=False)[0] == grpc.StatusCode.CANCELLED


def test_a_draining_server_answers_unavailable_without_planning():
    code, message = status(AssertionError("the pool was asked"), draining=True)
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down; retry on another replica" in message


def test_a_metadata_job_name_that_is_not_one_is_invalid_argument():
    code, message = status(AssertionError("the pool was asked"), metadata=((JOB_METADATA_KEY, "bad name\n"),))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"metadata {JOB_METADATA_KEY}" in message


def test_get_capabilities_refuses_a_request_that_is_not_one():
    servicer = PlannerServicer(ServerConfig(violations_dir=""), Pool(RuntimeError()), PlannerMetrics())  # type: ignore[arg-type]
    with pytest.raises(Aborted) as aborted:
        servicer.get_capabilities(b"\xff\xff\xff", Context())
    assert aborted.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
