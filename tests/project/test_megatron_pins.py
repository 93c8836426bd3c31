"""The Megatron-Core builds the project pins (deps/megatron-core.env) are the ones the image, the
docs and the wheelhouse use: one pin, repeated only where a file cannot read it, and checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    text = (ROOT / "deps" / "megatron-core.env").read_text()
    return dict(re.findall(r"^([A-Z_]+)=(\S+)$", text, flags=re.M))


def test_the_image_defaults_to_the_pinned_dev_commit():
    dockerfile = (ROOT / "Dockerfile").read_text()
    default = re.search(r'^ARG MEGATRON_CORE_SPEC=(.+)$', dockerfile, flags=re.M).group(1)
    assert pins()["MEGATRON_CORE_DEV_COMMIT"] in default and "Megatron-LM" in default


def test_docs_name_the_pinned_commit_and_release():
    p = pins()
    for doc in ("README.md", "docs/deployment.md"):
        text = (ROOT / doc).read_text()
        assert p["MEGATRON_CORE_DEV_COMMIT"] in text, doc
    assert p["MEGATRON_CORE_RELEASE"] in (ROOT / "README.md").read_text()


def test_the_wheelhouse_holds_the_pinned_dev_version():
    wheels = ROOT.parent / "shared" / "wheels"
    if not wheels.is_dir():
        pytest.skip(f"no wheelhouse at {wheels} (outside this workplace ./dev installs the commit's source)")
    version = pins()["MEGATRON_CORE_DEV_VERSION"]
    assert list(wheels.glob(f"megatron_core-{version}-*.whl")), f"no megatron_core-{version} wheel in {wheels}"


def test_the_megatron_lm_drop_ins_gate_checks_the_pinned_builds():
    """The drop-in's version gate passes the builds the CI legs run: the dev wheel and the release."""
    from trainer_client.megatron_lm.version import CHECKED_MEGATRON_CORE_VERSIONS

    p = pins()
    assert {p["MEGATRON_CORE_DEV_VERSION"], p["MEGATRON_CORE_RELEASE"]} <= set(CHECKED_MEGATRON_CORE_VERSIONS)
