"""End to end: a real Prometheus (Debian's package) on loopback scrapes a real planner, with the
chart's alert rules loaded; the padding and throughput series must arrive with the values the
Plan responses reported, and the dashboard's queries must compute the same figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from batch_planner.convert import request_to_proto
from batch_planner.distributions import sample_lengths
from batch_planner.request import CpLayout, PlanRequest, SchedulerKind
from batch_planner.v1 import planner_pb2_grpc
from tests.support.deploy_tools import ALERTS, DASHBOARD, ROOT, find_tool
from tests.support.planner_process import PlannerProcess, planner_env
from tests.support.reliability_support import wait_until
from tests.support.launch import free_port

JOB = "deploy-e2e"
SCRAPE_JOB = "batch-planner"  # what the alerts select; the chart's ServiceMonitor names it so
TRAIN_LOOP = ROOT / "examples" / "train_loop.py"


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()
            ],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [find_tool("prometheus"), f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.workdir = workdir
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + (self.workdir / "prometheus.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(ready, timeout, "prometheus to be ready", poll=0.2)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for_value(self, expr: str, expected: float, timeout: float = 20.0, rel: float = 1e-9) -> float:
        """Polls until the expression's single value equals `expected`; returns it."""
        seen: list[float] = []

        def equal() -> bool:
            result = self.query(expr)
            if len(result) == 1:
                seen.append(float(result[0]["value"][1]))
                return math.isclose(seen[-1], expected, rel_tol=rel)
            return False

        try:
            wait_until(equal, timeout, f"{expr} = {expected}", poll=0.25)
        except AssertionError as error:
            raise AssertionError(f"{error}; last seen: {seen[-1:]}") from None
        return seen[-1]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture()
def prometheus_for(tmp_path):
    started = []

    def start(targets: dict[str, str]) -> Prometheus:
        prom = Prometheus(tmp_path, targets)
        started.append(prom)
        return prom

    yield start
    for prom in started:
        prom.stop()


def plan_request(seed: int) -> PlanRequest:
    return PlanRequest.of(
        sequence_lengths=tuple(sample_lengths("long_tail_16k", 48, seed)),
        # TP=2 pads every odd-length sample: the padding series are not all zero.
        data_parallel_size=4, context_parallel_size=2, tensor_parallel_size=2, max_seqlen_per_dp_cp_rank=16384,
        scheduler=SchedulerKind.HYBRID_CP, cp_layout=CpLayout.ZIGZAG, job=JOB,
    )


def dashboard_expr(title: str) -> str:
    panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title and p["type"] == "stat")
    return panel["targets"][0]["expr"].replace("$training_job", JOB).replace("$__rate_interval", "10m")


def test_prometheus_scrapes_planner_padding_and_throughput(planner: PlannerProcess, prometheus_for):
    find_tool("promtool")  # the Debian package; fail early with the install hint if it is missing
    prom = prometheus_for({SCRAPE_JOB: f"127.0.0.1:{planner.metrics_port}"})
    sel = f'job="{SCRAPE_JOB}", training_job="{JOB}"'
    prom.wait_for_value(f'up{{job="{SCRAPE_JOB}"}}', 1)

    requests = [plan_request(seed) for seed in (1, 2, 3)]
    padding = []
    with grpc.insecure_channel(planner.address) as channel:
        stub = planner_pb2_grpc.BatchPlannerStub(channel)

        def plan(request: PlanRequest) -> None:
            stats = stub.Plan(request_to_proto(request), timeout=60).statistics
            assert stats.real_tokens == sum(request.sequence_lengths)
            padding.append(stats.padded_tokens - stats.real_tokens)

        # The first plan, then a scrape of it, then two more: the dashboard's rate()-based
        # queries then see exactly the second and third plans.
        plan(requests[0])
        prom.wait_for_value(f"sum(batch_planner_planned_tokens_total{{{sel}}})", sum(requests[0].sequence_lengths))
        for request in requests[1:]:
            plan(request)

    real = [sum(r.sequence_lengths) for r in requests]
    assert sum(padding) > 0, "the test batches should need padding (TP=2, odd lengths)"
    prom.wait_for_value(f"sum(batch_planner_planned_tokens_total{{{sel}}})", sum(real))
    prom.wait_for_value(f"sum(batch_planner_padding_tokens_total{{{sel}}})", sum(padding))
    prom.wait_for_value(f'sum(batch_planner_requests_total{{{sel}, code="OK"}})', 3)
    prom.wait_for_value(f"sum(batch_planner_planned_samples_total{{job=\"{SCRAPE_JOB}\"}}) >= {3 * 48}", 3 * 48,
                        rel=1)  # other tests share this planner: at least our samples
    prom.wait_for_value(f'count(batch_planner_info{{job="{SCRAPE_JOB}"}})', 1)

    # The dashboard's own queries, on real data: padding waste over the last two plans.
    expected_waste = sum(padding[1:]) / (sum(padding[1:]) + sum(real[1:]))
    waste = prom.query(dashboard_expr("Planner padding waste"))
    assert len(waste) == 1
    # rate() extrapolates each counter to the window's edges with its own zero-point limit, so
    # a ratio of two rates is close to, not exactly, the ratio of the increases.
    assert float(waste[0]["value"][1]) == pytest.approx(expected_waste, rel=0.1)

    # The alert rules load and evaluate against this data without errors; none fires.
    def evaluated() -> list[dict]:
        rules = [rule for group in prom.api("rules")["groups"] for rule in group["rules"]]
        return rules if rules and all(rule.get("lastEvaluation", "").startswith("20") for rule in rules) else []

    rules = wait_until(evaluated, 30, "every alert rule evaluated once", poll=0.25)
    assert len(rules) == len([r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]])
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert prom.api("alerts")["alerts"] == []


