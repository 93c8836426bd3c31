"""Scale-out reaches running trainers: a replica started after a trainer connected
receives that trainer's requests, because the server closes connections at
--max-connection-age-seconds and the client then resolves the name again.

Two real planners on loopback, 127.0.0.1 and 127.0.0.2 on one port, behind a name served by a small
DNS server of the test's own that answers with the "ready pods" - first one, then both - as a
headless Service does.
"""

from __future__ import annotations

import signal

from batch_planner.convert import request_to_proto
from batch_planner.request import PlanRequest
from tests.support.planner_process import start_planner
from tests.support.reliability_support import LoopbackDns, metric, wait_until
from trainer_client.service.config import PlannerClientConfig
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.service.rpc_client import PlannerRpcClient

REQUEST = request_to_proto(PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096))


def plans_served(server) -> float:
    return metric(server, "batch_planner_requests_total", code="OK")  # /metrics on the server's --host


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
        assert plans_served(first) == 1
        second = start_planner("--host", "127.0.0.2", *age, workers=1, port=first.port)
        dns.addresses = ["127.0.0.1", "127.0.0.2"]  # the new pod is ready: the headless name has it

        def reached_second() -> bool:
            client.plan_bytes(REQUEST)  # the trainer keeps planning steps
            return plans_served(second) > 0

        wait_until(reached_second, 60, "a request of the connected client on the replica started later", poll=0.1)
    finally:
        client.close()
        dns.close()
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop(signal.SIGKILL)
