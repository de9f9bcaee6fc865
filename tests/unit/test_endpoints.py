"""Runtime endpoint resolution follows crictl's precedence exactly."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cri_prober.errors import ConfigError
from cri_prober.runtime.endpoints import DEFAULT_ENDPOINTS, resolve_endpoint, to_grpc_target


@pytest.fixture(name="crictl_yaml")
def _crictl_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "crictl.yaml"
    path.write_text("runtime-endpoint: unix:///from/file.sock\ntimeout: 10\n")
    return path


def _nothing_exists(_path: str) -> bool:
    return False


def test_flag_wins_over_everything(crictl_yaml: Path) -> None:
    """-r beats the environment variable and the config file."""
    env = {
        "CONTAINER_RUNTIME_ENDPOINT": "unix:///from/env.sock",
        "CRI_CONFIG_FILE": str(crictl_yaml),
    }
    endpoint = resolve_endpoint("unix:///from/flag.sock", environ=env)
    assert (endpoint.uri, endpoint.source) == ("unix:///from/flag.sock", "flag")


def test_env_wins_over_config_file(crictl_yaml: Path) -> None:
    """CONTAINER_RUNTIME_ENDPOINT beats runtime-endpoint in the config file."""
    env = {
        "CONTAINER_RUNTIME_ENDPOINT": "unix:///from/env.sock",
        "CRI_CONFIG_FILE": str(crictl_yaml),
    }
    assert resolve_endpoint(None, environ=env).uri == "unix:///from/env.sock"


def test_config_file_named_by_env(crictl_yaml: Path) -> None:
    """runtime-endpoint is read from the file CRI_CONFIG_FILE names."""
    endpoint = resolve_endpoint(None, environ={"CRI_CONFIG_FILE": str(crictl_yaml)})
    assert ("unix:///from/file.sock", str(crictl_yaml)) == (endpoint.uri, endpoint.source)


def test_config_file_wins_over_defaults(crictl_yaml: Path) -> None:
    """An endpoint from the config file is used even when a default socket exists."""
    endpoint = resolve_endpoint(
        None, environ={"CRI_CONFIG_FILE": str(crictl_yaml)}, socket_exists=lambda _p: True
    )
    assert endpoint.uri == "unix:///from/file.sock"


def test_config_file_without_endpoint_falls_through(tmp_path: Path) -> None:
    """A crictl.yaml without runtime-endpoint falls through to the default sockets."""
    path = tmp_path / "crictl.yaml"
    path.write_text("timeout: 10\n")
    present = DEFAULT_ENDPOINTS[1].removeprefix("unix://")
    endpoint = resolve_endpoint(
        None, environ={"CRI_CONFIG_FILE": str(path)}, socket_exists=lambda p: p == present
    )
    assert (DEFAULT_ENDPOINTS[1], "default") == (endpoint.uri, endpoint.source)


def test_first_existing_default_socket_in_order(tmp_path: Path) -> None:
    """Defaults are tried in crictl's order; the first existing socket wins."""
    missing = str(tmp_path / "none.yaml")
    endpoint = resolve_endpoint(
        None, environ={"CRI_CONFIG_FILE": missing}, socket_exists=lambda _p: True
    )
    assert endpoint.uri == "unix:///run/containerd/containerd.sock"


def test_nothing_found_is_a_clear_error(tmp_path: Path) -> None:
    """With no flag, env, file or socket the error says what to set."""
    missing = str(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="pass -r/--runtime-endpoint"):
        resolve_endpoint(None, environ={"CRI_CONFIG_FILE": missing}, socket_exists=_nothing_exists)


def test_bad_config_file_names_the_file(tmp_path: Path) -> None:
    """Invalid YAML in the config file is reported with the file's path."""
    path = tmp_path / "crictl.yaml"
    path.write_text("runtime-endpoint: [unclosed\n")
    with pytest.raises(ConfigError, match=str(path)):
        resolve_endpoint(None, environ={"CRI_CONFIG_FILE": str(path)})


def test_a_fifo_or_huge_config_file_is_a_clear_error_at_once(tmp_path: Path) -> None:
    """``check`` and ``version`` resolve the endpoint on the event loop: a FIFO at the config
    file's path hung them in open() for good, and a huge file was read whole. (A thread opens
    the FIFO's other end after 60 s, so that the code before this fails instead of hanging.)"""
    fifo = tmp_path / "crictl.yaml"
    os.mkfifo(fifo)
    done = threading.Event()

    def guard() -> None:
        if not done.wait(60.0):
            with fifo.open("w") as writer:
                writer.write("runtime-endpoint: unix:///from/fifo.sock\n")

    guarding = threading.Thread(target=guard, daemon=True)
    guarding.start()
    try:
        with pytest.raises(ConfigError) as raised:
            resolve_endpoint(None, environ={"CRI_CONFIG_FILE": str(fifo)})
    finally:
        done.set()
        guarding.join(120.0)
    assert str(raised.value) == f"{fifo}: not a regular file (a FIFO)"
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as handle:
        handle.truncate(100 * 1024 * 1024)
    with pytest.raises(ConfigError) as raised:
        resolve_endpoint(None, environ={"CRI_CONFIG_FILE": str(huge)})
    assert str(raised.value) == f"{huge}: larger than 64 KiB (100 MiB)"


@pytest.mark.parametrize(
    ("uri", "target"),
    [
        ("unix:///run/containerd/containerd.sock", "unix:///run/containerd/containerd.sock"),
        ("/run/containerd/containerd.sock", "unix:///run/containerd/containerd.sock"),
        ("tcp://127.0.0.1:1234", "dns:///127.0.0.1:1234"),
        ("tcp://[::1]:1234", "ipv6:[::1]:1234"),
    ],
)
def test_accepted_endpoint_forms(uri: str, target: str) -> None:
    """unix:///abs, a bare absolute path and tcp://host:port become gRPC targets."""
    assert target == to_grpc_target(uri)


@pytest.mark.parametrize("uri", ["http://x:1", "unix://relative.sock", "tcp://nohost", "sock"])
def test_rejected_endpoint_forms(uri: str) -> None:
    """Anything else is a ConfigError naming the endpoint."""
    with pytest.raises(ConfigError, match="runtime endpoint"):
        to_grpc_target(uri)
