"""TLS and mutual TLS for the planner server.

Certificates are made in the test, in a temporary directory (tests/support/reliability_support.py); no key
is ever written into the repository. Two real servers on loopback: one with TLS, one with mutual
TLS (--tls-client-ca-file). Plaintext is served only when no TLS flag is given.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from batch_planner.v1 import planner_pb2 as pb
from batch_planner.v1 import planner_pb2_grpc
from tests.support.planner_process import ROOT, planner_env, start_planner
from tests.support.reliability_support import Pki, health_status, make_test_pki, wait_until

REQUEST = pb.PlanRequest(
    sequence_lengths=[4096, 2048, 1024, 512] * 4,
    layout=pb.ParallelLayout(data_parallel_size=4, context_parallel_size=2),
    max_seqlen_per_dp_cp_rank=4096,
    scheduler=pb.SCHEDULER_HYBRID_CP,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(pki):
    tls_flags = ("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key))
    with ThreadPoolExecutor(2) as pool:  # start both at once: most of a start is importing
        tls = pool.submit(start_planner, *tls_flags, workers=1)
        mtls = pool.submit(start_planner, *tls_flags, "--tls-client-ca-file", str(pki.ca_cert), workers=1)
        started = {"tls": tls.result(), "mtls": mtls.result()}
    yield started
    for server in started.values():
        server.stop(signal.SIGKILL)


def secure_channel(address: str, pki: Pki, cert: str | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.read("ca_cert"),
        private_key=pki.read(f"{cert}_key") if cert else None,
        certificate_chain=pki.read(f"{cert}_cert") if cert else None,
    )
    return grpc.secure_channel(address, credentials)


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        planner_pb2_grpc.BatchPlannerStub(channel).Plan(REQUEST, timeout=5)
    return caught.value.code()


def test_tls_server_refuses_a_plaintext_client(servers):
    with grpc.insecure_channel(servers["tls"].address) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    assert "(TLS)" in servers["tls"].log


def test_tls_client_that_trusts_the_ca_gets_a_plan(servers, pki):
    with secure_channel(servers["tls"].address, pki) as channel:
        assert health_status(channel) == "SERVING"
        response = planner_pb2_grpc.BatchPlannerStub(channel).Plan(REQUEST, timeout=60)
    assert response.dp_cp_size == 8 and response.micro_batches


def test_mtls_server_refuses_a_client_without_a_certificate(servers, pki):
    with secure_channel(servers["mtls"].address, pki) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(servers["mtls"].address) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_mtls_server_refuses_a_certificate_from_another_ca(servers, pki):
    with secure_channel(servers["mtls"].address, pki, cert="stranger") as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_mtls_server_accepts_a_client_certificate_signed_by_its_ca(servers, pki):
    with secure_channel(servers["mtls"].address, pki, cert="client") as channel:
        assert health_status(channel) == "SERVING"
        response = planner_pb2_grpc.BatchPlannerStub(channel).Plan(REQUEST, timeout=60)
    assert response.dp_cp_size == 8 and response.micro_batches


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tls-cert-file", "CERT"], "needs both"),
        (["--tls-key-file", "KEY"], "needs both"),
        (["--tls-client-ca-file", "CA"], "needs --tls-cert-file"),
    ],
    ids=["cert-without-key", "key-without-cert", "client-ca-without-server-cert"],
)
def test_half_configured_tls_refuses_to_start_instead_of_serving_plaintext(pki, flags, words):
    paths = {"CERT": str(pki.server_cert), "KEY": str(pki.server_key), "CA": str(pki.ca_cert)}
    cmd = [sys.executable, "-m", "planner_server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
           "--workers", "1", *[paths.get(f, f) for f in flags]]
    done = subprocess.run(cmd, cwd=ROOT, env=planner_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr and "SERVING" not in done.stderr


# --- the trainer client's TLS setting against the server's ----------------------------

def plan_source(address: str, **settings):
    from trainer_client.service.config import PlannerClientConfig
    from trainer_client.service.metrics import TrainerMetrics
    from trainer_client.service.plan_source import PlanSource

    config = PlannerClientConfig(planner_endpoint=address, max_seqlen_per_dp_cp_rank=4096, **settings)
    return PlanSource(config, TrainerMetrics())


def small_request():
    from batch_planner.request import PlanRequest

    return PlanRequest.of(tuple(REQUEST.sequence_lengths), 4, 2, 4096)


def test_a_client_with_only_the_endpoint_set_uses_the_charts_default_plaintext_server(planner):
    """The client's default and the chart's agree: no silent fallback for every step."""
    source = plan_source(planner.address)
    try:
        assert source.plan(small_request()).source == "service"
    finally:
        source.close()


def test_a_tls_client_against_a_plaintext_server_raises_with_the_fix(planner, pki):
    from trainer_client.service.rpc_client import TlsMismatchError

    source = plan_source(planner.address, tls=True, tls_ca_file=str(pki.ca_cert))
    try:
        with pytest.raises(TlsMismatchError, match="tls: false"):
            source.plan(small_request())
    finally:
        source.close()


def test_a_plaintext_client_against_a_tls_server_raises_with_the_fix(servers):
    from trainer_client.service.rpc_client import TlsMismatchError

    source = plan_source(servers["tls"].address)
    try:
        with pytest.raises(TlsMismatchError, match="tls: true"):
            source.plan(small_request())
    finally:
        source.close()
    assert source.metrics.registry.get_sample_value(
        "batch_planner_client_plans_total", {"training_job": "unnamed", "source": "fallback"}
    ) is None


def test_a_tls_client_that_trusts_the_ca_plans_through_the_service(servers, pki):
    source = plan_source(servers["tls"].address, tls=True, tls_ca_file=str(pki.ca_cert))
    try:
        assert source.plan(small_request()).source == "service"
    finally:
        source.close()


# --- probes and certificate rotation ----------------------------------------------------

def probe_status(port: int, service: str = "") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_status(channel, service)


def test_a_tls_server_answers_plaintext_probes_on_its_probe_port_and_nothing_else(servers):
    server = servers["tls"]
    assert probe_status(server.probe_port) == "SERVING"
    assert probe_status(server.probe_port, "liveness") == "SERVING"
    with grpc.insecure_channel(f"127.0.0.1:{server.probe_port}") as channel:
        assert refused(channel) == grpc.StatusCode.UNIMPLEMENTED  # no planning in plaintext


def test_readiness_passes_only_once_the_server_is_serving(pki):
    """The probe is truthful: while the workers warm up, readiness says NOT_SERVING (a TCP check
    passed seconds earlier), liveness SERVING."""
    import os
    import re
    import threading

    cmd = [sys.executable, "-m", "planner_server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
           "--probe-port", "0", "--workers", "1", "--tls-cert-file", str(pki.server_cert),
           "--tls-key-file", str(pki.server_key)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=planner_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        probe = wait_until(lambda: next((int(m.group(1)) for line in list(lines)
                                         if (m := re.search(r"probes on (\d+)", line))), None), 120, "the probe port")
        seen = []
        while not seen or seen[-1][0] != "SERVING":
            try:
                status = probe_status(probe)
            except grpc.RpcError as error:
                # A probe unanswered within its timeout fails, as the kubelet's does: on a busy
                # machine the warm-up's imports and compiles hold the GIL for seconds at a time.
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                status = "timed out"
            seen.append((status, any("SERVING on port" in line for line in list(lines))))
        # Whenever readiness said SERVING, the server had already said so itself.
        assert all(logged for status, logged in seen if status == "SERVING"), seen
        assert probe_status(probe, "liveness") == "SERVING"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the server, its forkserver and workers (its own session)
        proc.wait(30)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    import os
    import shutil

    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first, second = make_test_pki(tmp_path / "first"), make_test_pki(tmp_path / "second")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.server_cert, cert)
    shutil.copy(first.server_key, key)
    server = start_planner("--tls-cert-file", str(cert), "--tls-key-file", str(key), workers=1)
    try:
        with secure_channel(server.address, first) as channel:
            assert health_status(channel) == "SERVING"
        # What a secret volume update does: new files appear in place, each in one step.
        for source, target in ((second.server_key, key), (second.server_cert, cert)):
            shutil.copy(source, str(target) + ".new")
            os.replace(str(target) + ".new", target)
        with secure_channel(server.address, second) as channel:
            assert health_status(channel) == "SERVING"
            response = planner_pb2_grpc.BatchPlannerStub(channel).Plan(REQUEST, timeout=60)
        assert response.micro_batches
        assert "TLS certificate files changed" in server.log
    finally:
        server.stop(signal.SIGKILL)
