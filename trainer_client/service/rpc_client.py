"""The gRPC side of the client: one channel, Plan with a deadline, retries by gRPC itself (the
channel's `retryPolicy`, on the codes `batch_planner.errors.CLIENT_ACTION` marks RETRY), and one more
call to another replica when a call stalls or fails (`_Failover`: at most two calls per plan, the
first answer wins). docs/trainer-client.md, "Faults", is what each failure leads to.
"""

from __future__ import annotations

import json
import queue
from collections import deque
import socket
import ssl
import time
from pathlib import Path

import grpc

from batch_planner.convert import JOB_METADATA_KEY
from batch_planner.errors import CLIENT_ACTION, ClientAction, ErrorCode
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.service.config import PlannerClientConfig, endpoint_target
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.errors import ConfigError, PlanRejectedError, ServiceFailedError, TlsMismatchError


class PlannerRpcClient:
    def __init__(self, config: PlannerClientConfig, metrics: TrainerMetrics):
        if not config.planner_endpoint:
            raise ConfigError("planner_endpoint is empty: there is no service to call")
        self.config = config
        self.metrics = metrics
        self._channel = make_channel(config)
        # The latencies of the last answered calls: a call is stalled only past twice the slowest.
        self.recent_latencies: deque[float] = deque(maxlen=RECENT_CALLS)
        # Whether some replica is connected (round-robin's channel is READY while any one is).
        self._connectivity = grpc.ChannelConnectivity.IDLE
        self._channel.subscribe(self._on_connectivity, try_to_connect=True)
        # Plan's answer as the bytes the server sent: rank 0 broadcasts them to its group as they are.
        self._plan = self._channel.unary_unary(
            f"/{pb.DESCRIPTOR.services_by_name['BatchPlanner'].full_name}/Plan", request_serializer=pb.PlanRequest.SerializeToString,
        )

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        self._connectivity = state

    def close(self) -> None:
        self._channel.unsubscribe(self._on_connectivity)
        self._channel.close()

    def plan_bytes(self, request: pb.PlanRequest) -> bytes:
        """Calls Plan and returns the serialized PlanResponse; raises PlanRejectedError or
        ServiceFailedError. The job name travels as metadata too, so that the server admits the
        call without parsing it."""
        metadata = ((JOB_METADATA_KEY, request.job),) if request.job else None
        started = time.perf_counter()
        try:
            return _Failover(self, request, metadata).run()
        finally:
            self.metrics.rpc_latency.labels(self.metrics.job).observe(time.perf_counter() - started)


RECENT_CALLS = 20  # answered calls whose latency sets when a call counts as stalled


def hedge_delay(hedge_after_seconds: float, recent_latencies) -> float | None:
    """How long a call may go unanswered before it is sent again: `hedge_after_seconds`, or twice
    the slowest of the recent answered calls if longer (a job whose plans take seconds is not
    planned twice); None: never (hedging off)."""
    if hedge_after_seconds <= 0:
        return None
    return max([hedge_after_seconds, *(2 * seconds for seconds in list(recent_latencies))])


class _Failover:
    """One plan: a first call; a second to the next replica when the first has not answered after
    `hedge_delay` or failed with a RETRY code; the first answer wins, the other call is cancelled.
    Both calls end by the plan's deadline."""

    CALLS = 2  # at most, per plan: a bounded hedge

    def __init__(self, client: PlannerRpcClient, request: pb.PlanRequest, metadata):
        self.client, self.request, self.metadata = client, request, metadata
        self.end = time.monotonic() + client.config.deadline_seconds
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.calls: list[grpc.Future] = []
        self.started: dict[int, float] = {}  # by id(call): when it was sent
        self.failures: list[grpc.RpcError] = []

    def run(self) -> bytes:
        hedge = hedge_delay(self.client.config.hedge_after_seconds, self.client.recent_latencies)
        hedge_at = None if hedge is None else time.monotonic() + hedge
        self._call()
        while True:
            can_hedge = hedge_at is not None and len(self.calls) < self.CALLS
            try:
                call = self.done.get(timeout=max(0.0, hedge_at - time.monotonic()) if can_hedge else None)
            except queue.Empty:  # the first call is still out: stalled
                hedge_at = None
                self._call_again("stalled")
                continue
            error = call.exception()
            if error is None:
                self._cancel_others(call)
                self.client.recent_latencies.append(time.monotonic() - self.started[id(call)])
                return call.result()
            self._failed(error)
            if client_action(error.code()) is ClientAction.RETRY and len(self.calls) < self.CALLS:
                hedge_at = None
                self._call_again(error.code().name.lower())
            if len(self.failures) == len(self.calls):  # every call sent has failed (a call done but not yet taken from
                raise self._service_failed() from None  # the queue may have answered: it is read next)

    def _call(self) -> None:
        sent = time.monotonic()
        call = self.client._plan.future(self.request, timeout=max(0.001, self.end - sent), metadata=self.metadata)
        self.started[id(call)] = sent
        self.calls.append(call)
        call.add_done_callback(self.done.put)

    def _call_again(self, reason: str) -> None:
        if self.end - time.monotonic() <= 0:
            return
        metrics = self.client.metrics
        metrics.failovers.labels(metrics.job, reason).inc()
        self._call()

    def _failed(self, error: grpc.RpcError) -> None:
        _raise_on_tls_mismatch(self.client.config, error)
        if client_action(error.code()) is ClientAction.REJECT:
            self._cancel_others(None)
            raise PlanRejectedError(error.code().name, error.details() or "") from None
        self.failures.append(error)

    def _cancel_others(self, winner) -> None:
        for call in self.calls:
            if call is not winner:
                call.cancel()

    def _service_failed(self) -> ServiceFailedError:
        """The last failure; the whole service's when no replica is connected, both calls failed, or
        its code is one every replica would answer (not RETRY)."""
        error = self.failures[-1]
        connected = self.client._connectivity is grpc.ChannelConnectivity.READY
        retryable = client_action(error.code()) is ClientAction.RETRY
        whole = len(self.failures) >= self.CALLS or not connected or not retryable
        metrics = self.client.metrics
        metrics.service_failures.labels(metrics.job, "service" if whole else "replica").inc()
        return ServiceFailedError(error.code().name.lower(), error.details() or "", whole_service=whole)


