"""The package's shape: no import circles, and the layer contracts of pyproject.toml enforced.

``lint-imports`` runs in the test command too; these tests show that it fails on a violation
and that no two modules import each other, directly or through others.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

import cri_prober

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if not imported.startswith("cri_prober"):
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module.startswith("cri_prober") and module not in index:
            visit(module)
    return groups


def test_no_import_circles() -> None:
    graph = grimp.build_graph("cri_prober")
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle(tmp_path: Path) -> None:
    """The check above can fail: two modules importing each other are reported."""
    package = tmp_path / "cri_prober"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cri_prober import b\n")
    (package / "b.py").write_text("from cri_prober import a\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import grimp, json, sys; sys.path.insert(0, sys.argv[1]);"
            "from tests.unit.test_architecture import _cycles;"
            "print(json.dumps(_cycles(grimp.build_graph('cri_prober'))))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip() == '[["cri_prober.a", "cri_prober.b"]]'


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        # Run from where the package under test is, so that copy is the one analysed.
        cwd=package_parent,
        env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def test_layer_contracts_hold() -> None:
    result = _lint_imports(Path(cri_prober.__file__).parents[1])
    assert result.returncode == 0, result.stdout
    assert "0 broken" in result.stdout


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "cri_prober"
    shutil.copytree(
        Path(cri_prober.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__")
    )
    return copy


# (the module that gets the import, what it imports, the contract that must break)
VIOLATIONS = [
    pytest.param(
        "runtime/endpoints.py",
        "cri_prober.probing.worker",
        "runtime never imports probing (or anything above it)",
        id="runtime-imports-probing",
    ),
    pytest.param(
        # Probing may not reach the runtime even through discovery (whose model is built on it).
        "probing/kinds.py",
        "cri_prober.discovery.model",
        "probing imports nothing from the runtime, directly or through discovery",
        id="probing-imports-discovery",
    ),
    pytest.param(
        # Serving may use the manager's Protocol, read models and events, not its classes.
        "serving/snapshot.py",
        "cri_prober.manager.probe_manager",
        "serving reaches the manager only through its Protocol (manager.api), read models "
        "(state) and events",
        id="serving-imports-the-manager",
    ),
]


@pytest.mark.parametrize(("module", "imported", "contract"), VIOLATIONS)
def test_a_deliberate_violation_breaks_its_contract(
    tmp_path: Path, module: str, imported: str, contract: str
) -> None:
    """Each contract can fail: a copy of the package with one forbidden import breaks it, names
    the import, and the run fails."""
    copy = _copy_package(tmp_path)
    path = copy / module
    path.write_text(path.read_text() + f"\nimport {imported}  # deliberate violation\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in " ".join(result.stdout.split())
    importer = "cri_prober." + module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {imported}" in result.stdout


def test_the_diagram_in_docs_matches_the_layer_contract() -> None:
    """docs/architecture.md draws the layers top to bottom in the contract's order."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layers] = [
        contract["layers"]
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract["type"] == "layers"
    ]
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("```\n", 2)[1]
    drawn = [
        match.group(1)
        for line in diagram.splitlines()
        if (match := re.match(r"^ (\w+)(?:/|\.py)\s", line))
    ]
    assert drawn == [layer.removeprefix("cri_prober.") for layer in layers]
