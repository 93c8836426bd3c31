"""Runs the planner image the way the Helm chart's defaults run it, and checks that it serves.

    python scripts/image/smoke_test.py IMAGE            run the container and the checks
    python scripts/image/smoke_test.py --print-podman-run IMAGE
                                                        print the `podman run` arguments (JSON)

The container runs as the chart's pod does: its user (10001:10001), a read-only root filesystem with
a tmpfs on /tmp (the chart's emptyDir, same size), no capabilities and no privilege escalation, the
chart's container ports and its PLANNER_* settings, and the image's own entry point with no
arguments. tests/deploy/test_image_chart_parity.py compares these arguments with the rendered chart.

Checks, each waiting on what it checks (a port answering, health SERVING), never on a fixed sleep:
gRPC health SERVING on the gRPC port and on the probe port (readiness "" and liveness "liveness");
/metrics has the scheduler gauges; `planner-demo` (this Python's, outside the container) gets a
dynamic-CP plan; the container's processes run as the chart's user, not root, and the root
filesystem refuses writes; SIGTERM makes it drain and exit 0 within PLANNER_DRAIN_SECONDS.
Prints the time from `podman run` to SERVING. Run by scripts/image/run (`./dev image`), which sets
the podman configuration; the container is removed however the checks end.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# What the chart's default values render (helm/batch-planner/values.yaml; the parity test checks).
USER = "10001:10001"
PORTS = {"grpc": 50051, "metrics": 9400, "probe": 50052}
TMP_SIZE = "256m"  # tmpVolume.sizeLimit 256Mi
ENV = {
    "PLANNER_HOST": "[::]",
    "PLANNER_PORT": str(PORTS["grpc"]),
    "PLANNER_METRICS_PORT": str(PORTS["metrics"]),
    "PLANNER_PROBE_PORT": str(PORTS["probe"]),
    "PLANNER_WORKERS": "2",
    "PLANNER_DRAIN_SECONDS": "20",
    "TMPDIR": "/tmp",
}
READINESS_SERVICE, LIVENESS_SERVICE = "", "liveness"  # the chart's probes ask these services
STARTUP_SECONDS = 300  # the chart's startup probe: failureThreshold 60 x periodSeconds 5
SCHEDULER_GAUGE = re.compile(r'^batch_planner_scheduler_available\{scheduler="(\w+)"\} (\S+)$', re.M)


class SmokeFailure(Exception):
    pass


def podman_run_args(image: str, name: str, host_ports: dict[str, int]) -> list[str]:
    args = ["podman", "run", "--detach", "--name", name,
            "--user", USER,
            "--read-only", "--tmpfs", f"/tmp:rw,size={TMP_SIZE},mode=1777",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    for port, container_port in PORTS.items():
        args += ["--publish", f"127.0.0.1:{host_ports[port]}:{container_port}"]
    for key, value in ENV.items():
        args += ["--env", f"{key}={value}"]
    return args + [image]  # no command or arguments: the image's ENTRYPOINT, as in the chart


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise SmokeFailure(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def container_state(name: str) -> str:
    return podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()


def health(port: int, service: str) -> str:
    """The health status the port reports for the service, or the gRPC error code's name."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(name: str, host_ports: dict[str, int], started: float) -> float:
    """Polls health until both ports report SERVING; seconds since `started`."""
    deadline = started + STARTUP_SECONDS
    checks = {"grpc": (host_ports["grpc"], READINESS_SERVICE), "probe": (host_ports["probe"], READINESS_SERVICE),
              "probe liveness": (host_ports["probe"], LIVENESS_SERVICE)}
    last: dict[str, str] = {}
    while time.monotonic() < deadline:
        last = {what: health(port, service) for what, (port, service) in checks.items()}
        if all(status == "SERVING" for status in last.values()):
            return time.monotonic() - started
        if container_state(name) != "running":
            raise SmokeFailure(f"the container stopped before SERVING ({container_state(name)}); its log:\n{logs(name)}")
        time.sleep(0.5)  # poll interval, not a wait for the event: the loop ends on SERVING
    raise SmokeFailure(f"not SERVING after {STARTUP_SECONDS} s (the chart's startup probe would give up): {last}")


def logs(name: str) -> str:
    result = podman("logs", name, check=False)
    return (result.stdout + result.stderr)[-6000:]


