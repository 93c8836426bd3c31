"""Server flags and environment variables: every value is range-checked with a message naming the
flag, the variable, the value and what is allowed; --version."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner_server import __version__
from tests.support.planner_process import ROOT, planner_env


def run_server(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner_server", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**planner_env(), **(env or {})})


@pytest.mark.parametrize(
    "args,env,expected",
    [
        (["--port", "70000"], {}, ["--port", "70000", "0..65535"]),
        (["--metrics-port", "-2"], {}, ["--metrics-port", "-2", "-1..65535"]),
        (["--log-level", "verbose"], {}, ["--log-level", "'verbose'", "DEBUG, INFO, WARNING, ERROR"]),
        ([], {"PLANNER_LOG_LEVEL": "loud"}, ["PLANNER_LOG_LEVEL", "'loud'"]),
        ([], {"PLANNER_PORT": "99999"}, ["PLANNER_PORT", "99999", "0..65535"]),
        ([], {"PLANNER_WORKERS": "two"}, ["PLANNER_WORKERS", "'two'", "int"]),
        (["--drain-seconds", "nan"], {}, ["--drain-seconds", "nan", "finite"]),
        (["--max-samples-per-request", "0"], {}, ["--max-samples-per-request", "0", "1.."]),
        (["--seconds-per-token", "-1"], {}, ["--seconds-per-token", "-1.0", "0..inf"]),
        (["--max-connection-age-seconds", "-5"], {}, ["--max-connection-age-seconds", "-5.0"]),
    ],
)
def test_out_of_range_settings_stop_the_server_with_a_clear_message(args, env, expected):
    result = run_server(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for part in expected:
        assert part in result.stderr, (part, result.stderr)


def test_version():
    result = run_server("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"planner-server {__version__}"
