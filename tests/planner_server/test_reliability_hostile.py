"""Hostile input: bytes that are not a PlanRequest, truncated messages, huge
repeated fields near and over the message size limit, maximum integer values, absurd layouts and
job names. The server answers each with a clear error (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for
an oversized message), never INTERNAL or UNKNOWN, stays SERVING, and its resident memory (server,
forkserver and workers together) stays bounded.

Runs against the session's real planner server (tests/conftest.py), default limits: 4 MiB per
message, 16384 samples per request.
"""

from __future__ import annotations

import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.v1 import planner_pb2 as pb
from tests.support.reliability_support import health_status, raw_plan_method, tree_rss_bytes

UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1
MESSAGE_LIMIT = 4 * 1024 * 1024  # the server's default --max-receive-message-bytes
SAMPLE_LIMIT = 16384  # the server's default --max-samples-per-request


def valid_request(**fields) -> pb.PlanRequest:
    message = pb.PlanRequest(
        sequence_lengths=[4096, 2048, 1024, 512] * 4,
        layout=pb.ParallelLayout(data_parallel_size=4, context_parallel_size=2, tensor_parallel_size=1),
        max_seqlen_per_dp_cp_rank=4096,
        scheduler=pb.SCHEDULER_HYBRID_CP,
    )
    for key, value in fields.items():
        if key == "sequence_lengths":
            del message.sequence_lengths[:]
            message.sequence_lengths.extend(value)
        elif key == "layout":
            message.layout.CopyFrom(value)
        else:
            setattr(message, key, value)
    return message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    return _varint(number << 3 | wire_type) + payload


VALID = valid_request().SerializeToString()

# (case id, raw bytes): none of these is a PlanRequest the server may plan.
MALFORMED = [
    ("one 0xff byte", b"\xff"),
    ("varint longer than 10 bytes", _field(3, 0) + b"\xff" * 11 + b"\x01"),
    ("length prefix past the end", _field(1, 2, _varint(1 << 30)) + b"\x01\x02"),
    ("length prefix of 2^63", _field(1, 2, _varint(1 << 63))),
    ("field number 0", b"\x00\x01"),
    ("start group never ended", _field(15, 3)),
    ("end group without start", _field(15, 4)),
    ("reserved wire type 6", _field(1, 6)),
    ("invalid UTF-8 job name", _field(9, 2, _varint(4) + b"\xff\xfe\xfd\xfc")),
    ("layout is a truncated sub-message", _field(2, 2, _varint(10) + _field(1, 0, b"\x08"))),
    ("valid message plus trailing garbage", VALID + b"\xff\xff\xff"),
    ("packed lengths ending inside a varint", _field(1, 2, _varint(3) + b"\x80\x80\x80")),
]

# Seeded random bytes: the same 60 blobs on every run.
_rng = random.Random(6)
RANDOM_BLOBS = [bytes(_rng.getrandbits(8) for _ in range(_rng.randint(1, 512))) for _ in range(60)]

OK_OR_INVALID = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture()
def channel(planner):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(planner.address, options=options) as channel:
        yield channel


