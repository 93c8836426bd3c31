"""Scale-out reaches running trainers: a replica started after a trainer connected
receives that trainer's requests, because the server closes connections at
--max-connection-age-seconds and the client then resolves the name again.

Two real planners on loopback, 127.0.0.1 and 127.0.0.2 on one port, behind a name served by a small
DNS server of the test's own that answers with the "ready pods" - first one, then both - as a
headless Service does.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from batch_planner.convert import request_to_proto
from batch_planner.request import PlanRequest
from tests.planner_process import start_planner
from tests.reliability_support import wait_until
from trainer_client.config import PlannerClientConfig
from trainer_client.metrics import TrainerMetrics
from trainer_client.rpc_client import PlannerRpcClient

REQUEST = request_to_proto(PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096))


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


def plans_served(server, host: str) -> float:
    url = f"http://{host}:{server.metrics_port}/metrics"  # /metrics listens on the server's --host
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == "batch_planner_requests_total" and s.labels.get("code") == "OK")


def test_a_replica_started_later_receives_requests_from_a_connected_client():
    age = ("--max-connection-age-seconds", "1")
    first = start_planner(*age, workers=1)
    dns = LoopbackDns(["127.0.0.1"])
    config = PlannerClientConfig(planner_endpoint=f"dns://127.0.0.1:{dns.port}/planners.test:{first.port}",
                                 max_seqlen_per_dp_cp_rank=4096, deadline_seconds=30.0)
    client = PlannerRpcClient(config, TrainerMetrics())
    second = None
    try:
        client.plan_bytes(REQUEST)
        assert plans_served(first, "127.0.0.1") == 1
        second = start_planner("--host", "127.0.0.2", *age, workers=1, port=first.port)
        dns.addresses = ["127.0.0.1", "127.0.0.2"]  # the new pod is ready: the headless name has it

        def reached_second() -> bool:
            client.plan_bytes(REQUEST)  # the trainer keeps planning steps
            return plans_served(second, "127.0.0.2") > 0

        wait_until(reached_second, 60, "a request of the connected client on the replica started later", poll=0.1)
    finally:
        client.close()
        dns.close()
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop(signal.SIGKILL)
