"""External tools some tests need (installed by .ci/install-tools): find them, or skip outside CI."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    """The tool's path. Outside CI a missing tool skips the test with the reason; in CI it fails."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed (run .ci/install-tools)"
    if os.environ.get("CI"):
        pytest.fail(message + "; CI must have it")
    pytest.skip(message)
