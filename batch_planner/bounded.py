"""A call of Megatron-Core's own code that is cut off after a time limit, in any thread.

Upstream's `align_sample_id_groups` loops for ever on some batches of a DPxCP that is not a power
of two (batch_planner/exact/align.py). The exact path detects that exactly; Megatron-Core's own
code (`scheduler_implementation=upstream`, or a build the exact path was not verified against)
cannot be asked. `call_within` runs it in the calling thread and, should it still run after the
limit, raises `CutOff` in that thread (CPython's `PyThreadState_SetAsyncExc`, checked between
bytecodes: upstream's loop is pure Python). That stops the call in a server worker, in the
handler thread of an inline request and in a trainer's in-process fallback alike, so none of them
hangs and the thread goes on to serve the substitute.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

# How long one call of Megatron-Core's own scheduler code may run, on a layout planned batch by
# batch, before it is taken for a loop, when the caller has no deadline (a script, a trainer's
# in-process fallback). Upstream's own code is slow (4,096 samples on 256 ranks take 10-30 s, README
# "Schedulers"), so a batch it would plan in more than this is served the substitute too
# (`upstream_loop`, its detail says "cut off"); the exact path, the default, never is.
DEFAULT_LIMIT_SECONDS = 30.0
# With a deadline (the server's requests, `request_deadline`): this share of the time left, the
# rest kept for serving the substitute before the deadline.
DEADLINE_SHARE = 0.8

_deadline: ContextVar[float | None] = ContextVar("batch_planner_upstream_deadline", default=None)


@contextmanager
def request_deadline(wall_deadline: float | None) -> Iterator[None]:
    """Within it, calls of upstream's own code end before `wall_deadline` (seconds since the epoch):
    the server sets the request's, so a cut-off is answered with the substitute, in time."""
    token = _deadline.set(wall_deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def limit_seconds() -> float:
    """How long the next call of upstream's own code may run: a share of the time left to the
    request, or DEFAULT_LIMIT_SECONDS without one."""
    wall = _deadline.get()
    if wall is None:
        return DEFAULT_LIMIT_SECONDS
    return max(0.0, (wall - time.time()) * DEADLINE_SHARE)


class CutOff(BaseException):
    """Raised inside a call that ran past its limit. A BaseException, so that no `except Exception`
    in the code being cut off swallows it."""


def call_within(fn: Callable[[], T], seconds: float) -> T:
    """fn() in this thread, or CutOff raised out of it once it has run `seconds`."""
    target = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if state["done"]:
                return
            state["fired"] = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(CutOff))

    timer = threading.Timer(max(0.0, seconds), fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return fn()
        finally:
            with lock:
                state["done"] = True
                fired = state["fired"]
            timer.cancel()
            if fired:
                # Fired as fn returned: the exception may still be pending; drop it so that it is
                # not raised later in code that has nothing to do with this call.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
    except CutOff:
        raise CutOff(f"did not return within {seconds:g} s") from None
