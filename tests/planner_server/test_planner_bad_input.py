"""Table-driven bad input against the real server: right status, a message naming the field and
what is allowed, and the server still SERVING afterwards."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batch_planner.v1 import planner_pb2 as pb


def request(lengths=(4096, 2048, 1024, 512) * 4, dp=4, cp=2, tp=1, max_per_rank=4096, **extra) -> pb.PlanRequest:
    message = pb.PlanRequest(
        sequence_lengths=list(lengths),
        layout=pb.ParallelLayout(data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp),
        max_seqlen_per_dp_cp_rank=max_per_rank,
        scheduler=extra.pop("scheduler", pb.SCHEDULER_HYBRID_CP),
    )
    for key, value in extra.items():
        setattr(message, key, value)
    return message


UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1

# (case id, request, status, words the message must contain)
CASES = [
    ("empty batch", request(lengths=()), "INVALID_ARGUMENT", ["sequence_lengths", "empty"]),
    ("zero-length sample", request(lengths=(100, 0, 200)), "INVALID_ARGUMENT", ["sequence_lengths", "sample 1", ">= 1"]),
    ("sample too long for the DPxCP group", request(lengths=(100, 40000), max_per_rank=4096),
     "INVALID_ARGUMENT", ["sequence_lengths", "sample 1", "40000", "32768"]),
    ("odd DPxCP", request(dp=3, cp=1), "INVALID_ARGUMENT", ["layout", "power of two", "3"]),
    ("DPxCP of 1", request(dp=1, cp=1), "INVALID_ARGUMENT", ["layout", "power of two", "1"]),
    ("DPxCP 10 (IndexError upstream)", request(dp=5, cp=2, lengths=(30000,) + (100,) * 20),
     "INVALID_ARGUMENT", ["layout", "power of two", "10"]),
    ("DPxCP 20 (IndexError upstream)", request(dp=10, cp=2), "INVALID_ARGUMENT", ["layout", "power of two", "20"]),
    ("zero DP", request(dp=0), "INVALID_ARGUMENT", ["layout.data_parallel_size", "got 0", "allowed 1.."]),
    ("zero CP", request(cp=0), "INVALID_ARGUMENT", ["layout.context_parallel_size", "got 0"]),
    ("zero limit", request(max_per_rank=0), "INVALID_ARGUMENT", ["max_seqlen_per_dp_cp_rank", "got 0"]),
    ("absurd DP", request(dp=UINT32_MAX), "INVALID_ARGUMENT", ["layout.data_parallel_size", str(UINT32_MAX), "allowed 1.."]),
    ("absurd DPxCP", request(dp=1024, cp=1024), "INVALID_ARGUMENT", ["layout", "1048576", "limit"]),
    ("absurd TP", request(tp=4096), "INVALID_ARGUMENT", ["layout.tensor_parallel_size", "4096"]),
    ("absurd limit", request(max_per_rank=UINT64_MAX), "INVALID_ARGUMENT", ["max_seqlen_per_dp_cp_rank", str(UINT64_MAX)]),
    ("absurd length", request(lengths=(100, UINT64_MAX)), "INVALID_ARGUMENT", ["sequence_lengths", "sample 1", "at most"]),
    ("too many samples", request(lengths=(128,) * 20000), "INVALID_ARGUMENT", ["sequence_lengths", "20000", "limit of"]),
    ("unknown scheduler", request(scheduler=77), "INVALID_ARGUMENT", ["scheduler", "77", "SCHEDULER_HYBRID_CP"]),
    ("unspecified scheduler", request(scheduler=pb.SCHEDULER_UNSPECIFIED), "INVALID_ARGUMENT", ["scheduler", "SCHEDULER_UNSPECIFIED"]),
    ("unknown CP layout", request(cp_layout=9), "INVALID_ARGUMENT", ["cp_layout", "CP_LAYOUT_ZIGZAG"]),
    ("unknown padding", request(padding=7), "INVALID_ARGUMENT", ["padding", "7", "PADDING_RULE_VERL"]),
    ("min_local_rows without verl's padding", request(min_local_rows=8, scheduler=pb.SCHEDULER_DYNAMIC_CP), "INVALID_ARGUMENT",
     ["min_local_rows", "verl"]),
    ("min_local_rows on hybrid CP", request(min_local_rows=8, padding=pb.PADDING_RULE_VERL), "INVALID_ARGUMENT", ["min_local_rows", "hybrid_cp"]),
    ("zero min_local_rows", request(min_local_rows=0, padding=pb.PADDING_RULE_VERL, scheduler=pb.SCHEDULER_DYNAMIC_CP), "INVALID_ARGUMENT",
     ["min_local_rows", "got 0"]),
    ("min_cp_size on hybrid CP", request(min_cp_size=2), "INVALID_ARGUMENT", ["min_cp_size", "dynamic_cp"]),
    ("max seqs on hybrid CP", request(max_seqs_per_micro_batch=4), "INVALID_ARGUMENT", ["max_seqs_per_micro_batch", "static_packing"]),
    ("virtual pipeline on hybrid CP", request(micro_batch_group_size=2), "INVALID_ARGUMENT", ["micro_batch_group_size", "virtual pipeline"]),
    ("bad job name", request(job="job with spaces!"), "INVALID_ARGUMENT", ["job", "[A-Za-z0-9_.-]"]),
    ("oversized message", request(lengths=(1000,) * 2_500_000), "RESOURCE_EXHAUSTED", []),  # 5 MB > 4 MB
]


@pytest.mark.parametrize("message,status,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly(planner, stub, message, status, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(message, timeout=30)
    assert err.value.code().name == status, err.value.details()
    for word in words:
        assert word in err.value.details(), f"{word!r} not in {err.value.details()!r}"
    assert "Traceback" not in (err.value.details() or "")


def test_unavailable_schedulers_name_the_megatron_core_needed(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
    for info in caps.schedulers:
        if info.available:
            continue
        with pytest.raises(grpc.RpcError) as err:
            stub.Plan(request(scheduler=info.scheduler), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "scheduler" in err.value.details() and "Megatron-LM dev branch" in err.value.details()


def test_still_serving_after_bad_input(planner, stub):
    for _, message, _, _ in CASES:
        with pytest.raises(grpc.RpcError):
            stub.Plan(message, timeout=30)
    with grpc.insecure_channel(planner.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stub.Plan(request(), timeout=30).plan_id
    assert planner.proc.poll() is None
