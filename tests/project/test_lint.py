"""The linter and the checks CI runs: ruff over the repository, mypy over the gRPC-free core
(batch_planner/) and import-linter's contracts over the three packages, all configured in
pyproject.toml. A finding fails the suite with the tool's own report, so `./dev test` and CI refuse the same code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_ruff_finds_nothing():
    result = run_tool("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_core_type_checks():
    result = run_tool("mypy")  # files and options: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_import_contracts_hold():
    """[tool.importlinter] in pyproject.toml: no import cycles in any package, the core below the
    server and the client, the two independent, nothing of gRPC in the core."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
