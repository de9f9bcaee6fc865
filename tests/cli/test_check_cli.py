"""``cri-prober check`` takes serve's options for how probes are sent, and they change its verdict.

``check`` runs as a subprocess against the in-process fake runtime, as a user runs it; the
probes' targets are local listeners and the fake runtime's exec.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cri_prober.cli.check import check
from cri_prober.cli.serve import serve
from cri_prober.daemon import ServeConfig
from cri_prober.probing.handlers.http import TLSOptions
from cri_prober.probing.prober import AnnotationHosts, Prober, ProberOptions
from cri_prober.runtime.endpoints import Endpoint
from tests.support.fake_runtime import FakeContainer, FakeRuntimeServer
from tests.support.serve import run_cli

# The options check shares with serve: same names, defaults and help.
SHARED = ("node_address", "runtime_request_timeout", "https_verify", "https_ca_file")
# An address of the node's own other than serve's default 127.0.0.1 (Linux answers on all of
# 127.0.0.0/8), standing in for a node IP that --node-address names.
NODE_IP = "127.0.0.2"


@pytest.fixture(name="runtime")
async def fixture_runtime(tmp_path: Path) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as server:
        yield server


@pytest.fixture(name="node_listener")
def fixture_node_listener() -> Iterator[int]:
    """A TCP listener on NODE_IP only (nothing on 127.0.0.1 at its port); yields the port."""
    with socket.socket() as listener:
        listener.bind((NODE_IP, 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_check_shares_serves_options() -> None:
    """check's probe options are serve's own: same flags, defaults, env and help text."""
    serve_params = {param.name: param for param in serve.params}
    check_params = {param.name: param for param in check.params}
    for name in SHARED:
        ours, theirs = check_params[name], serve_params[name]
        assert ours.opts == theirs.opts
        assert ours.default == theirs.default
        assert ours.envvar == theirs.envvar
        assert getattr(ours, "help", None) == getattr(theirs, "help", None)


def test_serve_and_check_build_the_prober_alike() -> None:
    """The daemon's prober comes from ServeConfig.prober_options through the one factory."""
    hosts = AnnotationHosts.parse(["10.0.0.0/8"])
    tls = TLSOptions(verify=True)
    config = ServeConfig(
        endpoint=Endpoint("unix:///x", "flag", "unix:///x"),
        node_address="fd00::1",
        https=tls,
        annotation_probe_hosts=hosts,
    )
    options = config.prober_options()
    assert options == ProberOptions(node_address="fd00::1", tls=tls, annotation_hosts=hosts)
    prober = Prober.from_options(object(), options)  # type: ignore[arg-type]  # no exec here
    assert (prober.node_address, prober.annotation_hosts) == ("fd00::1", hosts)
    assert ServeConfig(endpoint=config.endpoint).prober_options() == ProberOptions()


async def test_node_address_picks_where_a_host_network_pod_is_probed(
    runtime: FakeRuntimeServer, node_listener: int
) -> None:
    """serve's --node-address changes check's verdict: a host-network pod is probed there."""
    sandbox = runtime.runtime.add_sandbox("hostnet", host_network=True)
    runtime.runtime.add_container(sandbox, "app")
    probe = f'{{"tcpSocket": {{"port": {node_listener}}}}}'
    args = ("check", "default/hostnet/app", "-r", runtime.target, "--probe", probe)

    default = await run_cli(*args)
    assert default.returncode == 1, default.stderr
    assert default.stdout.startswith("failure ")

    moved = await run_cli(*args, "--node-address", NODE_IP)
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.startswith("success ")


async def test_runtime_request_timeout_bounds_a_late_exec_answer(
    runtime: FakeRuntimeServer,
) -> None:
    """serve's --runtime-request-timeout changes check's verdict on an exec whose answer is late.

    The command ends at once, but its output stays open 2.5 s (a background child): with the
    default 120 s the late answer is the verdict; with 1 s the call's deadline (timeout 1 s + 1 s)
    ends first, a timeout failure.
    """

    async def held_output(_container: FakeContainer, _cmd: list[str]) -> None:
        await asyncio.sleep(2.5)

    runtime.runtime.exec_drain = held_output
    sandbox = runtime.runtime.add_sandbox("late")
    runtime.runtime.add_container(sandbox, "app")
    probe = '{"exec": {"command": ["true"]}, "timeoutSeconds": 1}'
    args = ("check", "default/late/app", "-r", runtime.target, "--probe", probe)

    default = await run_cli(*args)
    assert default.returncode == 0, default.stderr
    assert default.stdout.startswith("success (exit code 0)")

    bounded = await run_cli(*args, "--runtime-request-timeout", "1")
    assert bounded.returncode == 1, bounded.stderr
    assert bounded.stdout.startswith("failure (timed out)"), bounded.stdout


async def test_https_ca_file_must_exist(tmp_path: Path) -> None:
    """As for serve, a missing --https-ca-file is a usage error naming the flag."""
    result = await run_cli(
        "check", "x", "--probe", '{"exec": {"command": ["true"]}}',
        "-r", f"unix://{tmp_path}/absent.sock", "--https-ca-file", str(tmp_path / "none.pem"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "--https-ca-file" in result.stderr
