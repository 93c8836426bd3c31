"""The one home of how the exact path's hot loops are compiled: numba (docs/design.md, "The
compiled exact path", has the choice and its numbers), with no fast-math.

`kernel` compiles a function to machine code on its first call (or loads it from numba's on-disk
cache, next to the module or in `NUMBA_CACHE_DIR`); the compiled code does the same IEEE double
operations in the same order as the Python source, because fast-math (reassociation, contraction
into fused multiply-adds, assuming no NaN or inf) is off. Where the cache cannot be written (a
read-only image without `NUMBA_CACHE_DIR`), the kernels still compile, each time a process starts.

Without numba importable, `kernel` leaves the function as it is and `available()` says why: the
implementation setting then falls back to the pure-Python exact path (verified.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, TypeVar, cast

F = TypeVar("F", bound=Callable)


_failed = ""  # why compiling failed in this process (`mark_failed`), if it did


@lru_cache(maxsize=1)
def _import_problem() -> str:
    try:
        import numba  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken llvmlite
        return f"numba is not importable ({type(exc).__name__}: {exc})"
    return ""


def unavailable_reason() -> str:
    """Empty when numba compiles here, else why not."""
    return _failed or _import_problem()


def mark_failed(reason: str) -> None:
    """Compiling failed in this process: from now on the compiled setting runs the pure-Python
    exact path, and says why."""
    global _failed
    _failed = reason


def available() -> bool:
    return not unavailable_reason()


def kernel(function: F) -> F:
    """`function` compiled in nopython mode, fast-math off, cached on disk where that works."""
    if not available():
        return function
    import numba

    try:
        return cast(F, numba.njit(cache=True, nogil=True, fastmath=False)(function))
    except RuntimeError:  # "cannot cache function ...: no locator available": compile at each start
        return cast(F, numba.njit(cache=False, nogil=True, fastmath=False)(function))


def version() -> str:
    """The compiler and its version, for the status line ("numba 0.68.1")."""
    import numba

    return f"numba {numba.__version__}"
