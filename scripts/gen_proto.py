"""Regenerates batch_planner/v1/*_pb2*.py from proto/ (run after editing the .proto).

    python scripts/gen_proto.py            # write the generated code
    python scripts/gen_proto.py --check    # exit 1 if the committed code drifted from proto/
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(p) for p in PROTOS]) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*.py*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generated = generate(out)
        drifted = []
        for rel in generated:
            target = ROOT / rel
            if check:
                if not target.exists() or not filecmp.cmp(out / rel, target, shallow=False):
                    drifted.append(str(rel))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes((out / rel).read_bytes())
    if drifted:
        print("generated protobuf code drifted from proto/: " + ", ".join(drifted), file=sys.stderr)
        print("run: python scripts/gen_proto.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
