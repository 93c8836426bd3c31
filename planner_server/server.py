"""The planner server: gRPC (Plan, GetCapabilities, health, reflection), worker pool, metrics.

Life cycle: the probe port's health says NOT_SERVING while the workers import Megatron-Core and
plan a warm-up batch; the gRPC port is not bound until then, so a connection to a replica warming
up is refused by the kernel and gRPC's round-robin uses the other replicas, with no call sent to
this one (a container restarted in place keeps its address in the name). Then the port opens and
health says SERVING. On SIGTERM/SIGINT: health NOT_SERVING, new RPCs refused, in-flight ones get up
to `drain_seconds` to finish, then the workers stop and the process exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from batch_planner.exact.verified import UPSTREAM_OBJECTS, exact_path_status, select_implementation
from batch_planner.schedulers import discover_schedulers, megatron_core_version
from planner_server import __version__
from planner_server.config import ServerConfig
from planner_server.metrics import PlannerMetrics
from planner_server.rpc_limit import RpcLimit
from planner_server.servicer import SERVICE_NAME, PlannerServicer
from planner_server.worker_pool import InlineBound, PlanningPool

log = logging.getLogger(__name__)

# Health service names. Readiness is "" (and the BatchPlanner service): SERVING once warmed up,
# NOT_SERVING while warming up and draining. Liveness: SERVING for as long as the process answers
# at all - a draining pod is not dead.
LIVENESS_SERVICE = "liveness"


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not (config.tls_cert_file or config.tls_key_file):
        if config.tls_client_ca_file:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
    files = CertificateFiles(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    return grpc.dynamic_ssl_server_credentials(
        files.load(), files.reload_if_changed, require_client_authentication=bool(config.tls_client_ca_file)
    )


class CertificateFiles:
    """The server's certificate, key and client CA, read again when a file changes, so that a
    renewed certificate (cert-manager rewriting the mounted secret) is served without a restart.
    gRPC asks `reload_if_changed` before each new TLS handshake; a stat of three files is cheap."""

    def __init__(self, cert: str, key: str, client_ca: str):
        self.paths = [Path(p) for p in (cert, key, client_ca) if p]
        self.cert, self.key = Path(cert), Path(key)
        self.client_ca = Path(client_ca) if client_ca else None
        self._seen = self._versions()

    def _versions(self) -> tuple:
        # A Kubernetes secret volume swaps a symlink: stat follows it, so inode and mtime change.
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (p.stat() for p in self.paths))

    def load(self) -> grpc.ServerCertificateConfiguration:
        client_ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_certificate_configuration(
            [(self.key.read_bytes(), self.cert.read_bytes())], root_certificates=client_ca
        )

    def reload_if_changed(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            versions = self._versions()
            if versions == self._seen:
                return None
            configuration = self.load()
        except (OSError, ValueError) as exc:  # half-written files: keep serving the old ones
            log.warning("could not reload the TLS files (%s); serving the previous certificate", exc)
            return None
        self._seen = versions
        log.info("TLS certificate files changed; serving the new certificate to new connections")
        return configuration


def connection_age_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Trainers balance over the replicas a DNS name resolves to, and gRPC resolves it again only
    when a connection drops: closing each connection after --max-connection-age-seconds is what
    lets replicas the autoscaler adds receive traffic. A call in progress on a closing connection
    gets the default deadline to finish."""
    if config.max_connection_age_seconds <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
        ("grpc.max_connection_age_grace_ms", int(config.default_deadline_seconds * 1000)),
    ]


class PlannerServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = PlannerMetrics(max_job_labels=config.max_job_labels)
        self.health = health.HealthServicer()
        self.pool: PlanningPool | None = None
        self.grpc_server: grpc.Server | None = None
        self.servicer: PlannerServicer | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.probe_server: grpc.Server | None = None
        self.probe_port: int | None = None
        self._stopped = threading.Event()
        self._stopping = threading.Lock()  # held by the one drain; a second stop waits for it
        # Orders opening the port against the drain: a SIGTERM during the warm-up means the port never opens.
        self._lifecycle = threading.Lock()
        self._draining = False

    def start(self) -> None:
        config = self.config
        workers = config.worker_count
        select_implementation(config.scheduler_implementation)  # inline plans; workers get it too
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._start_probes()
        self.pool = PlanningPool(
            workers,
            config.max_queued_requests,
            config.limits,
            config.cost_model,
            config.log_level,
            on_restart=lambda reason: self.metrics.worker_restarts.labels(reason).inc(),
            inline=InlineBound(config.inline_max_samples, config.inline_max_ranks),
            log_format=config.log_format,
            max_job_share=config.max_job_share,
            scheduler_implementation=config.scheduler_implementation,
        )
        # The calls run at once: every request the pool admits, plus the ones it refuses at once,
        # health checks and capability calls. RpcLimit enforces it and counts its refusals (gRPC's
        # own maximum_concurrent_rpcs would refuse without telling us). Handler threads only wait on
        # workers; 16 more than the bound, so a refusal rarely waits for a thread.
        rpc_limit = RpcLimit(self.pool.capacity + config.extra_concurrent_rpcs, self.metrics.rpc_limit_rejections.inc)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=rpc_limit.limit + 16, thread_name_prefix="grpc"),
            interceptors=(rpc_limit,),
            options=[
                ("grpc.max_receive_message_length", config.max_receive_message_bytes),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
                *connection_age_options(config),
            ],
            # A backstop past our own limit: calls beyond it are refused by gRPC before they take a
            # handler thread (and are not counted), so a burst cannot queue without end.
            maximum_concurrent_rpcs=rpc_limit.limit + 16,
        )
        self.servicer = PlannerServicer(config, self.pool, self.metrics)
        self.metrics.track_pool(self.pool)
        self.grpc_server.add_generic_rpc_handlers((self.servicer.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        credentials = server_credentials(config)  # read now: a bad certificate fails before the warm-up
        self._start_metrics()
        log.info(
            "probes on %s (plaintext, health only), %d planning workers, warming up Megatron-Core %s; port %s (%s) "
            "opens once warm", self.probe_port, workers, megatron_core_version(), config.port,
            "TLS" if credentials else "plaintext",
        )
        self.pool.warm_up()
        available = [k.value for k, a in discover_schedulers().items() if a.available]
        for kind, availability in discover_schedulers().items():
            self.metrics.scheduler_available.labels(kind.value).set(1 if availability.available else 0)
            exact = exact_path_status(kind)
            self.metrics.scheduler_exact_path.labels(kind.value).set(1 if exact.active else 0)
            if availability.available and kind in UPSTREAM_OBJECTS:
                log.log(
                    logging.INFO if exact.active else logging.WARNING, "scheduler %s: %s", kind.value, exact.reason
                )
            if not availability.available:
                # Dynamic CP is the product's main path: an image without it still serves, loudly.
                log.warning(
                    "scheduler %s unavailable: %s (README: Megatron-Core with dynamic CP)", kind.value, availability.reason
                )
        self.metrics.build_info.info(
            {
                "version": __version__,
                "megatron_core_version": megatron_core_version(),
                "schedulers": ",".join(available),
            }
        )
        with self._lifecycle:
            if self._draining:
                return  # SIGTERM while warming up: the port never opens, the drain stops the rest
            self._open_port(credentials)
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "SERVING on port %s (metrics port %s); probe port %s; schedulers available: %s",
            self.port, self.metrics_port, self.probe_port, ", ".join(available) or "none",
        )

    def _open_port(self, credentials: grpc.ServerCredentials | None) -> None:
        """Binds the gRPC port and starts serving on it: only once warm, so that no call (nor any
        connection) reaches a replica that cannot plan yet."""
        address = f"{self.config.host}:{self.config.port}"
        if credentials is None:
            self.port = self.grpc_server.add_insecure_port(address)
        else:
            self.port = self.grpc_server.add_secure_port(address, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {address}")
        self.grpc_server.start()

    def _start_probes(self) -> None:
        """A plaintext listener with the health service only, for the kubelet's gRPC probes: they
        cannot speak TLS, and a TCP check passes long before the planner can plan."""
        if self.config.probe_port < 0:
            return
        self.probe_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="probe"))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.probe_server)
        address = f"{self.config.host}:{self.config.probe_port}"
        self.probe_port = self.probe_server.add_insecure_port(address)
        if self.probe_port == 0:
            raise RuntimeError(f"could not listen on {address} for probes")
        self.probe_server.start()

    def _start_metrics(self) -> None:
        if self.config.metrics_port < 0:
            return
        # The same interface as gRPC: --host 127.0.0.1 keeps /metrics off the network too.
        host = self.config.host.strip("[]")
        server, _ = start_http_server(self.config.metrics_port, addr=host, registry=self.metrics.registry)
        self.metrics_port = server.server_port

    def _set_health(self, status) -> None:
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)

    def stop(self, grace: float | None = None) -> None:
        """Drains: refuse new RPCs, let in-flight ones finish within the grace period, stop workers.
        Once: a stop while another drains (SIGTERM after Ctrl-C, say) waits for that drain to end."""
        if not self._stopping.acquire(blocking=False):
            self._stopped.wait()
            return
        try:
            self._drain(self.config.drain_seconds if grace is None else grace)
            log.info("stopped")
        finally:
            self._stopped.set()  # even after a failed drain: whoever waits on the server may exit

    def _drain(self, grace: float) -> None:
        log.info("draining: NOT_SERVING, in-flight requests get up to %.1f s", grace)
        deadline = time.monotonic() + grace
        with self._lifecycle:
            self._draining = True
            if self.servicer is not None:
                self.servicer.draining.set()
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Keep accepting while the admitted plans finish: a new Plan gets the servicer's clear
        # UNAVAILABLE ("retry on another replica"), which clients retry, rather than the
        # CANCELLED a stopping gRPC server gives calls that arrive during its grace period.
        while self.pool is not None and self.pool.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pool is not None and self.pool.in_flight > 0:
            log.warning("the drain's %.1f s are over with %d slots in flight; stopping their work", grace, self.pool.in_flight)
        if self.grpc_server is not None:
            self.grpc_server.stop(max(0.5, deadline - time.monotonic())).wait()
        if self.pool is not None:
            self.pool.shutdown()
        if self.probe_server is not None:
            self.probe_server.stop(0)

    def wait(self) -> None:
        # In slices: the kernel may hand SIGTERM/SIGINT to any thread (gRPC's, the pool's), and
        # Python runs its handler only when the main thread next runs bytecode; a main thread
        # blocked on a lock for good would never see a Ctrl-C or SIGTERM, and never drain.
        while not self._stopped.wait(_SIGNAL_CHECK_SECONDS):
            pass


