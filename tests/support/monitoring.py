"""deploy/monitoring for tests: where its files are, the dashboard's queries ready to evaluate,
and Prometheus' binaries (installed as root by scripts/testbed.py, like the other Debian
packages the suite needs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.support.testbed import testbed_script

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
ALERTS_TEST = MONITORING / "alerts_test.yaml"
DASHBOARD = MONITORING / "dashboard.json"

# What Grafana puts in for the dashboard's variables and interval macros: every node and
# namespace, and windows a test's Prometheus (scraping every second) has data for.
SUBSTITUTIONS = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$instance": ".*",
    "$namespace": ".*",
}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, variables substituted."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = str(target["expr"])
            for name, value in SUBSTITUTIONS.items():
                expr = expr.replace(name, value)
            queries.append((str(panel["title"]), expr))
    return queries


def prometheus_tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus`` (Debian's ``prometheus`` package).

    Missing: as root, install it (scripts/testbed.py install, which installs the suite's Debian
    packages without starting their services); as another user, skip loudly.
    """
    found = shutil.which(name)
    if found is None and os.geteuid() == 0:
        subprocess.run(
            [sys.executable, str(testbed_script()), "install", "--version", "1.6"],
            check=True,
            capture_output=True,
            timeout=900,
        )
        found = shutil.which(name)
    if found is None:
        message = f"{name} is missing (apt-get install prometheus, as root): test SKIPPED"
        warnings.warn(message, stacklevel=2)
        pytest.skip(message)
    return found


__all__ = [
    "ALERTS",
    "ALERTS_TEST",
    "DASHBOARD",
    "MONITORING",
    "PROMETHEUS_RULE",
    "dashboard_queries",
    "prometheus_tool",
]
