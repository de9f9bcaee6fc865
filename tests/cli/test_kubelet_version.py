"""Which kubelet's probe behaviour serve follows: --kubelet-version and --kubelet-feature-gates
(bad values exit 2 with one line), and what ``version`` and ``inspect`` say of it (issue 37)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_prober.daemon import Daemon
from cri_prober.probing.kubelet_profile import KubeletProfile
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer
from tests.support.serve import run_cli

RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--kubelet-version", "1.27"],
            "--kubelet-version '1.27': cri-prober follows kubelet 1.28",
        ),
        (["--kubelet-version", "latest"], "--kubelet-version 'latest': not a Kubernetes version"),
        (["--kubelet-feature-gates", "Nope=true"], "'Nope': not a gate that changes probing"),
        (
            ["--kubelet-version", "1.36", "--kubelet-feature-gates", "ExecProbeTimeout=false"],
            "ExecProbeTimeout=false: locked to true in kubelet 1.36",
        ),
    ],
    ids=["too-old", "not-a-version", "unknown-gate", "locked-gate"],
)
async def test_bad_kubelet_flags_exit_2_with_one_line(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    result = await run_cli("serve", "-r", f"unix://{tmp_path}/none.sock", *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.fixture(name="daemon")
async def _daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    runtime = FakeRuntime()
    runtime.add_container(runtime.add_sandbox("web"), "app")
    kubelet = KubeletProfile.parse("1.33", "ExecProbeTimeout=false")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES, kubelet=kubelet) as (daemon, w):
        await w.until(lambda: bool(daemon.manager.probed()), timeout=30)
        yield daemon


async def test_version_says_which_kubelet_the_daemon_follows(
    daemon: Daemon, tmp_path: Path
) -> None:
    async with FakeRuntimeServer(str(tmp_path / "other-cri.sock")) as server:
        result = await run_cli(
            "version", "-r", server.target, "--address", daemon.config.listen, "-t", "10"
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "Kubelet semantics:  1.33 (ExecProbeTimeout=false)"


async def test_version_without_a_daemon_still_prints_the_runtime(tmp_path: Path) -> None:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as server:
        result = await run_cli(
            "version", "-r", server.target, "--address", f"unix://{tmp_path}/absent.sock"
        )
    assert result.returncode == 0, result.stderr
    assert "RuntimeName:  fake" in result.stdout
    last = result.stdout.splitlines()[-1]
    assert last.startswith("Kubelet semantics:  unknown (cannot connect to cri-prober at unix://")


async def test_inspect_says_which_kubelet_the_probes_follow(daemon: Daemon) -> None:
    address = daemon.config.listen
    [probed] = daemon.manager.probed()
    target = probed.container.id
    table = await run_cli("inspect", target, "--address", address)
    assert table.returncode == 0, table.stderr
    assert "Kubelet semantics: 1.33 (ExecProbeTimeout=false)" in table.stdout.splitlines()
