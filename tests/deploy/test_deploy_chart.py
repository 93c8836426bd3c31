"""The Helm chart: lints, renders, validates against Kubernetes and prometheus-operator schemas
offline, and keeps the promises the deployment makes (probes, security, drain, every setting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest
import yaml

from planner_server.config import ServerConfig, build_parser, config_from_args
from tests.support.deploy_tools import (
    ALERTS, ALL_ON_VALUES, CHART, DASHBOARD, ROOT, by_kind, crd_validator_modules, find_tool, render_chart,
    run,
)

VALUE_SETS = {"default": None, "all-on": str(ALL_ON_VALUES)}
# Oldest Kubernetes the chart supports (native gRPC probes are GA in 1.27) and a current one.
KUBERNETES_VERSIONS = ("1.27.0", "1.34.0")
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
SET_BY_CHART = {"host", "port", "metrics_port", "probe_port", "tls_cert_file", "tls_key_file", "tls_client_ca_file"}


def container(docs: list[dict]) -> dict:
    (planner,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return planner


def env_of(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(docs)["env"]}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_strict(values):
    cmd = [find_tool("helm"), "lint", "--strict", str(CHART)]
    if VALUE_SETS[values]:
        cmd += ["-f", VALUE_SETS[values]]
    result = run(cmd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_all_on_values_render_every_template():
    kinds = {d["kind"] for d in render_chart(str(ALL_ON_VALUES))}
    assert kinds == {
        "Deployment", "Service", "ServiceAccount", "HorizontalPodAutoscaler", "PodDisruptionBudget",
        "NetworkPolicy", "ConfigMap", "ServiceMonitor", "PrometheusRule",
    }


def test_optional_parts_are_off_by_default():
    kinds = {d["kind"] for d in render_chart()}
    assert not kinds & {"HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_manifests_validate_against_kubernetes_schemas(values, version, tmp_path):
    docs = [d for d in render_chart(VALUE_SETS[values]) if d["kind"] not in PROMETHEUS_OPERATOR_KINDS]
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    result = run([find_tool("kubernetes-validate"), "--strict", "-k", version, str(manifest)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(docs), result.stdout


def test_kubernetes_validate_rejects_an_unknown_field(tmp_path):
    """The validator really checks (strict mode rejects a misspelt field)."""
    docs = render_chart()
    container(docs)["readinesProbe"] = {"grpc": {"port": 50051}}
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    result = run([find_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[-1], str(manifest)])
    assert result.returncode != 0
    assert "readinesProbe" in result.stdout + result.stderr


def _validate_prometheus_operator(objects: list[dict]) -> subprocess.CompletedProcess:
    modules = crd_validator_modules()
    script = ROOT / "tests" / "deploy" / "validate_prometheus_operator.mjs"
    return run([find_tool("node"), str(script), str(modules)], input=json.dumps(objects))


def test_servicemonitor_and_prometheusrule_validate_against_prometheus_operator_schemas():
    objects = [d for d in render_chart(str(ALL_ON_VALUES)) if d["kind"] in PROMETHEUS_OPERATOR_KINDS]
    assert {o["kind"] for o in objects} == PROMETHEUS_OPERATOR_KINDS
    result = _validate_prometheus_operator(objects)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("VALID ") == 2 and "INVALID" not in result.stdout


def test_prometheus_operator_validator_rejects_a_wrong_type():
    (monitor,) = [d for d in render_chart(str(ALL_ON_VALUES)) if d["kind"] == "ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = 15  # must be a duration string
    result = _validate_prometheus_operator([monitor])
    assert result.returncode == 1
    assert "INVALID ServiceMonitor" in result.stdout and "interval" in result.stdout


def test_prometheusrule_embeds_the_alerts_file_verbatim():
    rule = by_kind(render_chart(str(ALL_ON_VALUES)), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())


def test_dashboard_configmap_carries_the_dashboard_for_the_grafana_sidecar():
    config_map = by_kind(render_chart(str(ALL_ON_VALUES)), "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["batch-planner.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("values", VALUE_SETS)
def test_pod_runs_non_root_read_only_without_privileges(values):
    docs = render_chart(VALUE_SETS[values])
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    planner = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    security = planner["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    # The forkserver needs a writable temporary directory on the read-only root filesystem.
    assert {"name": "tmp", "mountPath": "/tmp"} in planner["volumeMounts"]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert planner["resources"]["requests"]["cpu"] and planner["resources"]["limits"]["memory"]
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} >= {"kubernetes.io/hostname"}


def test_probes_ask_the_plaintext_probe_port_for_readiness_and_liveness_apart():
    """probes are gRPC health checks on the probe port with TLS on or off (never a TCP
    check that passes before the server can plan); liveness is its own service."""
    for docs in (render_chart(), render_chart(str(ALL_ON_VALUES))):
        planner = container(docs)
        for probe in ("startupProbe", "readinessProbe"):
            assert planner[probe]["grpc"] == {"port": 50052}, probe
        assert planner["livenessProbe"]["grpc"] == {"port": 50052, "service": "liveness"}
        assert env_of(docs)["PLANNER_PROBE_PORT"] == "50052"
        assert {"name": "probe", "containerPort": 50052, "protocol": "TCP"} in planner["ports"]


def test_tls_server_gets_its_certificates_mounted():
    docs = render_chart(str(ALL_ON_VALUES))
    planner = container(docs)
    env = env_of(docs)
    mounts = {m["name"]: m["mountPath"] for m in planner["volumeMounts"]}
    assert env["PLANNER_TLS_CERT_FILE"] == mounts["tls"] + "/tls.crt"
    assert env["PLANNER_TLS_KEY_FILE"] == mounts["tls"] + "/tls.key"
    assert env["PLANNER_TLS_CLIENT_CA_FILE"] == mounts["client-ca"] + "/ca.crt"
    volumes = {v["name"]: v for v in by_kind(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "batch-planner-tls"
    assert volumes["client-ca"]["secret"]["secretName"] == "trainer-client-ca"


def test_plaintext_is_the_default():
    env = env_of(render_chart())
    assert not any(name.startswith("PLANNER_TLS_") for name in env)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_termination_grace_outlasts_pre_stop_sleep_and_drain(values):
    docs = render_chart(VALUE_SETS[values])
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    sleep = int(container(docs)["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(env_of(docs)["PLANNER_DRAIN_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] > sleep + drain


def test_chart_refuses_a_grace_period_shorter_than_the_drain():
    result = run([find_tool("helm"), "template", "rel", str(CHART), "--set", "config.drain_seconds=60"])
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds" in result.stderr


def test_schema_rejects_an_unknown_setting_and_a_wrong_type():
    for bad in ("config.max_sampels_per_request=5", "config.workers=many"):
        result = run([find_tool("helm"), "template", "rel", str(CHART), "--set", bad])
        assert result.returncode != 0, bad
        assert "schema" in result.stderr, result.stderr


def test_a_rollout_surges_one_ready_pod_before_an_old_one_goes_and_disruptions_take_one():
    """docs/runbook.md, "During a rollout": the defaults tests/planner_server/test_reliability_rollout.py rolls by."""
    docs = render_chart()
    assert by_kind(docs, "Deployment")["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert by_kind(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert by_kind(docs, "Deployment")["spec"]["replicas"] >= 2  # one disrupted, one serving
    custom = render_chart(None, "updateStrategy.maxSurge=25%", "updateStrategy.maxUnavailable=1")
    assert by_kind(custom, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}


def test_headless_service_resolves_to_pods_for_client_side_round_robin():
    docs = render_chart()
    headless = by_kind(docs, "Service", "-headless")
    assert headless["metadata"]["name"] == "rel-batch-planner-headless"
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [50051]
    main = by_kind(docs, "Service", "rel-batch-planner")
    assert main["spec"]["type"] == "ClusterIP"
    assert headless["spec"]["selector"] == main["spec"]["selector"]


def test_servicemonitor_scrapes_each_pod_once_as_job_batch_planner():
    docs = render_chart(str(ALL_ON_VALUES))
    monitor = by_kind(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"]
    selected = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["rel-batch-planner"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert {"targetLabel": "job", "replacement": "batch-planner"} in endpoint["relabelings"]


def test_pdb_hpa_and_network_policy_target_the_planner_pods():
    docs = render_chart(str(ALL_ON_VALUES))
    pod_labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert by_kind(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    assert by_kind(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert by_kind(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind(docs, "Deployment")["metadata"]["name"]
    assert "replicas" not in by_kind(docs, "Deployment")["spec"]  # the HPA owns the replica count


def test_values_schema_lists_every_server_setting_with_its_type():
    schema = json.loads((CHART / "values.schema.json").read_text())
    config_schema = schema["properties"]["config"]["properties"]
    json_type = {int: "integer", float: "number", str: "string"}
    flags = {a.dest: a.type for a in build_parser()._actions if a.dest not in ("help", "version")}
    assert set(config_schema) == set(flags) - SET_BY_CHART
    for name, schema_entry in config_schema.items():
        assert schema_entry["type"] == json_type[flags[name]], name


def test_every_server_setting_reaches_the_server_from_values():
    """Renders all-on values, then parses the container's environment with the server's own
    config code: every setting must arrive with the value the values file gave it."""
    values = yaml.safe_load(ALL_ON_VALUES.read_text())
    env = env_of(render_chart(str(ALL_ON_VALUES)))
    flags = {a.dest for a in build_parser()._actions if a.dest not in ("help", "version")}
    assert {"PLANNER_" + flag.upper() for flag in flags} <= set(env)
    code = (
        "import json, dataclasses; from planner_server.config import config_from_args; "
        "print(json.dumps(dataclasses.asdict(config_from_args([]))))"
    )
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("PLANNER_")}
    result = subprocess.run([sys.executable, "-c", code], env={**clean_env, **env, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    flat = {**parsed.pop("limits"), **parsed.pop("cost_model"), **parsed}
    for name, value in values["config"].items():
        assert flat[name] == pytest.approx(value) if isinstance(value, float) else flat[name] == value, name
    assert flat["port"] == 50051 and flat["metrics_port"] == 9400 and flat["host"] == "[::]"
    assert flat["tls_client_ca_file"] == "/etc/batch-planner/client-ca/ca.crt"


def test_default_config_values_match_the_server_defaults():
    """values.yaml documents the server's defaults (except workers, pinned to the CPU request)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    defaults = ServerConfig()
    flat = {f.name: getattr(defaults, f.name) for f in fields(defaults) if f.name not in ("limits", "cost_model")}
    flat.update({f.name: getattr(defaults.limits, f.name) for f in fields(defaults.limits)})
    flat.update({f.name: getattr(defaults.cost_model, f.name) for f in fields(defaults.cost_model)})
    for name, value in values.items():
        if name == "workers":
            continue
        assert value == pytest.approx(flat[name]), name
    assert config_from_args([]).limits == defaults.limits


def test_deployment_doc_lists_every_server_setting():
    doc = (ROOT / "docs" / "deployment.md").read_text()
    for action in build_parser()._actions:
        if action.dest in ("help", "version") or action.dest in SET_BY_CHART:
            continue
        assert f"| `config.{action.dest}` | `PLANNER_{action.dest.upper()}` |" in doc, action.dest
