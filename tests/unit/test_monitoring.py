"""deploy/monitoring: the alert rules (plain and as a PrometheusRule, the same groups), their
promtool unit tests, and the dashboard's queries (valid PromQL over metrics cri-prober exports).

tests/containerd/test_dashboard.py evaluates every dashboard query against a real Prometheus
scraping a real ``serve``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.monitoring import (
    ALERTS,
    ALERTS_TEST,
    DASHBOARD,
    MONITORING,
    PROMETHEUS_RULE,
    dashboard_queries,
    prometheus_tool,
)

INTERFACE = Path(__file__).resolve().parents[2] / "docs" / "interface.md"
# Series Prometheus itself makes; the rest must be metrics docs/interface.md lists.
PROMETHEUS_SERIES = {"up"}
# Alerts about a whole node (cri-prober, the runtime, a pod source), not one container.
NODE_ALERTS = {
    "CriProberProbeTimeoutsHigh",
    "CriProberCriErrors",
    "CriProberRuntimeUnreachable",
    "CriProberPodSourceStale",
    "CriProberDown",
}
PROMQL_WORDS = {
    "by",
    "on",
    "and",
    "or",
    "unless",
    "sum",
    "count",
    "topk",
    "rate",
    "increase",
    "histogram_quantile",
    "le",
    "label_values",
}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_the_prometheus_rule_holds_the_rules_files_groups() -> None:
    rule = load(PROMETHEUS_RULE)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == load(ALERTS)["groups"]


def test_every_alert_names_what_and_how() -> None:
    """Each alert says which pod/container (or node) in its summary and description, and gives
    a runbook hint; each has a promtool test."""
    tested = {
        case["alertname"]
        for test in load(ALERTS_TEST)["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = [rule for group in load(ALERTS)["groups"] for rule in group["rules"]]
    assert len(alerts) >= 6
    for rule in alerts:
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= annotations.keys(), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert "$labels.instance" in annotations["summary"] + annotations["description"]
        if rule["alert"] not in NODE_ALERTS:
            assert "$labels.container" in annotations["summary"], rule["alert"]
        assert rule["alert"] in tested, f"{rule['alert']} has no firing promtool test"


def test_promtool_rules() -> None:
    """promtool checks the rules and runs alerts_test.yaml (firing and not firing)."""
    promtool = prometheus_tool("promtool")
    for argv in (["check", "rules", ALERTS.name], ["test", "rules", ALERTS_TEST.name]):
        proc = subprocess.run(
            [promtool, *argv], cwd=MONITORING, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every query parses (promtool checks it as a recording rule) and reads only metrics
    cri-prober exports (or Prometheus' own ``up``)."""
    promtool = prometheus_tool("promtool")
    queries = dashboard_queries()
    assert len(queries) >= 15
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{index}", "expr": expr}
                    for index, (_title, expr) in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    proc = subprocess.run(
        [promtool, "check", "rules", "queries.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", INTERFACE.read_text(), re.MULTILINE))
    exprs = [expr for _title, expr in queries] + [
        rule["expr"] for group in load(ALERTS)["groups"] for rule in group["rules"]
    ]
    for expr in exprs:
        without_strings = re.sub(r'"[^"]*"', "", expr)
        names = set(re.findall(r"\b([a-z_]+)\s*(?:\{|\[)", without_strings))
        for name in names - PROMQL_WORDS:
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in documented | PROMETHEUS_SERIES or base in documented, (name, expr)


def test_dashboard_shape() -> None:
    """Every panel queries the chosen data source and filters by the chosen nodes."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"datasource", "instance", "namespace"} <= variables
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
