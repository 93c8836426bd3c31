"""The old path of tests/support/planner_process.py, kept for bench/: bench/common.py, load.py,
startup.py and side_by_side.py import `tests.planner_process`, and side_by_side.py loads a
checkout's tests/planner_process.py by file path (this tree's or a baseline's). Imported, this name
is the support module itself; loaded by path, it runs the support module beside this file, so a
baseline checkout's server is that checkout's. Remove once bench/ names tests/support/."""

import importlib.util
import sys
from pathlib import Path

if __name__ == "tests.planner_process":
    from tests.support import planner_process as _support

    sys.modules[__name__] = _support
else:  # loaded by file path under another name (bench/side_by_side.py)
    _spec = importlib.util.spec_from_file_location(f"{__name__}_support", Path(__file__).resolve().parent / "support" / "planner_process.py")
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module  # dataclasses look their module up while the class is built
    _spec.loader.exec_module(_module)
    globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