def check_metrics(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    gauges = {scheduler: float(value) for scheduler, value in SCHEDULER_GAUGE.findall(text)}
    if gauges.get("dynamic_cp") != 1.0:
        raise SmokeFailure(f"/metrics: batch_planner_scheduler_available{{scheduler=\"dynamic_cp\"}} is not 1: {gauges}")
    for gauge in ("batch_planner_in_flight_requests", "batch_planner_busy_workers"):
        if not re.search(rf"^{gauge} \S+$", text, re.M):
            raise SmokeFailure(f"/metrics has no {gauge}")
    return sorted(s for s, v in gauges.items() if v == 1.0)


def check_plan(port: int) -> str:
    demo = Path(sys.executable).parent / "planner-demo"
    result = subprocess.run([str(demo), "--endpoint", f"127.0.0.1:{port}", "--scheduler", "dynamic_cp", "--timeout", "120"],
                            capture_output=True, text=True, timeout=180)
    if result.returncode != 0 or "scheduler=dynamic_cp" not in result.stdout:
        raise SmokeFailure(f"planner-demo got no dynamic-CP plan ({result.returncode}):\n{result.stdout}{result.stderr}")
    return next(line for line in result.stdout.splitlines() if line.startswith("plan "))


def check_user_and_root_filesystem(name: str) -> str:
    uid_gid = podman("exec", name, "sh", "-c", "echo $(id -u):$(id -g)").stdout.strip()
    if uid_gid != USER or uid_gid.startswith("0:"):
        raise SmokeFailure(f"the container runs as {uid_gid}, not the chart's user {USER}")
    pid1 = podman("exec", name, "sh", "-c", "awk '/^Uid:/{print $2}' /proc/1/status").stdout.strip()
    if pid1 != USER.split(":")[0]:
        raise SmokeFailure(f"the server (PID 1) runs as uid {pid1}, not {USER}")
    write = podman("exec", name, "touch", "/opt/venv/written", check=False)
    if write.returncode == 0:
        raise SmokeFailure("the root filesystem took a write: it is not read-only")
    return uid_gid


def check_drain(name: str) -> float:
    drain = float(ENV["PLANNER_DRAIN_SECONDS"])
    sent = time.monotonic()
    podman("kill", "--signal", "TERM", name)
    result = podman("wait", name, timeout=drain + 30, check=False)
    elapsed = time.monotonic() - sent
    log = logs(name)
    if result.returncode != 0 or result.stdout.strip() != "0":
        raise SmokeFailure(f"after SIGTERM the server exited with {result.stdout.strip() or result.stderr.strip()}, not 0:\n{log}")
    if elapsed > drain:
        raise SmokeFailure(f"after SIGTERM the server took {elapsed:.1f} s to exit, more than --drain-seconds {drain:g}")
    if "draining" not in log or "stopped" not in log:
        raise SmokeFailure(f"the server's log does not show a drain (draining ... stopped):\n{log}")
    return elapsed


def smoke(image: str) -> None:
    name = f"batch-planner-smoke-{uuid.uuid4().hex[:8]}"
    host_ports = {port: free_port() for port in PORTS}
    started = time.monotonic()
    podman(*podman_run_args(image, name, host_ports)[1:])
    try:
        serving = wait_serving(name, host_ports, started)
        print(f"smoke: SERVING on the gRPC port and the probe port {serving:.1f} s after podman run", flush=True)
        print(f"smoke: /metrics: scheduler gauges, available: {', '.join(check_metrics(host_ports['metrics']))}", flush=True)
        print(f"smoke: planner-demo from outside the container: {check_plan(host_ports['grpc'])}", flush=True)
        print(f"smoke: runs as {check_user_and_root_filesystem(name)} (not root); the root filesystem refuses writes", flush=True)
        elapsed = check_drain(name)
        print(f"smoke: SIGTERM: drained and exited 0 in {elapsed:.1f} s (--drain-seconds {ENV['PLANNER_DRAIN_SECONDS']})", flush=True)
        print(f"smoke: time to SERVING {serving:.1f} s", flush=True)
    except SmokeFailure:
        print(f"smoke: the container's log:\n{logs(name)}", file=sys.stderr)
        raise
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--print-podman-run":
        print(json.dumps(podman_run_args(argv[1], "batch-planner-smoke", PORTS)))
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        smoke(argv[0])
    except SmokeFailure as failure:
        print(f"smoke: FAILED: {failure}", file=sys.stderr)
        return 1
    print("smoke: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
