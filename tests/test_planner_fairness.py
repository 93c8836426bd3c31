"""Fair admission per job: Admission's per-job share, the job read from the request metadata (a
name that is not one refused), and a real server where one job's flood is refused while another
job's request is planned (docs/reliability.md "Fair admission per job")."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.distributions import sample_lengths
from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from planner_server.admission import Admission, JobShareExceeded, PoolOverloaded
from tests.planner_process import start_planner
from tests.reliability_support import wait_until


def job(name: str) -> tuple[tuple[str, str]]:
    """The request metadata that names the job, as the trainer client sends it."""
    return ((JOB_METADATA_KEY, name),)


def request(job: str = "", samples: int = 16, dp: int = 4, cp: int = 1) -> pb.PlanRequest:
    return pb.PlanRequest(
        sequence_lengths=sample_lengths("long_tail_16k", samples, seed=1),
        layout=pb.ParallelLayout(data_parallel_size=dp, context_parallel_size=cp),
        max_seqlen_per_dp_cp_rank=8192,
        scheduler=pb.SCHEDULER_HYBRID_CP,
        job=job,
    )


# --- Admission's per-job share ---


def held_by(admission: Admission, job: str) -> int:
    return admission._by_job.get(job, 0)


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
    assert (held_by(admission, "burst"), held_by(admission, "third"), admission.in_flight) == (3, 1, 8)


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
    assert held_by(admission, "only") == 0 and admission._by_job == {}
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
            held = [stub.Plan.future(big, timeout=120, metadata=job("burst")) for _ in range(2)]
            wait_until(lambda: metric(server.metrics_url, "batch_planner_in_flight_requests") >= 2, 60,
                       "the bursting job's two requests in flight")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Plan(big, timeout=30, metadata=job("burst"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "job 'burst'" in refused.value.details() and "its share is 2" in refused.value.details()
            assert metric(server.metrics_url, "batch_planner_job_share_rejections_total", training_job="burst") == 1
            # A client that sends no metadata (an older one, grpcurl) is admitted under its message's job.
            with pytest.raises(grpc.RpcError) as refused:
                stub.Plan(big, timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "job 'burst'" in refused.value.details()
            # The other job still gets its plans, inline and on a worker (the bound has 2 slots left).
            quiet = stub.Plan(request("quiet", samples=64, dp=8), timeout=60, metadata=job("quiet"))
            assert quiet.micro_batches
            assert all(not f.done() for f in held)
            for future in held:
                future.cancel()
            wait_until(lambda: metric(server.metrics_url, "batch_planner_in_flight_requests") == 0, 60,
                       "the cancelled requests' slots given back")
            assert metric(server.metrics_url, "batch_planner_overload_rejections_total") == 0
    finally:
        server.stop(signal.SIGKILL)
