"""The Bridge tests run in their own leg (`./dev test-bridge`), on Megatron-Bridge 0.6.2 and what
its imported modules need, installed into an overlay (requirements/bridge-leg.txt); the main
suite's environment has no Bridge, so they are collected only there (PLANNER_BRIDGE_OVERLAY is set
by ./dev test-bridge; BRIDGE_MEGATRON_CORE=release puts the Megatron-Core release ahead of it).

Transformer Engine is not installed: before any test module imports Bridge, the TE import stand-in
is installed (transformer_engine_import_stand_in.py says exactly what it hides and from whom).
NO_VCS_VERSION=1: Bridge (and Megatron-Core) append the short commit of the git checkout their
files lie in to __version__ ("0.6.2+<this project's commit>", the overlay being inside the
checkout's .venv), running git at import; with it set, __version__ is the release's."""

import os

os.environ.setdefault("NO_VCS_VERSION", "1")

collect_ignore_glob = [] if os.environ.get("PLANNER_BRIDGE_OVERLAY") else ["test_*.py"]

if os.environ.get("PLANNER_BRIDGE_OVERLAY"):
    from tests.trainer_client.megatron_bridge import transformer_engine_import_stand_in

    transformer_engine_import_stand_in.install()