def client_action(code: grpc.StatusCode) -> ClientAction:
    try:
        return CLIENT_ACTION.get(ErrorCode(code.name), ClientAction.FALLBACK)
    except ValueError:
        return ClientAction.FALLBACK


def _raise_on_tls_mismatch(config: PlannerClientConfig, error: grpc.RpcError) -> None:
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return
    details = error.details() or ""
    endpoint = config.planner_endpoint
    if config.tls and "WRONG_VERSION_NUMBER" in details:
        raise TlsMismatchError(
            f"tls: true, but the planner at {endpoint} answers in plaintext; set tls: false (the chart's "
            "default), or give the server a certificate (chart: tls.enabled) - the handshake failed: " + details
        )
    if config.tls and "CERTIFICATE_VERIFY_FAILED" in details:
        raise TlsMismatchError(
            f"the planner at {endpoint} presents a certificate tls_ca_file ({config.tls_ca_file or 'system roots'}) "
            "does not trust, or for another name (tls_server_name_override); fix either - " + details
        )
    if not config.tls and "Socket closed" in details and speaks_tls(endpoint):
        raise TlsMismatchError(
            f"tls: false, but the planner at {endpoint} requires TLS; set tls: true and tls_ca_file to the CA "
            "that signed its certificate (plus tls_cert_file/tls_key_file for mutual TLS)"
        )


def speaks_tls(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether the server at `endpoint` answers a TLS handshake: tells a TLS server that closed a
    plaintext connection from one that is going away."""
    host, _, port = endpoint_target(endpoint).rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw):
                return True
    except ssl.SSLError as exc:
        return "WRONG_VERSION_NUMBER" not in str(exc)  # e.g. a client certificate required: still TLS
    except (OSError, ValueError):
        return False


def service_config(config: PlannerClientConfig) -> dict:
    """gRPC's service config: round-robin over every replica behind a dns:/// name (not just the
    first address), and Plan retried by gRPC on the codes CLIENT_ACTION marks RETRY, with
    exponential backoff and jitter."""
    plan = {"name": [{"service": pb.DESCRIPTOR.services_by_name["BatchPlanner"].full_name, "method": "Plan"}]}
    if config.max_attempts > 1:  # gRPC refuses a retryPolicy of one attempt
        plan["retryPolicy"] = {
            "maxAttempts": config.max_attempts,  # 2..5: gRPC's cap, which the config enforces
            "initialBackoff": _duration(config.initial_backoff_seconds),
            "maxBackoff": _duration(config.max_backoff_seconds),
            "backoffMultiplier": config.backoff_multiplier,
            "retryableStatusCodes": sorted(code.value for code, action in CLIENT_ACTION.items() if action is ClientAction.RETRY),
        }
    return {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [plan]}


def _duration(seconds: float) -> str:
    return f"{max(seconds, 0.001):.9f}s"  # gRPC wants a backoff > 0: 0 is read as 1 ms


def make_channel(config: PlannerClientConfig) -> grpc.Channel:
    """A channel to `planner_endpoint`: gRPC's retries, quick reconnects, TLS when `tls` is on."""
    reconnect_ms = int(config.max_reconnect_backoff_seconds * 1000)
    options = [
        ("grpc.service_config", json.dumps(service_config(config))),
        # gRPC retries a call only while its request fits the retry buffer (256 KiB by default).
        ("grpc.per_rpc_retry_buffer_size", 64 * 1024 * 1024),
        # A planner that restarts is used again within about a second, not after gRPC's default
        # reconnect backoff of up to two minutes. Not grpc.min_reconnect_backoff_ms: despite its name
        # it is the least time gRPC gives one connection attempt (20 s by default); at 100 ms a server
        # that sends its first HTTP/2 frame later, as one on a busy machine does, is never reached.
        ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_ms)),
        ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        # When the server closes a connection at its maximum age, the name is resolved again at
        # once (gRPC's default waits up to 30 s between resolutions), so new replicas show up.
        ("grpc.dns_min_time_between_resolutions_ms", 1000),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ]
    if not config.tls:
        return grpc.insecure_channel(config.planner_endpoint, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca_file),
        private_key=_read(config.tls_key_file),
        certificate_chain=_read(config.tls_cert_file),
    )
    if config.tls_server_name_override:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name_override))
    return grpc.secure_channel(config.planner_endpoint, credentials, options=options)


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None
