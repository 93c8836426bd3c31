"""The Helm chart's defaults run the image the way the image's smoke test ran it.

Reads both sides: the Deployment `helm template` renders with the default values, and the
`podman run` arguments of scripts/image/smoke_test.py (`--print-podman-run`), plus the smoke test's
probe services and startup budget. Fails when they drift apart in user, read-only root and /tmp,
capabilities, ports, probes, settings (PLANNER_* environment), image or arguments.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.support.deploy_tools import CHART, ROOT, by_kind, render_chart

SMOKE_TEST = ROOT / "scripts" / "image" / "smoke_test.py"
# podman run options the smoke test may use: those taking a value, and flags.
VALUED = {"--name", "--user", "--tmpfs", "--cap-drop", "--security-opt", "--publish", "--env"}
FLAGS = {"--detach", "--read-only"}
SIZE_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def smoke_module():
    spec = importlib.util.spec_from_file_location("image_smoke_test", SMOKE_TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def podman_run_of_smoke_test(image: str) -> list[str]:
    result = subprocess.run([sys.executable, str(SMOKE_TEST), "--print-podman-run", image],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def parse_podman_run(argv: list[str]) -> dict:
    """{option: [values]}, the image, and the command/arguments after it."""
    assert argv[:2] == ["podman", "run"], argv
    options: dict[str, list] = {}
    rest = argv[2:]
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        if option in FLAGS:
            options.setdefault(option, []).append(True)
        elif option in VALUED:
            options.setdefault(option, []).append(rest.pop(0))
        else:
            raise AssertionError(f"podman run option {option} is not compared with the chart: add it to this test")
    return {"options": options, "image": rest[0], "arguments": rest[1:]}


def size_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", size).groups()
    return int(number) * SIZE_UNITS.get(unit, 1)


def drift(docs: list[dict], run: dict, smoke) -> list[str]:
    """Where the chart's Deployment and the smoke test's run differ; empty when they agree."""
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    (planner,) = pod["containers"]
    security = planner["securityContext"]
    options = run["options"]
    found = []

    def differ(what, chart, smoke_side):
        if chart != smoke_side:
            found.append(f"{what}: chart {chart!r}, smoke test {smoke_side!r}")

    user = pod["securityContext"]
    differ("user", f"{user['runAsUser']}:{user['runAsGroup']}", options.get("--user", ["image default"])[0])
    differ("read-only root", security.get("readOnlyRootFilesystem", False), "--read-only" in options)
    tmp_volume = next(v for v in pod["volumes"] if v["name"] == "tmp")
    mounts = {m["mountPath"]: m["name"] for m in planner["volumeMounts"]}
    tmpfs = dict(t.split(":", 1) for t in options.get("--tmpfs", []))
    differ("writable /tmp", mounts.get("/tmp") == "tmp" and "emptyDir" in tmp_volume, "/tmp" in tmpfs)
    tmpfs_size = re.search(r"size=(\w+)", tmpfs.get("/tmp", ""))
    differ("/tmp size", size_bytes(tmp_volume["emptyDir"].get("sizeLimit", "0")),
           size_bytes(tmpfs_size.group(1)) if tmpfs_size else 0)
    differ("dropped capabilities", security.get("capabilities", {}).get("drop", []), options.get("--cap-drop", []))
    differ("no privilege escalation", security.get("allowPrivilegeEscalation") is False,
           "no-new-privileges" in options.get("--security-opt", []))

    chart_ports = {p["name"]: p["containerPort"] for p in planner["ports"]}
    smoke_ports = {name: int(publish.rsplit(":", 1)[1]) for name, publish in zip(smoke.PORTS, options.get("--publish", []))}
    differ("container ports", chart_ports, smoke_ports)
    differ("smoke test's port names", chart_ports, smoke.PORTS)

    for probe, service in (("startupProbe", smoke.READINESS_SERVICE), ("readinessProbe", smoke.READINESS_SERVICE),
                           ("livenessProbe", smoke.LIVENESS_SERVICE)):
        grpc_probe = planner[probe].get("grpc", {})
        differ(f"{probe} port", grpc_probe.get("port"), smoke.PORTS["probe"])
        differ(f"{probe} service", grpc_probe.get("service", ""), service)
    startup = planner["startupProbe"]
    differ("startup budget (s)", startup["failureThreshold"] * startup["periodSeconds"], smoke.STARTUP_SECONDS)

    chart_env = {e["name"]: e["value"] for e in planner["env"]}
    smoke_env = dict(e.split("=", 1) for e in options.get("--env", []))
    for name, value in smoke_env.items():
        differ(f"env {name}", chart_env.get(name), value)
    # The chart's other settings are values.yaml's config, which are the server's defaults
    # (tests/deploy/test_deploy_chart.py::test_default_config_values_match_the_server_defaults).
    config = {"PLANNER_" + key.upper() for key in yaml.safe_load((CHART / "values.yaml").read_text())["config"]}
    differ("chart env beyond the smoke test's, not config defaults", sorted(set(chart_env) - set(smoke_env) - config), [])

    differ("image", planner["image"], run["image"])
    differ("command", planner.get("command"), None)
    differ("arguments", planner.get("args", []), run["arguments"])
    return found


def chart_image(docs: list[dict]) -> str:
    (planner,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return planner["image"]


def test_chart_defaults_run_the_image_as_the_smoke_test_ran_it():
    docs = render_chart()
    run = parse_podman_run(podman_run_of_smoke_test(chart_image(docs)))
    assert drift(docs, run, smoke_module()) == []


def test_the_smoke_test_runs_the_image_scripts_image_run_builds_under_the_charts_name():
    """scripts/image/run tags the image batch-planner:<appVersion> and hands that name to the smoke
    test; the chart's default image is the same name."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert chart_image(render_chart()) == f"batch-planner:{app_version}"
    script = (ROOT / "scripts" / "image" / "run").read_text()
    assert "tag=batch-planner:$chart_version" in script
    assert 'scripts/image/smoke_test.py "$tag"' in script


def test_the_image_runs_as_the_charts_user():
    text = (ROOT / "Dockerfile").read_text()
    user = render_chart()
    pod = by_kind(user, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert f"USER {pod['runAsUser']}:{pod['runAsGroup']}" in text


@pytest.mark.parametrize("mutation", [
    "drop --read-only", "run as root", "another probe port", "no tmpfs", "a smaller tmpfs", "another drain",
    "an argument", "another image",
])
def test_drift_is_caught(mutation):
    """The comparison is live: each change to the smoke test's run is reported."""
    docs = render_chart()
    argv = podman_run_of_smoke_test(chart_image(docs))
    smoke = smoke_module()
    image_at = argv.index(chart_image(docs))
    if mutation == "drop --read-only":
        argv.remove("--read-only")
    elif mutation == "run as root":
        argv[argv.index("--user") + 1] = "0:0"
    elif mutation == "another probe port":
        smoke.PORTS = {**smoke.PORTS, "probe": 50053}
    elif mutation == "no tmpfs":
        del argv[argv.index("--tmpfs"):argv.index("--tmpfs") + 2]
    elif mutation == "a smaller tmpfs":
        argv[argv.index("--tmpfs") + 1] = argv[argv.index("--tmpfs") + 1].replace("size=256m", "size=64m")
    elif mutation == "another drain":
        argv[argv.index("PLANNER_DRAIN_SECONDS=20")] = "PLANNER_DRAIN_SECONDS=5"
    elif mutation == "an argument":
        argv.append("--workers=8")
    elif mutation == "another image":
        argv[image_at] = "batch-planner:other"
    assert drift(docs, parse_podman_run(argv), smoke), mutation
