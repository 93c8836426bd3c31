"""The one translation of the project's status codes (batch_planner/errors.py) to gRPC's: every
handler and the RPC limit end a failed call here."""

import grpc

from batch_planner.errors import ErrorCode


def abort(context: grpc.ServicerContext, code: ErrorCode, message: str) -> None:
    """Ends the call with `code` and `message`; gRPC raises out of this."""
    context.abort(grpc.StatusCode[code.value], message)
