"""The documentation against the code: docs/metrics.md names every metric of the planner's and the
trainer client's registries with its labels, and nothing else; the README's file table names every
module of the three packages."""

from __future__ import annotations

import re
from pathlib import Path

from planner_server.metrics import PlannerMetrics
from trainer_client.service.metrics import TrainerMetrics

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = re.compile(r"`(batch_planner_[a-z_]+)(?:\{([a-z_,]*)\})?`")


def registered() -> dict[str, tuple[str, ...]]:
    """Every metric family of both registries: its exposed name and its label names, in order."""
    found: dict[str, tuple[str, ...]] = {}
    for registry in (PlannerMetrics().registry, TrainerMetrics().registry):
        for collector in registry._collector_to_names:
            if not hasattr(collector, "_labelnames"):
                continue  # process and platform collectors: not ours
            suffix = {"counter": "_total", "info": "_info"}.get(collector._type, "")
            found[collector._name + suffix] = tuple(collector._labelnames)
    return found


def documented() -> dict[str, tuple[str, ...]]:
    page = (ROOT / "docs" / "metrics.md").read_text()
    return {name: tuple(labels.split(",")) if labels else () for name, labels in DOCUMENTED.findall(page)}


def test_the_metrics_page_lists_every_metric_with_its_labels():
    code, page = registered(), documented()
    assert sorted(set(code) - set(page)) == [], "registered but not on docs/metrics.md"
    assert sorted(set(page) - set(code)) == [], "on docs/metrics.md but not registered"
    info = "batch_planner_info"  # an Info's labels are its values, set at start-up (server.py)
    wrong = {name: (page[name], labels) for name, labels in code.items() if name != info and page[name] != labels}
    assert wrong == {}, "labels on the page differ from the code's (page, code)"
    assert page[info] == ("version", "megatron_core_version", "schedulers")


def test_the_readme_file_table_names_every_module():
    readme = (ROOT / "README.md").read_text()
    rows = {row.split("|")[1].strip(" `"): row for row in readme.splitlines() if row.startswith("| `")}
    missing = []
    for package in ("batch_planner", "planner_server", "trainer_client"):
        row = rows[f"{package}/"]
        for path in sorted((ROOT / package).iterdir()):
            if path.name.startswith(("_", ".")) and path.name != "__main__.py" or path.name == "v1":
                continue  # __init__.py, caches; v1/ is the generated code, in the proto row
            name = path.name if path.suffix == ".py" else f"{path.name}/"
            if (path.suffix == ".py" or path.is_dir()) and f"`{name}`" not in row:
                missing.append(f"{package}/{name}")
    assert missing == [], "modules the README's file table does not name"