# How often the waiting main thread returns to Python, so that a signal's handler runs (`wait`).
_SIGNAL_CHECK_SECONDS = 0.2
# Seconds past --drain-seconds after which a drain that has not finished ends the process anyway.
DRAIN_MARGIN_SECONDS = 3.0


def _exit_now(code: int) -> None:
    """Ends the process without waiting for other threads: a gRPC handler thread planning inline
    cannot be interrupted, and the interpreter's exit would wait for it without end."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


def serve(config: ServerConfig) -> None:
    """Runs the server until SIGTERM/SIGINT; the process then ends within --drain-seconds plus
    DRAIN_MARGIN_SECONDS whatever still runs (a plan stuck in a worker is killed by the drain; one
    stuck in a handler thread is left behind by ending the process)."""
    server = PlannerServer(config)

    def watchdog() -> None:
        time.sleep(config.drain_seconds + DRAIN_MARGIN_SECONDS)
        log.error("the drain did not finish within %.1f s (+%.1f s); exiting with planning still running",
                  config.drain_seconds, DRAIN_MARGIN_SECONDS)
        _exit_now(1)

    started = threading.Event()  # start() returned: the main thread goes on to wait() and exits

    def drain() -> None:
        server.stop()
        if not started.is_set():
            # SIGTERM during the warm-up: the port never opened, nothing was planned, but the main
            # thread is still in the warm-up (an import or a compile, which nothing interrupts).
            log.info("exiting during the warm-up")
            _exit_now(0)

    def on_signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=watchdog, name="drain-watchdog", daemon=True).start()
        threading.Thread(target=drain, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    started.set()
    server.wait()
    stuck = server.pool.inline_running if server.pool is not None else 0
    if stuck:
        # The interpreter's exit would join the handler thread, which never returns.
        log.warning("exiting with %d request(s) still planning inline in a handler thread", stuck)
        _exit_now(0)
