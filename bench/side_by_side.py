"""A benchmark's servers for this tree and, with `--baseline PATH`, for a checkout of another commit of
this repository, measured side by side in one run.

Each tree's server is its own `python -m planner_server`, started by that checkout's own
`tests/support/planner_process.py` (cwd and PYTHONPATH set to the checkout, this interpreter, the same
flags). The client side is this tree's for both servers (the wire contract is the same proto), and
the benchmarks alternate between the servers run by run, or phase by phase where a phase needs one
server to itself, so that the ratio new / baseline is measured under the same load.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

from bench.common import Spread

ROOT = Path(__file__).resolve().parent.parent  # this tree
# Flags tests/support/planner_process.start_planner passes to every server, besides the benchmark's own.
LAUNCHER_FLAGS = ("--host", "--port", "--metrics-port", "--probe-port", "--workers")
T = TypeVar("T")


@dataclass(frozen=True)
class Tree:
    """A checkout of this repository whose server a benchmark runs: `new` (this tree) or `baseline`."""

    label: str
    root: Path
    commit: str  # short hash of its HEAD
    dirty: bool  # the checkout has uncommitted changes to tracked files

    @property
    def describe(self) -> str:
        return self.commit + (" + uncommitted changes" if self.dirty else "")

    @classmethod
    def at(cls, label: str, root: Path) -> "Tree":
        root = root.resolve()
        if _planner_process(root) is None or not (root / "planner_server").is_dir():
            raise SystemExit(f"--baseline {root}: not a checkout of this repository (no planner_server/ "
                             "or tests/support/planner_process.py)")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
        return cls(label, root, _git(root, "rev-parse", "--short", "HEAD"), dirty)

    def start_planner(self, *args: str, workers: int):
        """This checkout's own planner_process.start_planner: its server, from its root."""
        if self.root == ROOT:
            from tests.support.planner_process import start_planner
        else:
            name = f"_planner_process_{self.commit}"  # the module, loaded from the checkout, once
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, _planner_process(self.root))
                assert spec is not None and spec.loader is not None
                sys.modules[name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(sys.modules[name])
            start_planner = sys.modules[name].start_planner
        return start_planner(*args, workers=workers)


def _planner_process(root: Path) -> Path | None:
    """A checkout's planner_process.py: tests/support/ since the test tree mirrors the packages, tests/ before."""
    return next((p for p in (root / "tests" / "support" / "planner_process.py", root / "tests" / "planner_process.py") if p.is_file()), None)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def trees(baseline: Path | None) -> tuple[Tree, ...]:
    """This tree, then the baseline checkout if there is one."""
    new = Tree.at("new", ROOT)
    return (new,) if baseline is None else (new, Tree.at("baseline", baseline))


def check_flags(trees: Sequence[Tree], args: Sequence[str]) -> None:
    """Every flag the benchmark passes exists in every tree's server (its --help), so both servers
    run with the same settings; otherwise stop before measuring anything."""
    flags = sorted({*LAUNCHER_FLAGS, *(a.split("=")[0] for a in args if a.startswith("--"))})
    for tree in trees:
        help_text = subprocess.run(
            [sys.executable, "-m", "planner_server", "--help"], cwd=tree.root, capture_output=True, text=True,
            env=_env(tree.root), timeout=120,
        ).stdout
        missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
        if missing:
            raise SystemExit(f"the {tree.label} tree's server ({tree.describe}) has no {', '.join(missing)}")


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


@contextlib.contextmanager
def running(trees: Sequence[Tree], *args: str, workers: int, stop_signal: int = signal.SIGTERM) -> Iterator[list]:
    """Yields one started server (tests.support.planner_process.PlannerProcess) per tree, in `trees`' order,
    started together, and stops them all on exit (one the benchmark already stopped, e.g. by a timed
    drain, is left as it is). With a baseline checkout among them, the flags are checked first."""
    if any(tree.root != ROOT for tree in trees):
        check_flags(trees, args)
    with concurrent.futures.ThreadPoolExecutor(len(trees)) as starting:
        futures = [starting.submit(tree.start_planner, *args, workers=workers) for tree in trees]
    # Every start has finished here: stop the ones that did start if another failed.
    servers = [future.result() for future in futures if future.exception() is None]
    try:
        for future in futures:
            future.result()  # raises a failed start's error
        yield servers
    finally:
        for server in servers:
            server.stop(stop_signal)


def alternating(items: Sequence[T], k: int) -> list[T]:
    """`items` in order for even k, reversed for odd k: neither tree always goes first."""
    return list(items) if k % 2 == 0 else list(reversed(items))


def ratio(new: float, baseline: float) -> str:
    return f"{new / baseline:.2f}" if baseline > 0 else "-"


def spread_ratios(new: Spread, baseline: Spread) -> tuple[str, str]:
    """new / baseline of the p50s and of the p99s."""
    return ratio(new.p50, baseline.p50), ratio(new.p99, baseline.p99)


def intro(trees: Sequence[Tree]) -> str:
    """What a side-by-side report says about its two trees."""
    new, baseline = trees
    return (f"Side by side in one run: **new** = this tree ({new.describe}), **baseline** = commit "
            f"{baseline.describe}, each its own server process started from its own checkout with the same flags; "
            "the client side is the new tree's for both (same proto). The requests alternate between the "
            "two servers run by run (or phase by phase where a phase needs a server to itself), so "
            "new / baseline is measured under the same load on this shared machine; a ratio above 1 "
            "means the new tree is slower.")
