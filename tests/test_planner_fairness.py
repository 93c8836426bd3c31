"""Fair admission per job: the wire reader that finds a request's job name without parsing it,
Admission's per-job share, and a real server where one job's flood is refused while another job's
request is planned (docs/reliability.md "Fair admission per job")."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from planner_server.wire import read_job
from planner_server.worker_pool import Admission, JobShareExceeded, PoolOverloaded
from tests.planner_process import start_planner
from tests.reliability_support import wait_until


def request(job: str = "", samples: int = 16, dp: int = 4, cp: int = 1) -> pb.PlanRequest:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=1),
        layout=pb.ParallelLayout(data_parallel_size=dp, context_parallel_size=cp),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
        job=job,
    )


# --- the wire reader ---


def test_wire_reader_finds_the_job_name():
    assert read_job(request("llama-8b.run_3").SerializeToString()) == "llama-8b.run_3"


def test_wire_reader_without_a_job_or_an_invalid_one_is_the_shared_bucket():
    assert read_job(request().SerializeToString()) == ""
    assert read_job(b"") == ""
    assert read_job(request("-starts-with-dash").SerializeToString()) == ""
    assert read_job(request("x" * 64).SerializeToString()) == ""


def test_wire_reader_skips_a_huge_packed_field_by_its_length():
    data = request("burst", samples=16384, dp=1024).SerializeToString()
    assert len(data) > 16384
    assert read_job(data) == "burst"
    # The job first, then the packed lengths: found either way, whatever the field order.
    job_first = pb.PlanRequest(job="burst").SerializeToString() + pb.PlanRequest(
        sequence_lengths=[1000] * 50000).SerializeToString()
    assert read_job(job_first) == "burst"


@pytest.mark.parametrize("data", [
    b"\xff" * 11,  # a varint that never ends
    b"\x4a\x05ab",  # job declared 5 bytes long, 2 present
    b"\x4a",  # a tag and nothing after it
    b"\x0b\x4a\x01a",  # wire type 3 (start group): not a PlanRequest
    b"\x00\x4a\x01a",  # field number 0
    b"\x4a\x02\xff\xfe",  # not UTF-8
])
def test_wire_reader_stops_on_malformed_bytes(data):
    assert read_job(data) == ""


def test_wire_reader_last_job_wins_like_protobuf():
    data = pb.PlanRequest(job="a").SerializeToString() + pb.PlanRequest(job="b").SerializeToString()
    assert pb.PlanRequest.FromString(data).job == read_job(data) == "b"


# --- Admission's per-job share ---


def test_a_job_past_its_share_is_refused_while_others_are_admitted():
    admission = Admission(8, job_share=0.5)
    assert admission.job_bound == 4
    for _ in range(4):
        admission.reserve(1, "burst")
    with pytest.raises(JobShareExceeded, match=r"job 'burst' holds 4 slots in flight.*its share is 4 \(0.5 of the server's bound of 8\)") as refused:
        admission.reserve(1, "burst")
    assert refused.value.job == "burst"
    admission.reserve(1, "quiet")
    admission.reserve(3, "")  # the shared bucket of requests without a job name
    assert admission.in_flight == 8
    with pytest.raises(PoolOverloaded) as full:
        admission.reserve(1, "third")
    assert not isinstance(full.value, JobShareExceeded)  # the total bound, as before
    admission.release(1, "burst")
    admission.reserve(1, "third")
    assert (admission.held_by("burst"), admission.held_by("third"), admission.in_flight) == (3, 1, 8)


def test_auto_candidates_count_against_the_share():
    admission = Admission(8, job_share=0.5)
    admission.reserve(3, "auto-job")
    with pytest.raises(JobShareExceeded, match="needs 2 \\(one per auto candidate\\)"):
        admission.reserve(2, "auto-job")
    admission.reserve(1, "auto-job")


def test_share_one_turns_fairness_off_and_released_jobs_are_forgotten():
    admission = Admission(4, job_share=1.0)
    for _ in range(4):
        admission.reserve(1, "only")
    with pytest.raises(PoolOverloaded) as full:
        admission.reserve(1, "only")
    assert not isinstance(full.value, JobShareExceeded)
    admission.release(4, "only")
    assert admission.held_by("only") == 0 and admission._by_job == {}
    assert Admission(3, job_share=0.1).job_bound == 1  # at least one slot


# --- a real server ---


def metric(metrics_url: str, name: str, **labels: str) -> float:
    page = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_a_flooding_job_is_refused_naming_its_share_while_another_job_is_planned():
    # Bound 4 (2 workers + 2 queued), share 0.5: a job holds at most 2 slots.
    # The burst's plans must keep both workers busy for seconds: Megatron-Core's own code (the exact
    # path plans them in a fraction of a second).
    server = start_planner(
        "--max-queued-requests", "2", "--max-job-share", "0.5", "--scheduler-implementation", "upstream", workers=2
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = planner_pb2_grpc.BatchPlannerStub(channel)
            big = request("burst", samples=16384, dp=1024)
            held = [stub.Plan.future(big, timeout=120) for _ in range(2)]
            wait_until(lambda: metric(server.metrics_url, "batch_planner_in_flight_requests") >= 2, 60,
                       "the bursting job's two requests in flight")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Plan(big, timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "job 'burst'" in refused.value.details() and "its share is 2" in refused.value.details()
            assert metric(server.metrics_url, "batch_planner_job_share_rejections_total", training_job="burst") == 1
            # The other job still gets its plans, inline and on a worker (the bound has 2 slots left).
            quiet = stub.Plan(request("quiet", samples=64, dp=8), timeout=60)
            assert quiet.micro_batches
            assert all(not f.done() for f in held)
            for future in held:
                future.cancel()
            wait_until(lambda: metric(server.metrics_url, "batch_planner_in_flight_requests") == 0, 60,
                       "the cancelled requests' slots given back")
            assert metric(server.metrics_url, "batch_planner_overload_rejections_total") == 0
    finally:
        server.stop(signal.SIGKILL)