TRAIN_LOOP_FLAGS = ("--planner-endpoint", "--metrics-port", "--steps", "--batch-size", "--distribution", "--linger-seconds")


def _train_loop_missing() -> str:
    """Why the trainer test cannot run, or "". A marker, not a fixture: session fixtures (the
    planner) would start before a fixture's skip. Reads the file instead of running --help, which
    would import torch once more."""
    if not TRAIN_LOOP.is_file():
        return f"{TRAIN_LOOP.relative_to(ROOT)} is not in this checkout"
    source = TRAIN_LOOP.read_text()
    if not all(f'"{flag}"' in source for flag in TRAIN_LOOP_FLAGS):
        return f"{TRAIN_LOOP.relative_to(ROOT)} lacks one of the flags {TRAIN_LOOP_FLAGS} this test drives it with"
    return ""


@pytest.mark.skipif(bool(_train_loop_missing()), reason=_train_loop_missing() or "-")
def test_prometheus_scrapes_the_example_trainer(planner: PlannerProcess, prometheus_for, tmp_path):
    """The trainer side: examples/train_loop.py (one process playing both ranks of a DPxCP group of
    2) trains a few steps against the planner while Prometheus scrapes it. It counts every rank's
    real tokens, so the tokens series must equal the lengths of all its batches."""
    metrics_port, steps, batch_size, distribution = free_port(), 4, 32, "long_tail_16k"
    log_path = tmp_path / "trainer.log"
    with log_path.open("w") as log:
        trainer = subprocess.Popen(
            [sys.executable, str(TRAIN_LOOP), "--planner-endpoint", planner.address, "--metrics-port", str(metrics_port),
             "--steps", str(steps), "--batch-size", str(batch_size), "--distribution", distribution,
             "--linger-seconds", "60"],
            cwd=ROOT, env=planner_env(), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        prom = prometheus_for({SCRAPE_JOB: f"127.0.0.1:{planner.metrics_port}", "trainers": f"127.0.0.1:{metrics_port}"})
        sel = 'job="trainers"'
        def planned() -> bool:
            plans = prom.query(f"sum(batch_planner_client_plans_total{{{sel}}})")
            assert trainer.poll() in (None, 0), log_path.read_text()[-3000:]
            return bool(plans) and float(plans[0]["value"][1]) >= steps

        wait_until(planned, 90, "the trainer's plans to reach Prometheus", poll=0.5)
        expected_tokens = sum(sum(sample_lengths(distribution, batch_size, seed=step)) for step in range(steps))
        # The last plan arrives before the last step has trained: on a loaded CI machine a CPU step
        # can take tens of seconds, so wait for the tokens themselves, not a fixed few seconds.
        prom.wait_for_value(f"sum(batch_planner_client_tokens_total{{{sel}}})", expected_tokens, timeout=180)
        padding = prom.query(f"sum(batch_planner_client_padding_tokens_total{{{sel}}})")
        assert padding and 0 < float(padding[0]["value"][1]) < expected_tokens
        assert float(prom.query(f"sum(batch_planner_client_tokens_per_second{{{sel}}})")[0]["value"][1]) > 0
        # The trainer's training job arrives as its own training_job label, as the dashboard expects.
        assert {r["metric"].get("training_job") for r in prom.query(f"batch_planner_client_tokens_total{{{sel}}}")} != {None}
        # The plan lead: one observation per step the trainer asked for, through Prometheus.
        lead = prom.query(f"sum(batch_planner_client_plan_lead_seconds_count{{{sel}}})")
        assert lead and float(lead[0]["value"][1]) >= steps
        assert prom.query(f"sum(batch_planner_client_late_plans_total{{{sel}}})")
        # The dashboard's trainer padding-waste query answers for this data, once Prometheus holds two
        # scrapes of the counters (rate() needs two samples): wait for that, do not guess it.
        waste = dashboard_expr("Trainer padding waste").replace(f'training_job=~"{JOB}"', 'training_job=~".*"')
        wait_until(lambda: prom.query(waste), 120, "the dashboard's padding-waste query to answer", poll=0.5)
    finally:
        trainer.terminate()
        try:
            trainer.wait(20)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait(5)