def call_raw(channel: grpc.Channel, payload: bytes, timeout: float = 60.0) -> tuple[grpc.StatusCode, str]:
    try:
        raw_plan_method(channel)(payload, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""


@pytest.mark.parametrize("payload", [p for _, p in MALFORMED], ids=[name for name, _ in MALFORMED])
def test_malformed_bytes_get_invalid_argument(channel, payload):
    code, details = call_raw(channel, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "PlanRequest" in details or ":" in details  # says what was wrong, not a stack trace
    assert "Traceback" not in details


def test_every_truncation_of_a_valid_request_is_planned_or_refused_clearly(channel):
    # A cut at a field boundary is itself a valid (smaller) message; a cut inside a field is not.
    for cut in range(len(VALID) + 1):
        code, details = call_raw(channel, VALID[:cut])
        assert code in OK_OR_INVALID, f"cut at byte {cut}: {code} {details}"
    assert health_status(channel) == "SERVING"


def test_random_bytes_are_refused_clearly(channel):
    codes = {}
    for blob in RANDOM_BLOBS:
        code, details = call_raw(channel, blob)
        assert code in OK_OR_INVALID, f"{blob[:16]!r}...: {code} {details}"
        codes[code] = codes.get(code, 0) + 1
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= len(RANDOM_BLOBS) // 2, codes
    assert health_status(channel) == "SERVING"


def test_garbage_to_get_capabilities_is_invalid_argument_not_internal(channel):
    method = channel.unary_unary(
        "/batch_planner.v1.BatchPlanner/GetCapabilities", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as caught:
        method(b"\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"sequence_lengths": [UINT64_MAX] * 4}, ["sequence_lengths", str(UINT64_MAX)]),
        ({"sequence_lengths": [1, UINT64_MAX, 0]}, ["sequence_lengths"]),
        ({"max_seqlen_per_dp_cp_rank": UINT64_MAX}, ["max_seqlen_per_dp_cp_rank", str(UINT64_MAX)]),
        ({"layout": pb.ParallelLayout(data_parallel_size=UINT32_MAX, context_parallel_size=UINT32_MAX)},
         ["layout.data_parallel_size", str(UINT32_MAX)]),
        ({"layout": pb.ParallelLayout(data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=UINT32_MAX)},
         ["layout.tensor_parallel_size", str(UINT32_MAX)]),
        ({"layout": pb.ParallelLayout(data_parallel_size=1024, context_parallel_size=1024)},
         ["layout", "1048576", "1024"]),
        ({"layout": pb.ParallelLayout()}, ["layout.data_parallel_size", "got 0"]),
        ({"min_cp_size": UINT32_MAX}, ["min_cp_size"]),
        ({"max_seqs_per_micro_batch": UINT32_MAX}, ["max_seqs_per_micro_batch"]),
        ({"micro_batch_group_size": UINT32_MAX}, ["micro_batch_group_size"]),
        ({"scheduler": 2**31 - 1}, ["scheduler"]),
        ({"cp_layout": 2**31 - 1}, ["cp_layout"]),
        ({"cp_layout": -1}, ["cp_layout"]),
        ({"job": "x" * 100_000}, ["job", "not a job name"]),
        ({"job": "bad\nname{quote=\"}"}, ["job", "not a job name"]),
        ({"job": "run1\n"}, ["job", "not a job name"]),
    ],
    ids=[
        "uint64-max-lengths", "uint64-max-among-valid", "uint64-max-per-rank", "uint32-max-dp-cp",
        "uint32-max-tp", "dpcp-1M", "empty-layout", "uint32-max-min-cp", "uint32-max-seqs-per-mb",
        "uint32-max-mb-group", "unknown-scheduler", "unknown-cp-layout", "negative-cp-layout",
        "100k-job-name", "job-name-with-label-syntax", "job-name-with-trailing-newline",
    ],
)
def test_maximum_values_and_absurd_layouts_are_invalid_argument(channel, fields, words):
    code, details = call_raw(channel, valid_request(**fields).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    for word in words:
        assert word in details, f"{word!r} not in {details!r}"
    assert len(details) < 1000, "the error echoes a hostile value at length"


def test_huge_repeated_fields_near_and_over_the_message_limit(channel):
    # One sample past the sample limit: refused by validation, naming the limit.
    code, details = call_raw(channel, valid_request(sequence_lengths=[1] * (SAMPLE_LIMIT + 1)).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and str(SAMPLE_LIMIT) in details, details
    # Just under the message limit: ~4 million one-byte lengths; parsed and refused.
    near = valid_request(sequence_lengths=[1] * (MESSAGE_LIMIT - 64)).SerializeToString()
    assert MESSAGE_LIMIT - 64 < len(near) <= MESSAGE_LIMIT
    code, details = call_raw(channel, near)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sequence_lengths" in details, details
    # Over it: gRPC refuses before anything is parsed.
    over = valid_request(sequence_lengths=[1] * (MESSAGE_LIMIT + 16)).SerializeToString()
    code, details = call_raw(channel, over)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # Far over it (16x), with the largest varints.
    code, _ = call_raw(channel, valid_request(sequence_lengths=[UINT64_MAX] * (MESSAGE_LIMIT // 10 * 16)).SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert health_status(channel) == "SERVING"


@pytest.mark.parametrize("job", ["x" * 4000, "-starts-with-dash", 'bad name{quote="}'])
def test_a_job_metadata_that_is_not_a_job_name_is_invalid_argument(channel, job):
    # Admission reads the job from the request metadata, before any work: a value that is not a
    # job name is refused naming the key, the value and what is allowed, never used as a bucket.
    try:
        raw_plan_method(channel)(valid_request().SerializeToString(), timeout=60, metadata=((JOB_METADATA_KEY, job),))
        pytest.fail("planned a request whose job metadata is not a job name")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert JOB_METADATA_KEY in error.details() and job[:20] in error.details() and "[A-Za-z0-9_.-]" in error.details()
        assert len(error.details()) < 1000, "the error echoes a hostile value at length"
    # Without the metadata, or with a job name, the same request is planned (the shared bucket).
    for metadata in ((), ((JOB_METADATA_KEY, "ok-job"),)):
        raw_plan_method(channel)(valid_request().SerializeToString(), timeout=60, metadata=metadata)


def test_a_job_metadata_that_disagrees_with_the_messages_job_is_invalid_argument(channel):
    # The request was admitted under its metadata's job; a message that names another job would
    # count its metrics against a job whose share it never used.
    message = valid_request()
    message.job = "job-in-body"
    try:
        raw_plan_method(channel)(message.SerializeToString(), timeout=60, metadata=((JOB_METADATA_KEY, "job-in-metadata"),))
        pytest.fail("planned a request whose metadata and message name different jobs")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "job-in-body" in error.details() and "job-in-metadata" in error.details() and JOB_METADATA_KEY in error.details()
    raw_plan_method(channel)(message.SerializeToString(), timeout=60, metadata=((JOB_METADATA_KEY, "job-in-body"),))


def test_an_auto_request_padded_past_any_valid_size_is_refused_not_planned_on_one_worker(channel):
    # The handler parses (and spreads auto's candidates over the workers) only requests up to the
    # size of the largest valid one; a valid auto request padded with an unknown field past that
    # must not have one worker plan every candidate on one slot of the per-job share.
    message = valid_request(scheduler=pb.SCHEDULER_AUTO).SerializeToString()
    padding = _field(1000, 2, _varint(SAMPLE_LIMIT * 12) + b"x" * (SAMPLE_LIMIT * 12))
    assert call_raw(channel, message)[0] == grpc.StatusCode.OK
    code, details = call_raw(channel, message + padding)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "request:" in details and "auto" in details


def test_hostile_job_names_never_reach_the_metrics(planner, channel):
    # A refused request's job name must not become a metric label: 64 distinct 50 kB names would
    # otherwise pin megabytes in the registry and in every scrape.
    for i in range(12):
        call_raw(channel, valid_request(job=f"{i}-" + "y" * 50_000, layout=pb.ParallelLayout()).SerializeToString())
    page = urllib.request.urlopen(planner.metrics_url, timeout=10).read().decode()
    longest = max(len(line) for line in page.splitlines())
    assert "yyyy" not in page and longest < 2000, f"a metric line is {longest} characters long"


def test_server_memory_stays_bounded_under_a_hostile_barrage(planner, channel):
    pid = planner.proc.pid
    near_limit = valid_request(sequence_lengths=[100] * (MESSAGE_LIMIT // 2 - 64)).SerializeToString()
    over_limit = near_limit * 3
    barrage = [p for _, p in MALFORMED] + RANDOM_BLOBS[:20] + [near_limit, over_limit]

    def send(payloads: list[bytes], concurrency: int) -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            for code, _ in pool.map(lambda payload: call_raw(channel, payload), payloads):
                assert code != grpc.StatusCode.INTERNAL

    # First touch is not a leak: a worker's heap grows once to what parsing a near-limit message
    # needs (~28 MiB here) and keeps it resident for the next, and so does the malloc arena of each
    # handler thread a large message lands on. Four near-limit requests at once (two per worker) and
    # one round four at a time warm both workers and those threads; the rounds measured then go one
    # at a time, on handler threads gRPC's executor reuses, and must not grow with their number.
    send([near_limit] * 4, concurrency=4)
    send(barrage, concurrency=4)
    baseline = tree_rss_bytes(pid)
    for _ in range(4):
        send(barrage, concurrency=1)
    grown = tree_rss_bytes(pid) - baseline
    # Four rounds of ~80 hostile requests, eight of them near 4 MiB and four at 12 MiB: a leak of
    # even one message per request would add > 40 MiB.
    assert grown < 64 * 1024 * 1024, f"resident memory grew by {grown / 2**20:.0f} MiB"
    assert health_status(channel) == "SERVING"
