"""Finds the external tools the deployment tests use (installed by .ci/install-tools).

A missing tool skips the test with the reason on a developer's machine, and fails it under CI
(environment variable CI set), where .ci/install-tools must have installed it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "batch-planner"
ALL_ON_VALUES = CHART / "ci" / "all-on-values.yaml"
ALERTS = CHART / "prometheus" / "alerts.yml"
DASHBOARD = CHART / "dashboards" / "batch-planner.json"
TOOLS_DIR = Path(os.environ.get("BATCH_PLANNER_TOOLS_DIR", "/opt/batch-planner-tools"))
INSTALL_HINT = "run .ci/install-tools"


def missing(what: str) -> None:
    message = f"{what} is not installed ({INSTALL_HINT})"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must have it")
    pytest.skip(message)


def find_tool(name: str) -> str:
    """The tool's path: the venv's bin, then the tools dir, then PATH."""
    for candidate in (Path(sys.executable).parent / name, TOOLS_DIR / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        missing(name)
    return found


def crd_validator_modules() -> Path:
    """node_modules holding @kubernetes-models/prometheus-operator."""
    find_tool("node")
    modules = TOOLS_DIR / "node" / "node_modules"
    if not (modules / "@kubernetes-models" / "prometheus-operator" / "package.json").is_file():
        missing(f"@kubernetes-models/prometheus-operator (in {modules})")
    return modules


def run(cmd: list[str], *, timeout: float = 120, cwd: Path = ROOT, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, input=input)


@functools.lru_cache(maxsize=None)
def render_chart_text(values_file: str | None = None, *sets: str) -> str:
    cmd = [find_tool("helm"), "template", "rel", str(CHART), "--namespace", "ml"]
    if values_file:
        cmd += ["-f", values_file]
    for s in sets:
        cmd += ["--set", s]
    result = run(cmd)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return result.stdout


def render_chart(values_file: str | None = None, *sets: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render_chart_text(values_file, *sets)) if doc]


def by_kind(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind}*{name_suffix}, got {[d['metadata']['name'] for d in matches]}"
    return matches[0]
