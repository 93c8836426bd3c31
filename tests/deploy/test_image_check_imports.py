"""The image build's import check (scripts/image/check_imports.py) and the triton fix, on this
venv's torch and Megatron-Core.

The triton proof: an environment that has everything this venv has except triton, as an
environment with the CPU build of torch is, fails to import megatron.core with "No module named
'triton'" (what the image's build stage hit before requirements/image.lock pinned triton); the same
environment plus triton at the lock's pin imports it. Both are real interpreters: `python -S` with
PYTHONPATH on a folder of links to this venv's site-packages, triton's entries left out or added.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.deploy_tools import ROOT

CHECK = ROOT / "scripts" / "image" / "check_imports.py"
TRITON = re.compile(r"^triton(-[^/]*\.dist-info)?$")


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def linked_site_packages(folder: Path, keep) -> Path:
    """A folder of links to this venv's site-packages entries for which keep(name) holds."""
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if keep(entry.name) and not entry.name.endswith(".pth"):
            (folder / entry.name).symlink_to(entry)
    return folder


def isolated_python(*paths: Path) -> tuple[list[str], dict[str, str]]:
    """This interpreter without its site-packages (-S), seeing only `paths`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PLANNER_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return [sys.executable, "-S"], env


def locked_triton() -> str:
    match = re.search(r"^triton==(\S+) ", (ROOT / "requirements" / "image.lock").read_text(), re.M)
    assert match, "requirements/image.lock pins no triton"
    return match.group(1)


def test_megatron_core_needs_triton_and_imports_with_the_locked_one(tmp_path):
    pytest.importorskip("triton")
    assert version("triton") == locked_triton(), "this venv's triton is not the lock's: the proof would not hold"
    without = linked_site_packages(tmp_path / "without-triton", lambda name: not TRITON.match(name))
    python, env = isolated_python(without)

    # `import megatron.core` as the build's check does it, which names the fix.
    before = run([*python, "-c", "import sys; sys.path.insert(0, 'scripts/image'); import check_imports; "
                  "check_imports.check_megatron_core()"], env)
    assert before.returncode == 1, before.stderr[-2000:]
    assert "No module named 'triton'" in before.stderr and "requirements/image.lock must pin triton" in before.stderr

    with_triton = linked_site_packages(tmp_path / "locked-triton", lambda name: bool(TRITON.match(name)))
    python, env = isolated_python(without, with_triton)
    after = run([*python, "-c", "import megatron.core, triton; print(triton.__version__)"], env)
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.split()[-1] == locked_triton()


def test_the_check_refuses_the_torch_build_not_asked_for():
    """On a CUDA torch (this venv's, on Linux) TORCH_VARIANT=cpu fails before importing anything
    else; the passing variant runs in the image build (./dev image)."""
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        result = run([sys.executable, str(CHECK), "cuda"])
        assert result.returncode == 1 and "is the CPU build, but TORCH_VARIANT=cuda" in result.stderr
        return
    result = run([sys.executable, str(CHECK), "cpu"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"is a CUDA {torch.version.cuda} build, but TORCH_VARIANT=cpu" in result.stderr, result.stderr[-2000:]
    assert "TORCH_INDEX_URL" in result.stderr and "TORCH_VARIANT=cuda" in result.stderr


def test_the_check_rejects_an_unknown_variant():
    result = run([sys.executable, str(CHECK), "rocm"])
    assert result.returncode == 1 and "usage: check_imports.py cpu|cuda" in result.stderr
