"""`./dev run` as a person runs it: the demo plan printed, the planner left serving, and Ctrl-C
(SIGINT to the whole process group, as a terminal sends it) stops it cleanly with exit status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from tests.support.planner_process import ROOT
from tests.support.reliability_support import wait_until
from tests.support.launch import free_port

WAIT_S = 300.0  # the longest any event below may take; never reached when the code is right


@pytest.mark.slow
def test_dev_run_exits_0_after_ctrl_c():
    env = dict(os.environ, PLANNER_PORT=str(free_port()), PLANNER_METRICS_PORT="0", PLANNER_PROBE_PORT="0")
    proc = subprocess.Popen(["./dev", "run"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_until(lambda: proc.poll() is not None or any("Ctrl-C stops it" in line for line in lines), WAIT_S,
                   "the demo's plan and the planner left serving")
        assert proc.poll() is None, "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the script, the server and its workers
        assert proc.wait(WAIT_S) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    output = "".join(lines)
    assert "stopped" in output and "Traceback" not in output, output
