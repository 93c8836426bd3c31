"""The job name of a PlanRequest, read from its wire bytes without parsing the message.

Admission needs the job before a worker parses the request, and the gRPC process must not parse
big messages (the packed sample lengths). This walks only the top-level fields: a tag, then a
varint, a fixed 32/64-bit value, or a length and that many bytes skipped. It costs O(number of
top-level fields), not O(samples). Malformed input stops the walk and counts as no job: the worker
that parses the request answers INVALID_ARGUMENT for it.
"""

from __future__ import annotations

from batch_planner.validation import JOB_NAME_PATTERN

JOB_FIELD = 9  # PlanRequest.job (proto/batch_planner/v1/planner.proto)
_MAX_FIELDS = 4096  # a real PlanRequest has a dozen; more is not a request worth walking


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; ValueError when it is cut or too long."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("varint longer than 10 bytes")


def read_job(data: bytes) -> str:
    """The request's job name, or "" when it has none, it is not a valid job name, or the bytes are
    malformed. The last occurrence wins, as in protobuf's own parsing."""
    job = ""
    pos = 0
    try:
        for _ in range(_MAX_FIELDS):
            if pos >= len(data):
                break
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                return ""
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                if pos + length > len(data):
                    return ""
                if number == JOB_FIELD:
                    job = bytes(data[pos:pos + length]).decode("utf-8")
                pos += length
            else:
                return ""  # groups (3, 4) and unknown wire types: not a PlanRequest
            if pos > len(data):
                return ""
        else:
            return ""
    except (ValueError, UnicodeDecodeError):
        return ""
    return job if JOB_NAME_PATTERN.match(job) else ""
