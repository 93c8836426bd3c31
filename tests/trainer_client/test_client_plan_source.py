"""trainer_client/service/plan_source.py: an answer from the service that is not a readable PlanResponse
(bytes protobuf cannot parse, columns that do not fit together) or whose plan cannot be applied to
the request's batch (another DPxCP size, groups that do not tile the ranks, a sample missing, twice
or out of range) fails like the call: the step is planned in-process and counted as
`malformed_response`, or with fallback off raises PlannerUnavailableError, which the broadcast hands
to every rank; it never reaches `apply`, where one rank would fail alone or a sample go untrained.
The service is a stand-in of the test's own on loopback (`UnreadableAnswerPlanner`): the real
server never sends such answers. An older server (`PredatesPrecisionPlanner`: the real planning path
without the fields it does not know) answers an FP8 request with a bf16 plan: planned in-process too."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from batch_planner.convert import plan_to_proto
from batch_planner.planner import plan_batch
from batch_planner.precision import Precision
from batch_planner.request import PlanRequest
from batch_planner.v1 import planner_pb2 as pb
from trainer_client.service.config import PlannerClientConfig
from trainer_client.service.metrics import TrainerMetrics
from trainer_client.service.plan_source import FALLBACK, MALFORMED_RESPONSE, SERVICE, PlannerUnavailableError, PlanSource

REQUEST = PlanRequest.of((4096, 2048, 1024, 512, 512, 256, 128, 64), 4, 2, 4096, job="plan-source")


def _answer(change) -> bytes:
    """The real plan of REQUEST in the columns form, with `change(message)` applied."""
    message = plan_to_proto(plan_batch(REQUEST), columns=True)
    change(message)
    return message.SerializeToString()


def _set(column: str, index: int, value):
    def change(message):
        getattr(message.columns, column)[index] = value if not callable(value) else value(message.columns)
    return change


def _dp_cp_size(message):
    message.dp_cp_size = 16


ANSWERS = {
    "not protobuf": b"\xff\xff\xff",
    "columns that do not fit together": _answer(lambda m: m.columns.first_ranks.append(0)),
    "a sample id past the batch": _answer(_set("sample_ids", -1, 99)),
    "a sample twice, another missing": _answer(_set("sample_ids", -1, lambda c: c.sample_ids[0])),
    "a group at a rank that is not its own": _answer(_set("first_ranks", -1, lambda c: c.first_ranks[-1] + 1)),
    "a group of size 0": _answer(_set("sizes", -1, 0)),
    "a group over every rank": _answer(_set("sizes", 0, 8)),
    "another DPxCP size": _answer(_dp_cp_size),
    # A plan padded otherwise than the request asked (a server that predates an option answers without it).
    "another padding rule": _answer(lambda m: setattr(m, "padding", pb.PADDING_RULE_VERL)),
    "an unknown padding rule": _answer(lambda m: setattr(m, "padding", 9)),
    "another layout": _answer(lambda m: setattr(m, "cp_layout", pb.CP_LAYOUT_CONTIGUOUS)),
    "a top-up not asked for": _answer(lambda m: setattr(m, "min_local_rows", 64)),
}


class UnreadableAnswerPlanner:
    """A stand-in service on loopback whose Plan answers every call with the given bytes."""

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
        with pytest.raises(PlannerUnavailableError, match=r"malformed_response.*(not a readable PlanResponse|cannot be applied to this batch|plan pads for)"):
            source.plan(REQUEST)
    finally:
        source.close()


def test_the_real_plans_answer_from_the_same_stand_in_is_used_as_sent():
    planner = UnreadableAnswerPlanner(_answer(lambda message: None))
    source = _source(planner, fallback=True)
    try:
        sourced = source.plan(REQUEST)
        assert sourced.source == SERVICE and sourced.plan == plan_batch(REQUEST)
    finally:
        source.close()
        planner.server.stop(None)


class PredatesPrecisionPlanner:
    """A server on loopback that predates `precision` and `sequence_parallel`: the real planning path
    (planner_server/planning_worker.py's plan_request_bytes: parse, plan_batch, the response) run on
    the request as an older server reads it, the fields it does not know dropped (protobuf keeps them
    as unknown fields, which an older server never reads), and answered without them."""

    def __init__(self):
        import time

        from planner_server.config import ServerConfig
        from planner_server.planning_worker import plan_request_bytes

        config = ServerConfig()
        self.asked: list[pb.PlanRequest] = []

        def plan(request_bytes, context):
            self.asked.append(pb.PlanRequest.FromString(request_bytes))
            message = pb.PlanRequest.FromString(request_bytes)
            message.ClearField("precision")
            message.ClearField("sequence_parallel")
            result = plan_request_bytes(message.SerializeToString(), time.time() + 30, config.limits, config.cost_model)
            answer = pb.PlanResponse.FromString(result.response)
            answer.ClearField("precision")
            answer.ClearField("sequence_parallel")
            return answer.SerializeToString()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.unary_unary_rpc_method_handler(plan)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("batch_planner.v1.BatchPlanner", {"Plan": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


@pytest.fixture
def predates_precision():
    planner = PredatesPrecisionPlanner()
    yield planner
    planner.server.stop(None)


FP8_REQUEST = PlanRequest.of((4095, 2047, 1023, 511, 509, 255, 127, 63), 4, 2, 4096, job="plan-source", precision=Precision.FP8_DELAYED,
                             tensor_parallel_size=2)


def test_a_server_that_predates_precision_gets_an_fp8_step_planned_in_process_and_counted(predates_precision):
    source = _source(predates_precision, fallback=True)
    try:
        sourced = source.plan(FP8_REQUEST)
        assert predates_precision.asked and predates_precision.asked[0].precision == pb.PRECISION_FP8_DELAYED  # it was asked
        assert sourced.source == FALLBACK and sourced.plan == plan_batch(FP8_REQUEST)
        assert sourced.plan.precision is Precision.FP8_DELAYED and sourced.plan.statistics.alignment_padding_tokens > 0
        counted = source.metrics.registry.get_sample_value(
            "batch_planner_client_fallbacks_total", {"training_job": "plan-source", "reason": MALFORMED_RESPONSE},
        )
        assert counted == 1
    finally:
        source.close()


def test_with_fallback_off_a_server_that_predates_precision_raises_naming_the_precision(predates_precision):
    source = _source(predates_precision, fallback=False)
    try:
        with pytest.raises(PlannerUnavailableError, match=r"malformed_response.*plan pads for .*precision.*bf16.*fp8_delayed"):
            source.plan(FP8_REQUEST)
    finally:
        source.close()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_server_that_predates_precision_serves_bf16_steps_as_before(predates_precision, sequence_parallel):
    """Its plan reads back as bf16 with sequence parallelism (the fields' defaults), which pads as a bf16
    request does whatever its sequence parallelism: used as sent."""
    request = PlanRequest.of(REQUEST.sequence_lengths, 4, 2, 4096, job="plan-source", sequence_parallel=sequence_parallel)
    source = _source(predates_precision, fallback=False)
    try:
        sourced = source.plan(request)
        assert sourced.source == SERVICE and sourced.plan.precision is Precision.BF16 and sourced.plan.sequence_parallel is True
        assert sourced.plan.micro_batches == plan_batch(request).micro_batches
    finally:
        source.close()
