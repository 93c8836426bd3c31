from __future__ import annotations

import grpc
import pytest

from batch_planner.v1 import planner_pb2_grpc
from tests.support.planner_process import PlannerProcess, start_planner


@pytest.fixture(scope="session")
def planner() -> PlannerProcess:
    """One real planner server (2 worker processes) on loopback, shared by the session."""
    server = start_planner(workers=2)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def other_planner() -> PlannerProcess:
    """A second real planner process (1 worker) on loopback, shared by the session: for the tests
    that compare plans across two server processes, for the metrics tests, which count what their
    own requests move (before and after, never from zero), and for the JSON request log's test,
    which reads its own job's lines (it logs in JSON; `planner` in text). Each start costs two
    imports of Megatron-Core (the server's and its forkserver's). Ends with a clean drain (exit
    status 0)."""
    server = start_planner("--log-format", "json", workers=1)
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture()
def stub(planner: PlannerProcess):
    with grpc.insecure_channel(planner.address) as channel:
        yield planner_pb2_grpc.BatchPlannerStub(channel)


# The tests that run a model with attention (marked `attention`) are the suite's slowest: each leg
# prints their count and time at the end, so CI's log shows what they cost.
_ATTENTION_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "attention" in report.keywords:
        _ATTENTION_SECONDS[report.nodeid] = _ATTENTION_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if _ATTENTION_SECONDS:
        terminalreporter.write_line(
            f"tests with attention (the THD/CP stand-in): {len(_ATTENTION_SECONDS)} test(s), "
            f"{sum(_ATTENTION_SECONDS.values()):.0f} s (setup, call and teardown)"
        )
