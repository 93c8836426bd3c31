"""planner_server/rpc_limit.py: at most `limit` calls at once, each refusal counted, and every
admitted call's count given back when its behaviour returns or raises. A real server past
--extra-concurrent-rpcs: tests/planner_server/test_planner_metrics.py."""

from __future__ import annotations

import grpc
import pytest

from planner_server.rpc_limit import REFUSAL, RpcLimit


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


def limit_of(limit: int):
    refused: list[int] = []
    interceptor = RpcLimit(limit, on_refused=lambda: refused.append(1))
    return interceptor, refused


def handler(behaviour):
    return grpc.unary_unary_rpc_method_handler(behaviour)


def test_calls_past_the_limit_are_refused_with_grpcs_own_words_and_counted():
    interceptor, refused = limit_of(1)
    first = interceptor.intercept_service(lambda details: handler(lambda request, context: "ok"), None)
    second = interceptor.intercept_service(lambda details: handler(lambda request, context: "ok"), None)
    assert interceptor.active == 1 and refused == [1]
    with pytest.raises(Aborted) as aborted:
        second.unary_unary(None, Context())
    assert aborted.value.args == (grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSAL)
    assert first.unary_unary(None, Context()) == "ok"
    assert interceptor.active == 0  # back once the behaviour returned


def test_a_call_that_raises_gives_its_slot_back_and_unknown_methods_pass_through():
    interceptor, refused = limit_of(1)

    def broken(request, context):
        raise ValueError("handler bug")

    call = interceptor.intercept_service(lambda details: handler(broken), None)
    with pytest.raises(ValueError):
        call.unary_unary(None, Context())
    assert interceptor.active == 0 and refused == []
    assert interceptor.intercept_service(lambda details: None, None) is None  # UNIMPLEMENTED, gRPC's answer


def test_a_streamed_response_holds_its_slot_until_it_ends():
    interceptor, _ = limit_of(1)
    call = interceptor.intercept_service(
        lambda details: grpc.unary_stream_rpc_method_handler(lambda request, context: iter([1, 2])), None)
    stream = call.unary_stream(None, Context())
    assert next(stream) == 1 and interceptor.active == 1
    assert list(stream) == [2] and interceptor.active == 0
