"""Paying for compilation at start, not on a plan: the one call the server's worker preload, its
warm-up and the trainer client's in-process fallback make when they start.

The compiled exact path (batch_planner/exact/compiler.py) compiles each kernel on its first call,
about a second or two per process without the on-disk cache, a fraction of that with it. Plans
must not wait on that, so `prepare` runs the kernels once on a tiny input beforehand.
"""

from __future__ import annotations

import logging
import time

from batch_planner.exact import compiler
from batch_planner.exact.verified import SchedulerImplementation, exact_path_status
from batch_planner.request import SchedulerKind

log = logging.getLogger(__name__)


def prepare(always: bool = False, implementation: SchedulerImplementation | None = None) -> float:
    """Compiles (or loads from the disk cache) the compiled exact path's kernels in this process
    where this process's setting runs them (`always`: wherever the compiler is importable, for a
    forkserver whose workers choose later; `implementation`: a caller's own setting, as a trainer
    client's fallback passes it). Returns the seconds it took (0.0: nothing to do).
    Should compiling fail, the process plans with the pure-Python exact path, which its status
    (GetCapabilities, the start-up log) then names with the reason."""
    if not compiler.available():
        return 0.0
    if not always and not exact_path_status(SchedulerKind.DYNAMIC_CP, implementation).compiled:
        return 0.0
    from batch_planner.exact import compiled_dynamic_cp

    started = time.perf_counter()
    try:
        compiled_dynamic_cp.prepare()
    except Exception as exc:  # noqa: BLE001 - a compiler that cannot compile here must not stop the planner
        compiler.mark_failed(f"compiling failed ({type(exc).__name__}: {exc})")
        exact_path_status.cache_clear()
        log.error("the compiled exact path could not compile; the pure-Python exact path plans instead: %s", exc, exc_info=True)
        return 0.0
    seconds = time.perf_counter() - started
    log.debug("compiled exact path ready in %.2f s (%s)", seconds, compiler.version())
    return seconds
