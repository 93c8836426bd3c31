"""The generated code in batch_planner/v1 must match what protoc makes of proto/ today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_check_detects_drift(tmp_path):
    # The check itself must be able to fail: regenerate into a copy with an edited proto.
    copy = tmp_path / "repo"
    (copy / "batch_planner").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(ROOT / "proto"), str(copy / "proto")], check=True)
    subprocess.run(["cp", "-r", str(ROOT / "scripts"), str(copy / "scripts")], check=True)
    subprocess.run(["cp", "-r", str(ROOT / "batch_planner" / "v1"), str(copy / "batch_planner" / "v1")], check=True)
    proto = copy / "proto" / "batch_planner" / "v1" / "planner.proto"
    proto.write_text(proto.read_text().replace("string job = 9;", "string job = 9;\n  string extra = 99;"))
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=copy, capture_output=True, text=True)
    assert result.returncode == 1 and "drifted" in result.stderr
