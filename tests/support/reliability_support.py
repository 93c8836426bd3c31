"""Shared pieces of the reliability tests: an independent plan check, health, process tree and
resident memory of a server, certificates for TLS tests. Linux only (/proc)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batch_planner.v1 import planner_pb2 as pb

PLAN_METHOD = "/batch_planner.v1.BatchPlanner/Plan"


def raw_plan_method(channel: grpc.Channel):
    """The Plan method with bytes in and bytes out: lets a test send any bytes at all."""
    return channel.unary_unary(PLAN_METHOD, request_serializer=None, response_deserializer=None)


# --- an independent check of a plan, written from docs/design.md (not from batch_planner.plan) --


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def assert_plan_well_formed(response: pb.PlanResponse, lengths: list[int], dp_cp: int) -> None:
    """Plan invariants 1-3 (docs/design.md, Plan invariants), checked on the wire format the trainer receives."""
    assert response.dp_cp_size == dp_cp
    assert len(response.micro_batches) >= 1
    seen: Counter[int] = Counter()
    for mb_index, micro_batch in enumerate(response.micro_batches):
        owner = [-1] * dp_cp  # rank -> index of its group in this micro-batch
        for g_index, group in enumerate(micro_batch.cp_groups):
            where = f"micro-batch {mb_index} group {g_index} (first rank {group.first_rank}, size {group.size})"
            # Megatron-Core builds power-of-two groups and the whole DPxCP group (24 ranks: 1-8, 24).
            assert _is_power_of_two(group.size) or group.size == dp_cp, f"{where}: size is not a power of two"
            assert group.size == dp_cp or group.size < 2 ** (dp_cp.bit_length() - 1), f"{where}: no such group is built"
            assert group.first_rank % group.size == 0, f"{where}: not aligned to its size"
            assert group.first_rank + group.size <= dp_cp, f"{where}: runs past rank {dp_cp - 1}"
            assert len(group.sample_ids) >= 1, f"{where}: idle ranks"
            for rank in range(group.first_rank, group.first_rank + group.size):
                assert owner[rank] == -1, f"{where}: rank {rank} is already in group {owner[rank]}"
                owner[rank] = g_index
            seen.update(group.sample_ids)
            assert group.real_tokens == sum(lengths[i] for i in group.sample_ids), where
        assert -1 not in owner, f"micro-batch {mb_index}: rank {owner.index(-1)} is in no group"
    assert sorted(seen) == list(range(len(lengths))), "every sample must appear exactly once"
    assert response.statistics.real_tokens == sum(lengths)
    assert response.statistics.micro_batch_count == len(response.micro_batches)


# --- health ---------------------------------------------------------------------------------------


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 5.0) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# --- process tree and resident memory, from /proc ---------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(int(entry.name))[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
    return sorted(found)


def descendants(pid: int) -> list[int]:
    result, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            result.append(child)
            todo.append(child)
    return result


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def planning_worker_pids(server_pid: int) -> list[int]:
    """The planning worker processes of a server.

    The server's direct children are the forkserver and the resource tracker; the workers are
    forked by the forkserver, so they are the forkserver's children.
    """
    forkservers = [c for c in children(server_pid) if "forkserver" in _cmdline(c)]
    return sorted(w for f in forkservers for w in children(f))


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a server and all its processes (workers, forkserver, tracker)."""
    return rss_bytes(pid) + sum(rss_bytes(child) for child in descendants(pid))


# --- certificates, made in the test (never committed) ---------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate signed by another CA
    stranger_key: Path

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def make_test_pki(directory: Path) -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1, a client certificate it signed, and a
    client certificate signed by an unrelated CA. Keys are EC P-256 and live only in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def certificate(subject, key, issuer, issuer_key, *, ca: bool, sans=None, usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(path: Path, cert=None, key=None) -> Path:
        if cert is not None:
            path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            path.chmod(0o600)
        return path

    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("planner test CA", ca_key, "planner test CA", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = certificate(
        "localhost", server_key, "planner test CA", ca_key, ca=False,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = certificate("trainer", client_key, "planner test CA", ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = certificate("stranger", stranger_key, "other CA", other_ca_key, ca=False,
                           usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        ca_cert=write(directory / "ca.pem", cert=ca),
        server_cert=write(directory / "server.pem", cert=server),
        server_key=write(directory / "server.key", key=server_key),
        client_cert=write(directory / "client.pem", cert=client),
        client_key=write(directory / "client.key", key=client_key),
        stranger_cert=write(directory / "stranger.pem", cert=stranger),
        stranger_key=write(directory / "stranger.key", key=stranger_key),
    )


def forkserver_pid(server_pid: int) -> int:
    """The server's forkserver (the parent of its planning workers)."""
    found = [c for c in children(server_pid) if "forkserver" in _cmdline(c)]
    assert len(found) == 1, f"expected one forkserver under {server_pid}, found {found}"
    return found[0]


# --- a headless Service's name, on loopback ----------------------------------------------------------


class LoopbackDns:
    """Answers every A query with `addresses` (TTL 0), other queries with no answer."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
                self.sock.sendto(self._answer(query), peer)
            except (OSError, IndexError, struct.error):
                if self.sock.fileno() < 0:
                    return

    def _answer(self, query: bytes) -> bytes:
        end = 12  # the question's name: length-prefixed labels up to a zero byte
        while query[end]:
            end += query[end] + 1
        (qtype,) = struct.unpack("!H", query[end + 1:end + 3])
        answers = list(self.addresses) if qtype == 1 else []
        header = struct.pack("!HHHHHH", struct.unpack("!H", query[:2])[0], 0x8180, 1, len(answers), 0, 0)
        records = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(a) for a in answers)
        return header + query[12:end + 5] + records

    def close(self) -> None:
        self.sock.close()


# --- waiting on what a server shows, never on a guessed duration ------------------------------------


def wait_until(predicate, timeout: float, what: str, poll: float = 0.02):
    """Polls `predicate` until it returns a true value (returned) or `timeout` passes (fails)."""
    import time

    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


# --- the server's metrics ---------------------------------------------------------------------------


def metric(server, name: str, **labels: str) -> float:
    """The sum of a metric's samples with these labels on a PlannerProcess's /metrics page."""
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return sample_value(response.read().decode(), name, **labels)


def sample_value(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples with these labels in a Prometheus exposition page."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for_metric(server, name: str, check, what: str, timeout: float = 30.0, **labels) -> float:
    def ready():
        value = metric(server, name, **labels)
        return (value,) if check(value) else None

    return wait_until(ready, timeout, what)[0]


# --- what a trainer client counts -------------------------------------------------------------------


def client_counts(metrics) -> dict[str, int]:
    """A trainer client's (its TrainerMetrics) plans from the service, and its Plan calls sent again
    within a plan: hedged after a stall (a busy machine's slow answer) or failed over, at most one a
    plan (trainer_client/service/rpc_client.py). The server may answer both calls of such a plan before the
    client cancels the other, so it can count up to `sent_again` requests more than plans."""
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {
        "service_plans": int(sample_value(text, "batch_planner_client_plans_total", source="service")),
        "sent_again": int(sample_value(text, "batch_planner_client_failovers_total")),
    }


def assert_requests_of_plans(requests: float, plans: int, sent_again: int) -> None:
    """The server answered `requests` Plan requests for the clients' `plans` plans: one each, plus at
    most one for each call a client sent again (client_counts). Exactly one each where none was."""
    assert plans <= requests <= plans + sent_again, f"{requests} requests answered for {plans} plans, {sent_again} calls sent again"


