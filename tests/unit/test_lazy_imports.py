"""What ``serve`` imports: a part a flag needs is imported when that flag is given (issue 36,
idle RSS). Each case runs in a fresh interpreter, since this one already holds everything.

An idle serve (no rules file, no --probes-from, metrics off) holds neither lightkube,
prometheus_client, PyYAML nor google-re2, and none of the client commands' modules; nor
pydantic, the probe spec's models or the pod sources' modules (httpx2): a rules file brings
PyYAML and pydantic, a pod source pydantic, --metrics-address prometheus_client, ``ps`` the
tables. What each part costs is in docs/benchmarks.md §0 and §11 (bench/idle_rss.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Builds the daemon as ``serve`` does (cli.serve's flags -> ServeConfig, read_rules, Daemon on a
# running loop), then prints the modules this interpreter holds. argv[1]: the rules file or "";
# argv[2:]: --probes-from values.
SERVE_PATH = """
import asyncio, json, sys
from pathlib import Path
import click
from cri_prober.cli import main

main.get_command(click.Context(main), "serve")  # the serve command's module, with its flags
from cri_prober import daemon
from cri_prober.runtime.endpoints import resolve_endpoint

from cri_prober.podspecs.options import PodSourceOptions, parse_source

rules_file = Path(sys.argv[1]) if sys.argv[1] else None
config = daemon.ServeConfig(
    endpoint=resolve_endpoint("unix:///nonexistent/cri.sock"),
    config_file=rules_file,
    listen="unix:///nonexistent/api.sock",
    state_file=None,
    probes_from=tuple(parse_source(text) for text in sys.argv[2:]),
    pod_sources=PodSourceOptions(node_name="node-1"),
)

async def build() -> None:
    daemon.Daemon(config, daemon.read_rules(rules_file))

asyncio.run(build())
print(json.dumps(sorted(sys.modules)))
"""

# The parts an idle serve must not hold, each imported only by the flag or command that needs it.
NOT_WHEN_IDLE = (
    "lightkube",  # --probes-from apiserver
    "prometheus_client",  # --metrics-address
    "cri_prober.serving.metrics_http",
    "yaml",  # a rules file (--config), manifests, a crictl config file, -o yaml
    "re2",  # the API's container filters, on the first request with one
    "cri_prober.cli.tables",  # ps, inspect, watch, health
    "cri_prober.cli.client",
    "cri_prober.cli.check",
    # Issue 36: the probe spec's models, with pydantic, only once a probe is to be validated (a
    # rules file, an annotation, a pod source, RunProbe, a preStop hook).
    "pydantic",
    "pydantic_core",
    "cri_prober.probing.spec.model",
    "cri_prober.probing.spec.rules",
    "cri_prober.probing.spec.lifecycle",
    # --probes-from: the pod sources, their pod model and the kubelet source's HTTP client.
    "cri_prober.podspecs.model",
    "cri_prober.podspecs.registry",
    "cri_prober.podspecs.kubelet_metrics",
    "httpx2",
    # h2: an h2c httpGet or a gRPC probe over TLS, when it runs.
    "h2",
    # tempfile (and shutil, bz2, lzma): where a state file is written; secrets (hmac, hashlib):
    # never, the API's incarnation ID is os.urandom in hex as secrets.token_hex makes it.
    "tempfile",
    "secrets",
)


def modules_after(code: str, *args: str) -> set[str]:
    """The modules a fresh interpreter holds after running *code* with *args*."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    held: list[str] = json.loads(out.stdout.splitlines()[-1])
    return set(held)


def test_an_idle_serve_imports_no_part_a_flag_would_need() -> None:
    held = modules_after(SERVE_PATH, "")
    assert "cri_prober.daemon" in held  # the path was really taken
    assert "cri_prober.cli.serve" in held
    assert sorted(held.intersection(NOT_WHEN_IDLE)) == []


def test_a_rules_file_brings_yaml_and_pydantic(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("probes:\n- livenessProbe: {exec: {command: [ls]}}\n")
    held = modules_after(SERVE_PATH, str(rules))
    assert {"yaml", "pydantic"} <= held
    assert "lightkube" not in held


@pytest.mark.parametrize(
    ("command", "brings"),
    [
        ("ps", "cri_prober.cli.tables"),
        ("check", "cri_prober.cli.check"),
        ("serve", "cri_prober.cli.serve"),
    ],
)
def test_a_command_imports_its_own_module_when_looked_up(command: str, brings: str) -> None:
    code = (
        "import json, sys, click\n"
        "from cri_prober.cli import main\n"
        "before = brings in sys.modules\n"
        "main.get_command(click.Context(main), command)\n"
        "print(json.dumps([*sys.modules, *(['imported-too-early'] if before else [])]))\n"
    )
    held = modules_after(f"command, brings = {command!r}, {brings!r}\n" + code)
    assert brings in held
    assert "imported-too-early" not in held


def test_a_pod_source_brings_pydantic_and_the_pod_model(tmp_path: Path) -> None:
    held = modules_after(SERVE_PATH, "", f"manifests:{tmp_path}")
    assert {"pydantic", "cri_prober.podspecs.model", "cri_prober.podspecs.registry"} <= held
    assert "lightkube" not in held


def test_the_spec_package_gives_the_models_on_first_use() -> None:
    """``cri_prober.probing.spec`` names the models as before; importing the package alone
    does not load them (nor pydantic), naming one does."""
    code = (
        "import json, sys\n"
        "import cri_prober.probing.spec as spec\n"
        "before = sorted(m for m in ('pydantic', 'cri_prober.probing.spec.model') "
        "if m in sys.modules)\n"
        "from cri_prober.probing.spec import Probe, load_rules, parse_annotation\n"
        "from cri_prober.probing.spec.model import Probe as model_probe\n"
        "from cri_prober.probing.spec.rules import parse_annotation as rules_parse\n"
        "try:\n"
        "    spec.NoSuchName\n"
        "    missing = 'found'\n"
        "except AttributeError as exc:\n"
        "    missing = str(exc)\n"
        "print(json.dumps([before, Probe is model_probe, parse_annotation is rules_parse, "
        "load_rules.__module__, missing, 'pydantic' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    before, same_probe, same_parser, loader, missing, loaded = json.loads(
        out.stdout.splitlines()[-1]
    )
    assert before == []
    assert same_probe is True
    assert same_parser is True
    assert loader == "cri_prober.probing.spec.core"
    assert missing == "module 'cri_prober.probing.spec' has no attribute 'NoSuchName'"
    assert loaded is True


def test_metrics_bring_prometheus_client() -> None:
    code = (
        "import json, sys\n"
        "from cri_prober.serving.metrics_http import start_metrics\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    assert "prometheus_client" in modules_after(code)
