"""trainer_client/plan_source.py: an answer from the service that is not a readable PlanResponse
(bytes protobuf cannot parse, or columns that do not fit together) fails like the call: the step is
planned in-process and counted as `malformed_response`, or with fallback off raises
PlannerUnavailableError, which the broadcast hands to every rank; it is never raised on the asking
rank alone. The service is a stand-in of the test's own on loopback (`UnreadableAnswerPlanner`):
the real server never sends such bytes."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from batch_planner.convert import plan_to_proto
from batch_planner.planner import plan_batch
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.config import PlannerClientConfig
from trainer_client.metrics import TrainerMetrics
from trainer_client.plan_source import FALLBACK, MALFORMED_RESPONSE, PlannerUnavailableError, PlanSource

REQUEST = PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096, job="plan-source")


def _uneven_columns() -> bytes:
    message = plan_to_proto(plan_batch(REQUEST), columns=True)
    message.columns.first_ranks.append(0)
    return message.SerializeToString()


ANSWERS = {"not protobuf": b"\xff\xff\xff", "columns that do not fit together": _uneven_columns()}


class UnreadableAnswerPlanner:
    """A stand-in service on loopback whose Plan answers with the given bytes."""

    def __init__(self, answer: bytes):
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: answer)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("batch_planner.v1.BatchPlanner", {"Plan": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


@pytest.fixture(params=list(ANSWERS))
def unreadable(request):
    planner = UnreadableAnswerPlanner(ANSWERS[request.param])
    yield planner
    planner.server.stop(None)


def _source(planner: UnreadableAnswerPlanner, fallback: bool) -> PlanSource:
    config = PlannerClientConfig(planner_endpoint=f"127.0.0.1:{planner.port}", max_seqlen_per_dp_cp_rank=4096, context_parallel_size=2,
                                 job="plan-source", fallback=fallback)
    return PlanSource(config, TrainerMetrics(job="plan-source"))


def test_an_unreadable_answer_is_planned_in_process_and_counted(unreadable):
    source = _source(unreadable, fallback=True)
    try:
        sourced = source.plan(REQUEST)
        assert sourced.source == FALLBACK and sourced.plan == plan_batch(REQUEST)
        counted = source.metrics.registry.get_sample_value(
            "batch_planner_client_fallbacks_total", {"training_job": "plan-source", "reason": MALFORMED_RESPONSE},
        )
        assert counted == 1
    finally:
        source.close()


def test_with_fallback_off_an_unreadable_answer_raises_what_the_broadcast_hands_every_rank(unreadable):
    source = _source(unreadable, fallback=False)
    try:
        with pytest.raises(PlannerUnavailableError, match=r"malformed_response.*not a readable PlanResponse"):
            source.plan(REQUEST)
    finally:
        source.close()
