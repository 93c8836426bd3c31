"""The bound on calls the server runs at once, enforced and counted with public gRPC API only;
gRPC's own `maximum_concurrent_rpcs` is a backstop past it (docs/reliability.md).
- gRPC runs interceptors in its one polling thread, one call at a time, as it looks up a handler.
- A call is counted from then until its behaviour returns (a streamed response: until it ends).
  When gRPC never runs the behaviour (the caller cancelled before its message arrived, a message
  that does not deserialize), the count comes back when gRPC drops the per-call behaviour
  (`weakref.finalize`; CPython frees it as the call's work item ends): no call leaks a slot.
- A refusal is gRPC's own words with RESOURCE_EXHAUSTED, answered from a handler thread.
"""

from __future__ import annotations

import threading
import weakref

import grpc

from batch_planner.errors import ErrorCode
from planner_server.status import abort

REFUSAL = "Concurrent RPC limit exceeded!"

# (request streaming, response streaming) -> the handler's attribute and its public constructor.
_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _refuse(_request, context):
    abort(context, ErrorCode.RESOURCE_EXHAUSTED, REFUSAL)


class RpcLimit(grpc.ServerInterceptor):
    """At most `limit` calls at once; `on_refused()` for each call past it."""

    def __init__(self, limit: int, on_refused):
        self.limit = limit
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self.active = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, from gRPC
        with self._lock:
            admitted = self.active < self.limit
            self.active += admitted
        attribute, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        if not admitted:
            self._on_refused()
            return make(_refuse)  # no deserializer: a refusal reads nothing
        return make(self._counted(getattr(handler, attribute), handler.response_streaming),
                    handler.request_deserializer, handler.response_serializer)

    def _release(self) -> None:
        with self._lock:
            self.active -= 1

    def _counted(self, behaviour, streaming: bool):
        if streaming:
            def run(request, context):
                try:
                    yield from behaviour(request, context)
                finally:
                    release()
        else:
            def run(request, context):
                try:
                    return behaviour(request, context)
                finally:
                    release()
        release = weakref.finalize(run, self._release)  # runs once: on return, or when gRPC drops the call
        return run
