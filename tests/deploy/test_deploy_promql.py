"""Every PromQL expression the dashboard and the alert rules use: valid for promtool, alerts unit-
tested, and naming only metrics that the planner and the trainer client really export."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client import CollectorRegistry

from planner_server.metrics import PlannerMetrics
from tests.support.deploy_tools import ALERTS, DASHBOARD, ROOT, find_tool, run
from trainer_client.service.metrics import TrainerMetrics

# Grafana's variables, replaced by what they stand for so promtool can parse the expressions.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$training_job": ".*"}
METRIC_NAME = re.compile(r"\bbatch_planner_[a-zA-Z0-9_]+\b")
# What docs/design.md (Metrics) asks the dashboard to show, by the metrics each needs.
REQUIRED_DASHBOARD_METRICS = {
    "batch_planner_padding_tokens_total", "batch_planner_client_padding_tokens_total",  # padding waste
    "batch_planner_alignment_padding_tokens_total",  # of it, FP8's row alignment
    "batch_planner_client_tokens_total", "batch_planner_client_tokens_per_second",  # tokens per second
    "batch_planner_plan_latency_seconds_bucket",  # plan latency p50/p99
    "batch_planner_requests_total",  # requests and errors by code
    "batch_planner_client_fallbacks_total",  # fallbacks
    "batch_planner_balance_efficiency_ratio_sum",  # balance efficiency
    "batch_planner_predicted_speedup_over_static_cp_ratio_sum",  # speedup over static CP
    "batch_planner_planned_samples_total",  # CP-size mix
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exposes, by metric type (labelled metrics have no samples
    until used, so the names come from the families, not from a scrape)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",), "gauge": ("",)}
    names = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found.append((f"{panel['title']} / {target['refId']}", expr))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((\w+), *\w+\)", query)
            assert match, f"variable {variable['name']}: unexpected query {query}"
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def alert_expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check():
    result = run([find_tool("promtool"), "check", "rules", str(ALERTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_expressions())} rules found" in result.stdout


def test_alert_rules_unit_tests_pass():
    result = run([find_tool("promtool"), "test", "rules", str(ROOT / "tests" / "deploy" / "prometheus" / "alerts_test.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_the_alerts_the_design_asks_for_exist():
    names = {name for name, _ in alert_expressions()}
    assert {"BatchPlannerDown", "BatchPlannerHighErrorRatio", "BatchPlannerHighFallbackRate",
            "BatchPlannerInvariantViolation", "BatchPlannerSlowPlans", "BatchPlannerPlanLeadShrinking"} <= names


def test_every_dashboard_expression_passes_promtool(tmp_path):
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(expressions)
    ]}]}
    rule_file = tmp_path / "dashboard_rules.yml"
    rule_file.write_text(yaml.safe_dump(rules))
    result = run([find_tool("promtool"), "check", "rules", str(rule_file)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def test_promtool_rejects_a_broken_expression(tmp_path):
    rule_file = tmp_path / "broken.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:y", "expr": "sum by (le (rate(batch_planner_requests_total[1m]))"}]}]}))
    assert run([find_tool("promtool"), "check", "rules", str(rule_file)]).returncode != 0


def test_every_metric_the_dashboard_and_alerts_use_is_exported():
    exported = exported_names(PlannerMetrics().registry) | exported_names(TrainerMetrics().registry)
    assert "batch_planner_info" in exported and "batch_planner_requests_total" in exported
    for where, expr in dashboard_expressions() + alert_expressions():
        for name in METRIC_NAME.findall(expr):
            assert name in exported, f"{where}: {name} is not exported by planner_server or trainer_client"


def test_dashboard_shows_what_the_design_asks_for():
    used = {name for _, expr in dashboard_expressions() for name in METRIC_NAME.findall(expr)}
    missing = REQUIRED_DASHBOARD_METRICS - used
    assert not missing, f"dashboard has no panel using {sorted(missing)}"


@pytest.mark.parametrize("quantile", ["0.5", "0.99"])
def test_dashboard_shows_plan_latency_quantile(quantile):
    assert any(f"histogram_quantile({quantile}, sum by (le, scheduler) (rate(batch_planner_plan_latency_seconds_bucket" in expr
               for _, expr in dashboard_expressions())


def test_every_alert_links_a_runbook_section_that_exists():
    """runbook_url names docs/<file>#<anchor>, and that heading is in that file."""
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert alerts
    for rule in alerts:
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path.startswith("docs/") and (ROOT / path).is_file(), (rule["alert"], url)
        headings = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)}
        assert anchor in headings, (rule["alert"], anchor, sorted(headings))
