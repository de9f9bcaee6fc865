"""`cri-prober version` against a fake runtime and an absent one, run as a real subprocess."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_prober import __version__
from tests.support.fake_runtime import FakeRuntimeServer
from tests.support.serve import run_cli


@pytest.fixture(name="server")
async def _server(tmp_path: Path) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as server:
        yield server


async def test_version_prints_runtime_fields(server: FakeRuntimeServer) -> None:
    """version prints cri-prober's version and the runtime's name, version and API version."""
    result = await run_cli("version", "-r", server.target)
    assert result.returncode == 0, result.stderr
    assert f"cri-prober version:  {__version__}" in result.stdout
    assert "RuntimeName:  fake" in result.stdout
    assert "RuntimeVersion:  0.0.0-fake" in result.stdout
    assert "RuntimeApiVersion:  v1" in result.stdout


async def test_version_labels_every_line(server: FakeRuntimeServer) -> None:
    """No unlabelled value: the CRI API's ``Version:`` says what it is, and the runtime's
    endpoint is named; crictl's keys stay, each value the second word of its line."""
    result = await run_cli("version", "-r", server.target)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "cri-prober", "RuntimeEndpoint:", "Version:", "RuntimeName:", "RuntimeVersion:",
        "RuntimeApiVersion:", "Kubelet",
    ]  # fmt: skip
    assert lines[1] == f"RuntimeEndpoint:  {server.target}"
    assert lines[2].endswith("(CRI VersionResponse.version: the kubelet runtime API version)")
    # The daemon's kubelet semantics (none runs here: why it is not known).
    assert lines[6].startswith("Kubelet semantics:  ")


async def test_version_unreachable_runtime_exits_1(tmp_path: Path) -> None:
    """An absent runtime is one clear line on stderr and exit 1, no traceback."""
    result = await run_cli("version", "-r", f"unix://{tmp_path}/absent.sock", "-t", "1")
    assert result.returncode == 1
    assert "cannot reach the container runtime" in result.stderr
    assert "Traceback" not in result.stderr


async def test_version_bad_endpoint_exits_2() -> None:
    """An endpoint in an unsupported form is a usage error (exit 2)."""
    result = await run_cli("version", "-r", "http://example")
    assert result.returncode == 2
    assert "unsupported" in result.stderr
    assert "Traceback" not in result.stderr
