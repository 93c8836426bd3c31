"""The planner image's Dockerfile: lint-clean with hadolint, and the promises docs/deployment.md
makes about it. The image itself is built and run by the CI's image leg (./dev image,
scripts/image/run); tests/deploy/test_image_*.py cover the build's import check and the chart's parity."""

from __future__ import annotations

import re
import tomllib

from tests.support.deploy_tools import ROOT, find_tool, run

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_hadolint_passes():
    result = run([find_tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """The linter is live: an unpinned, root, apt-cache-keeping Dockerfile fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y git\nRUN pip install grpcio\n")
    result = run([find_tool("hadolint"), str(bad)])
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013"):
        assert rule in result.stdout, result.stdout


def test_image_is_multi_stage_pinned_and_runs_as_non_root():
    steps = instructions()
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith("AS build") and froms[1].endswith("AS runtime")
    (base,) = {args.split("=", 1)[1] for op, args in steps if op == "ARG" and args.startswith("PYTHON_IMAGE=")}
    assert re.fullmatch(r"python:3\.12\.\d+-slim-bookworm", base), base
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["planner-server"]') in runtime
    exposed = {port for op, args in runtime if op == "EXPOSE" for port in args.split()}
    assert exposed == {"50051", "9400", "50052"}  # gRPC, metrics, probes


def test_megatron_core_is_a_build_argument_defaulting_to_the_pinned_dev_commit():
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    # The pinned Megatron-LM dev commit (deps/megatron-core.env; tests/project/test_megatron_pins.py),
    # fetched as a source archive: dynamic CP without git in the build.
    spec = args["MEGATRON_CORE_SPEC"].strip('"')
    assert spec.startswith("megatron-core @ https://github.com/NVIDIA/Megatron-LM/archive/") and spec.endswith(".tar.gz")
    # torch comes from the CPU-only wheel index, before anything that depends on it.
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    text = DOCKERFILE.read_text()
    assert text.index('--index-url "${TORCH_INDEX_URL}"') < text.index('pip install --no-cache-dir --no-deps "${MEGATRON_CORE_SPEC}" .')


def test_defaults_build_from_the_indexes_with_cpu_torch_and_refuse_a_cuda_one():
    """WHEELHOUSE empty: the indexes; TORCH_VARIANT cpu: the import check refuses a CUDA torch."""
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    assert args["WHEELHOUSE"] == '""' and args["TORCH_VARIANT"] == "cpu"
    runs = [a for op, a in instructions() if op == "RUN"]
    # Every pip install takes its source from the one switch: the wheelhouse, no index.
    installs = [r for r in runs if "pip install" in r]
    switch = 'if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="${WHEELHOUSE}"; fi;'
    assert len(installs) == 3 and all(r.startswith(switch) for r in installs), installs
    (check,) = [r for r in runs if "check_imports.py" in r]
    assert 'python scripts/image/check_imports.py "${TORCH_VARIANT}"' in check
    # SHELL needs the docker format under podman/buildah (scripts/image/build passes it).
    assert ("SHELL", '["/bin/bash", "-o", "pipefail", "-c"]') in instructions()
    assert "--format docker" in (ROOT / "scripts" / "image" / "build").read_text()


def test_dockerignore_lets_in_what_the_build_copies_and_nothing_else():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    allowed = {entry[1:].rstrip("/") for entry in ignore if entry.startswith("!")}
    copied = {src.rstrip("/") for op, args in instructions() if op == "COPY" and "--from" not in args
              for src in args.split()[:-1]}
    assert copied == allowed
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied


def test_image_carries_oci_labels_and_the_license_matches_pyproject():
    """OCI annotations in the image; LICENSE is the license pyproject declares."""
    text = (ROOT / "Dockerfile").read_text()
    for key in ("title", "description", "licenses", "version", "revision", "created", "base.name"):
        assert f"org.opencontainers.image.{key}=" in text, key
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "Apache-2.0" and f'org.opencontainers.image.licenses="{declared}"' in text
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def test_the_image_installs_a_hash_locked_set_that_satisfies_pyproject():
    """requirements/image.lock pins every runtime dependency but torch with hashes,
    at versions pyproject's ranges allow, and the image installs it with --require-hashes."""
    from packaging.requirements import Requirement

    locked: dict[str, str] = {}
    hashed: set[str] = set()
    name = None
    for line in (ROOT / "requirements" / "image.lock").read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_.-]+)==([^ ]+)", line):
            name = match.group(1).lower().replace("_", "-")
            locked[name] = match.group(2)
        elif "--hash=sha256:" in line and name:
            hashed.add(name)
    assert locked and set(locked) == hashed, set(locked) - hashed
    for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(spec)
        key = requirement.name.lower()
        if key == "torch":
            assert key not in locked  # the CPU build, from the CPU index (Dockerfile)
            continue
        assert key in locked and requirement.specifier.contains(locked[key]), (spec, locked.get(key))
    assert "--require-hashes --no-deps -r requirements/image.lock" in DOCKERFILE.read_text()


def test_the_lock_pins_triton_which_megatron_core_imports_and_cpu_torch_lacks():
    """megatron.core imports triton; the CPU build of torch does not bring it, so the lock must.
    Its pin is the triton the CUDA build of torch asks for (the same in both images)."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    lock = (ROOT / "requirements" / "image.lock").read_text()
    pinned = re.search(r"^triton==(\S+) ", lock, re.M)
    assert pinned, "requirements/image.lock has no triton (scripts/lock_requirements.py must keep it)"
    torch_wants = [r for r in requires("torch") or [] if r.startswith("triton")]
    if version("torch").split("+")[0] == re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M).group(1):
        assert torch_wants and Requirement(torch_wants[0]).specifier.contains(pinned.group(1)), torch_wants
