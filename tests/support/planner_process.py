"""Starts a real planner server as a subprocess on loopback, for tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"SERVING on port (\d+) \(metrics port (\S+)\)(?:; probe port (\S+);)?")


@dataclass
class PlannerProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int | None
    probe_port: int | None = None
    host: str = "127.0.0.1"  # what --host it listens on (gRPC and /metrics)
    log_lines: list[str] = field(default_factory=list)
    output_closed: threading.Event = field(default_factory=threading.Event)  # every process of it closed stdout

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log(self) -> str:
        return "\n".join(self.log_lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # A server killed outright leaves its forkserver and workers behind (in a pod they die with
        # the container); the server runs in its own session, so end whatever is left of it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode


def planner_env(without_release_overlay: bool = False, root: Path = ROOT) -> dict[str, str]:
    """The environment of a server subprocess. `without_release_overlay`: drop the folder that
    `./dev test-release` puts ahead of the venv (PLANNER_RELEASE_OVERLAY), so the server runs the
    venv's own Megatron-Core (the dev build) while this process runs the release. `root`: the
    checkout whose code the server runs (a benchmark's other tree; default this one)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    overlay = env.get("PLANNER_RELEASE_OVERLAY")
    if without_release_overlay and overlay:
        paths = [p for p in paths if os.path.realpath(p) != os.path.realpath(overlay)]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *paths])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_planner(
    *args: str, workers: int = 2, port: int = 0, timeout: float = 180.0, without_release_overlay: bool = False,
    root: Path = ROOT, extra_env: dict[str, str] | None = None, wait_serving: bool = True,
) -> PlannerProcess:
    """Starts `python -m planner_server` (the code of `root`, with `extra_env` added to its
    environment) and waits until it reports SERVING. `wait_serving=False`: returns at once (`port`
    must then be given; `metrics_port` and `probe_port` are unknown, None)."""
    cmd = [sys.executable, "-m", "planner_server", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--probe-port", "0", "--workers", str(workers), *args]
    proc = subprocess.Popen(
        cmd, cwd=root, env={**planner_env(without_release_overlay, root), **(extra_env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines: list[str] = []
    ready, closed = threading.Event(), threading.Event()
    found: dict[str, str] = {}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            match = READY.search(line)
            if match and not ready.is_set():
                found["port"], found["metrics"], found["probe"] = match.group(1), match.group(2), match.group(3)
                ready.set()
        ready.set()
        closed.set()

    threading.Thread(target=pump, daemon=True).start()
    hosts = [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == "--host"]  # the last one wins
    if not wait_serving:
        assert port, "wait_serving=False needs the port"
        return PlannerProcess(proc, port, None, host=hosts[-1], log_lines=lines, output_closed=closed)
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("planner did not become SERVING in time:\n" + "\n".join(lines[-30:]))
    if "port" not in found:
        proc.wait(10)
        raise RuntimeError(f"planner exited with {proc.returncode}:\n" + "\n".join(lines[-30:]))
    metrics, probe = found["metrics"], found["probe"]
    return PlannerProcess(
        proc, int(found["port"]), None if metrics == "None" else int(metrics),
        probe_port=None if probe in (None, "None") else int(probe), host=hosts[-1], log_lines=lines, output_closed=closed,
    )
