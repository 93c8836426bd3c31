"""The linter and the type check CI runs: ruff over the repository and mypy over the gRPC-free
core (batch_planner/), both configured in pyproject.toml. A finding fails the suite with ruff's or
mypy's own report, so `./dev test` and CI refuse the same code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_ruff_finds_nothing():
    result = run_tool("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_core_type_checks():
    result = run_tool("mypy")  # files and options: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr
