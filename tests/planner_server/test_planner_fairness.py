"""Fair admission per job through a real server: the job read from the request metadata (a name
that is not one refused), and one job's flood refused while another job's request is planned
(docs/reliability.md "Fair admission per job"). Admission's own rules: tests/planner_server/test_admission.py."""

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
from tests.support.planner_process import start_planner
from tests.support.reliability_support import wait_until


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
