"""Imported once by the workers' forkserver, so that every planning worker (and every replacement
of a dead one) starts with Megatron-Core already imported instead of paying ~10 s each, and with
the compiled exact path's kernels already compiled (its workers choose the implementation later,
so they are compiled wherever the compiler is importable)."""

from batch_planner.exact.prepare import prepare
from batch_planner.schedulers import discover_schedulers
from planner_server import planning_worker  # noqa: F401 - the worker entry points

discover_schedulers()
prepare(always=True)
