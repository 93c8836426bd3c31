"""A synchronous gRPC server with no handler of ours, and a client of it: the transport's share
that bench/overhead.py measures a Plan RPC against.

    python -m bench.bare_grpc    # serves on a free loopback port, prints it, runs until killed

`BareGrpc` starts that command as a process of its own: this module imports nothing but grpc, so
the server holds nothing of the planner's (a multiprocessing child would import the parent's main
module again).
"""

from __future__ import annotations

import select
import subprocess
import sys
import time
from pathlib import Path

RPC_TIMEOUT_S = 300.0
RESPONSE_BYTES_KEY = "bench-response-bytes"  # `Sized` answers with this many bytes
# Every benchmark channel's (bench.common.planner_stub's too): large plans in and out.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
_ROOT = Path(__file__).resolve().parents[1]


def serve() -> None:
    """`Echo` returns the request's bytes; `Sized` as many bytes as its metadata's
    RESPONSE_BYTES_KEY says. Prints the port, then serves until the process is killed."""
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
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


class BareGrpc:
    """The bare server in its own process and one channel to it; `close()` stops both."""

    def __init__(self, start_timeout: float = 120.0) -> None:
        import grpc

        self._process = subprocess.Popen([sys.executable, "-m", "bench.bare_grpc"], cwd=_ROOT, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], start_timeout)
        line = self._process.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            self._process.kill()
            self._process.wait(10)
            raise RuntimeError(f"the bare gRPC server did not start within {start_timeout:.0f} s (it printed {line!r})")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{int(line)}", options=CHANNEL_OPTIONS)
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
        self._process.wait(10)
        if self._process.stdout is not None:
            self._process.stdout.close()


if __name__ == "__main__":
    serve()
