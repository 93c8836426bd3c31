"""One log line per request, in text or JSON, and the requests whose plans broke an
invariant kept for an operator, bounded."""

from __future__ import annotations

import json

import grpc
import pytest

from batch_planner.errors import ErrorCode
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from planner_server.planning_worker import About, WorkerResult, request_digest
from planner_server.request_log import ViolationDump
from tests.support.reliability_support import wait_until

REQUEST = pb.PlanRequest(
    sequence_lengths=[4096, 2048, 1024, 512] * 4,
    layout=pb.ParallelLayout(data_parallel_size=4, context_parallel_size=2),
    max_seqlen_per_dp_cp_rank=4096,
    scheduler=pb.SCHEDULER_HYBRID_CP,
    job="log-test",
)


def request_lines(server) -> list[dict]:
    """The server's request log lines of this test's job (the session's other_planner logs in JSON
    and serves other tests too)."""
    lines = []
    for line in list(server.log_lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == "planner_server.requests" and entry.get("training_job") == REQUEST.job:
            lines.append(entry)
    return lines


def test_each_request_gets_one_json_log_line_with_its_fields(other_planner):
    bad = pb.PlanRequest()
    bad.CopyFrom(REQUEST)
    bad.sequence_lengths[0] = 0
    with grpc.insecure_channel(other_planner.address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)
        response = stub.Plan(REQUEST, timeout=60)
        with pytest.raises(grpc.RpcError):
            stub.Plan(bad, timeout=60)
    lines = wait_until(lambda: len(request_lines(other_planner)) >= 2 and request_lines(other_planner), 30,
                       "two request log lines")
    assert len(lines) == 2
    ok, refused = lines
    assert ok["plan_id"] == response.plan_id and ok["status"] == "OK"
    assert ok["request_digest"] == request_digest(REQUEST.SerializeToString())
    assert (ok["training_job"], ok["scheduler"], ok["samples"], ok["ranks"]) == ("log-test", "hybrid_cp", 16, 8)
    assert ok["latency_ms"] > 0
    assert refused["status"] == "INVALID_ARGUMENT" and "sequence_lengths" in refused["error"]


def test_requests_whose_plans_broke_an_invariant_are_kept_newest_first_and_bounded(tmp_path):
    dump = ViolationDump(str(tmp_path / "violations"), keep=3)
    written = []
    for i in range(5):
        payload = pb.PlanRequest(sequence_lengths=[i + 1]).SerializeToString()
        result = WorkerResult(ErrorCode.INTERNAL, message=f"plan invariant 4 violated: case {i}",
                              invariant="4", about=About(request_digest=request_digest(payload)))
        written.append(dump.write(payload, result))
    kept = sorted(p.name for p in (tmp_path / "violations").glob("*.pb"))
    assert len(kept) == 3 and written[-1].name in kept
    assert pb.PlanRequest.FromString(written[-1].read_bytes()).sequence_lengths == [5]
    assert "case 4" in written[-1].with_suffix(".txt").read_text()
    assert ViolationDump("", keep=3).write(b"x", result) is None
