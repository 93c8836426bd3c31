from __future__ import annotations

import grpc
import pytest

from batch_planner.v1 import planner_pb2_grpc
from tests.planner_process import PlannerProcess, start_planner


@pytest.fixture(scope="session")
def planner() -> PlannerProcess:
    """One real planner server (2 worker processes) on loopback, shared by the session."""
    server = start_planner(workers=2)
    yield server
    server.stop()


@pytest.fixture()
def stub(planner: PlannerProcess):
    with grpc.insecure_channel(planner.address) as channel:
        yield planner_pb2_grpc.BatchPlannerStub(channel)
