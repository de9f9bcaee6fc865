"""The first ten minutes, read from the files a newcomer follows: the README's two commands and
its Install section, and a demo that ends on ``inspect`` of its failing container and says how
to reach ``cri-prober`` and its API afterwards (without running the demo, which needs root).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DEMO = (ROOT / "scripts" / "demo.sh").read_text()


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_quickstart_is_still_two_commands() -> None:
    (block,) = re.findall(r"```sh\n(.*?)```", section("Quickstart"), re.S)[:1]
    assert block.split("\n")[:2] == ["scripts/demo.sh", "scripts/test"]
    assert block.strip().count("\n") == 1


def test_install_names_pip_the_image_and_the_daemonset() -> None:
    """Install comes right after Quickstart and covers each way in, naming files that exist."""
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[headings.index("Quickstart") + 1] == "Install"
    install = section("Install")
    for text in ("pip install .", "pip wheel", "docker build", "scripts/image-test",
                 "CRI_PROBER_ADDRESS"):  # fmt: skip
        assert text in install, text
    linked = re.findall(r"\]\(([^)#]+)\)", install)
    for path in [*linked, "deploy/kubernetes/daemonset-podspecs.yaml"]:
        assert (ROOT / path).exists(), path


def cli_commands() -> list[list[str]]:
    """Each ``"$cli" ...`` command the demo runs, in order, as words (up to a pipe; the first
    line of one that continues)."""
    return [
        line.split('"$cli"', 1)[1].split("|")[0].split()
        for line in DEMO.splitlines()
        if '"$cli"' in line and not line.lstrip().startswith("#")
    ]


def test_demo_uses_the_environment_for_the_api_address() -> None:
    assert "export CRI_PROBER_ADDRESS=$api" in DEMO
    assert all("--address" not in words for words in cli_commands())


def test_demo_ends_on_inspect_of_its_failing_container() -> None:
    """The last command is ``inspect`` of the worker, the container whose liveness fails."""
    last = cli_commands()[-1]
    assert last[:2] == ["inspect", "demo/worker/main"]
    rules = yaml.safe_load((ROOT / "examples" / "demo" / "rules.yaml").read_text())["probes"]
    (worker,) = [r for r in rules if r["match"] == {"namespace": "demo", "pod": "worker",
                                                     "container": "main"}]  # fmt: skip
    assert worker["livenessProbe"]["exec"]["command"] == ["cat", "/tmp/alive"]
    assert "rm /tmp/alive" in (ROOT / "scripts" / "demo_pods.py").read_text()


def test_demo_closes_with_the_two_lines_to_paste() -> None:
    """Both endings (with --keep and without) print the PATH and CRI_PROBER_ADDRESS lines."""
    closing = DEMO[DEMO.rindex('"$cli" inspect') :]
    assert closing.count("export PATH=$repo/.venv/bin:\\$PATH") == 2
    assert closing.count("export CRI_PROBER_ADDRESS=$api") == 2


def test_demo_prints_the_runtime_endpoint_to_paste_too() -> None:
    """Issue 35: after ``--keep``, ``cri-prober check`` needs the runtime endpoint: both endings
    print ``CONTAINER_RUNTIME_ENDPOINT`` beside the other lines to paste."""
    closing = DEMO[DEMO.rindex('"$cli" inspect') :]
    assert closing.count("export CONTAINER_RUNTIME_ENDPOINT=$endpoint") == 2
    assert "endpoint=unix://$demo_dir/containerd/containerd.sock" in DEMO


def test_long_installs_say_so_and_show_pips_progress_on_a_terminal() -> None:
    """Issue 35: every pip install of scripts/test and the demo is announced by a line of its
    own, and runs without -q on a terminal (pip's progress bars); -q is kept for logs."""
    test_script = (ROOT / "scripts" / "test").read_text()
    for script in (test_script, DEMO):
        lines = script.splitlines()
        installs = [i for i, line in enumerate(lines) if "pip install" in line]
        assert installs
        for i in installs:
            assert "pip" in lines[i - 1] or "pip" in lines[i - 2], lines[i]
        assert "[ -t 1 ]" in script
    assert "pip install -q" not in test_script
