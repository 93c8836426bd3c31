"""A synchronous gRPC server with no handler of ours, and a client of it: the transport's floor
that bench/overhead.py measures a Plan RPC against.

The server runs in a process of its own, started by spawn; this module imports nothing of the
planner's, so that process holds grpc and nothing else of ours.
"""

from __future__ import annotations

import multiprocessing
import time

RPC_TIMEOUT_S = 300.0
RESPONSE_BYTES_KEY = "bench-response-bytes"  # `Sized` answers with this many bytes
# Every benchmark channel's (bench.common.planner_stub's too): large plans in and out.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _serve(port_out) -> None:
    """`Echo` returns the request's bytes; `Sized` as many bytes as its metadata's
    RESPONSE_BYTES_KEY says."""
    from concurrent import futures

    import grpc

    def sized(request: bytes, context) -> bytes:
        return bytes(int(dict(context.invocation_metadata())[RESPONSE_BYTES_KEY]))

    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Sized": grpc.unary_unary_rpc_method_handler(sized),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


class BareGrpc:
    """The bare server in its own process and one channel to it; `close()` stops both."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        import grpc

        receive, send = multiprocessing.Pipe(duplex=False)
        self._process = multiprocessing.get_context("spawn").Process(target=_serve, args=(send,), daemon=True)
        self._process.start()
        if not receive.poll(start_timeout):
            self._process.kill()
            raise RuntimeError(f"the bare gRPC server did not start within {start_timeout:.0f} s")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{receive.recv()}", options=CHANNEL_OPTIONS)
        self._echo = self._channel.unary_unary("/bench.Bare/Echo")
        self._sized = self._channel.unary_unary("/bench.Bare/Sized")
        self._echo(b"", timeout=RPC_TIMEOUT_S)  # the connection

    def call(self, payload: bytes, response_bytes: int) -> None:
        """`payload` in, `response_bytes` bytes out."""
        self._sized(payload, timeout=RPC_TIMEOUT_S, metadata=((RESPONSE_BYTES_KEY, str(response_bytes)),))

    def echo_seconds(self, payloads: list[bytes]) -> list[float]:
        """Each payload echoed, back to back: the seconds of each."""
        seconds = []
        for payload in payloads:
            started = time.perf_counter()
            self._echo(payload, timeout=RPC_TIMEOUT_S)
            seconds.append(time.perf_counter() - started)
        return seconds

    def close(self) -> None:
        self._channel.close()
        self._process.kill()
        self._process.join(10)
