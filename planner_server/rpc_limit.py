"""Counts the RPCs gRPC itself refuses with "Concurrent RPC limit exceeded!".

gRPC (Python) refuses a call past `maximum_concurrent_rpcs` before any handler of ours runs, so
no servicer code sees it. It decides in the thread that then looks up the call's handler - which
runs the server interceptors - under the same lock, from `active_rpc_count`. This interceptor
reads that count at that moment: when it is at the limit, the call about to be looked up is the
one gRPC refuses. `_state` is private to grpcio; tests/test_planner_metrics.py checks that the
count still matches what a client sees.
"""

from __future__ import annotations

import grpc


class RpcLimitCounter(grpc.ServerInterceptor):
    def __init__(self, on_refused):
        self._on_refused = on_refused
        self._state = None

    def watch(self, server: grpc.Server) -> None:
        self._state = getattr(server, "_state", None)

    def intercept_service(self, continuation, handler_call_details):
        state = self._state
        limit = getattr(state, "maximum_concurrent_rpcs", None)
        if limit is not None and state.active_rpc_count >= limit:
            self._on_refused()
        return continuation(handler_call_details)
