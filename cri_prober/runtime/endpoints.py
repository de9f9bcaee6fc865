"""Where the CRI runtime listens: crictl's resolution rules, and URI to gRPC target conversion.

Precedence: the ``-r/--runtime-endpoint`` flag, then ``CONTAINER_RUNTIME_ENDPOINT``, then
``runtime-endpoint`` in the file named by ``CRI_CONFIG_FILE`` (else ``/etc/crictl.yaml``), then the
first default socket that exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cri_prober.errors import ConfigError
from cri_prober.files import UnsafeFile, read_regular_file

ENDPOINT_ENV = "CONTAINER_RUNTIME_ENDPOINT"
CONFIG_FILE_ENV = "CRI_CONFIG_FILE"
DEFAULT_CONFIG_FILE = "/etc/crictl.yaml"
DEFAULT_ENDPOINTS = (
    "unix:///run/containerd/containerd.sock",
    "unix:///run/crio/crio.sock",
    "unix:///var/run/cri-dockerd.sock",
)
# crictl's config file holds a few settings; anything larger is not one.
CONFIG_FILE_MAX_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A runtime endpoint as the user wrote it, where it came from, and its gRPC target."""

    uri: str
    source: str  # "flag", "env", the config file's path, or "default"
    target: str  # what grpc.aio.insecure_channel() takes


def to_grpc_target(uri: str) -> str:
    """Convert ``unix:///abs``, a bare absolute path or ``tcp://host:port`` into a gRPC target."""
    if uri.startswith("unix://"):
        path = uri.removeprefix("unix://")
        if not path.startswith("/"):
            raise ConfigError(f"runtime endpoint {uri!r}: a unix endpoint needs an absolute path")
        return f"unix://{path}"
    if uri.startswith("/"):
        return f"unix://{uri}"
    if uri.startswith("tcp://"):
        hostport = uri.removeprefix("tcp://").rstrip("/")
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"runtime endpoint {uri!r}: expected tcp://HOST:PORT")
        return f"dns:///{hostport}" if not host.startswith("[") else f"ipv6:{hostport}"
    raise ConfigError(
        f"runtime endpoint {uri!r}: unsupported; use unix:///PATH, an absolute path or tcp://HOST:PORT"
    )


def _endpoint_from_config_file(path: str) -> str | None:
    """Read ``runtime-endpoint`` from a crictl config file; None when it is absent or unset.

    Only a regular file of at most ``CONFIG_FILE_MAX_BYTES``: ``check`` and ``version`` resolve
    the endpoint on the event loop, where a FIFO put at the path used to hang them for good.
    """
    try:
        data = read_regular_file(Path(path), max_bytes=CONFIG_FILE_MAX_BYTES, what="config file")
    except FileNotFoundError:
        return None
    except UnsafeFile as exc:
        raise ConfigError(f"{path}: {exc.reason}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    import yaml  # only for a crictl config file (bench/idle_rss.py: serve need not hold it)

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a YAML mapping of crictl settings")
    value = data.get("runtime-endpoint")
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{path}: runtime-endpoint: must be a string")
    return value


def resolve_endpoint(
    flag: str | None,
    *,
    environ: Mapping[str, str] = os.environ,
    defaults: Sequence[str] = DEFAULT_ENDPOINTS,
    socket_exists: Callable[[str], bool] = os.path.exists,
) -> Endpoint:
    """Pick the runtime endpoint the way crictl does; raise ``ConfigError`` when none is found."""
    if flag:
        return Endpoint(flag, "flag", to_grpc_target(flag))
    if environ.get(ENDPOINT_ENV):
        uri = environ[ENDPOINT_ENV]
        return Endpoint(uri, f"env {ENDPOINT_ENV}", to_grpc_target(uri))
    config_file = environ.get(CONFIG_FILE_ENV) or DEFAULT_CONFIG_FILE
    from_file = _endpoint_from_config_file(config_file)
    if from_file:
        return Endpoint(from_file, config_file, to_grpc_target(from_file))
    for uri in defaults:
        if socket_exists(uri.removeprefix("unix://")):
            return Endpoint(uri, "default", to_grpc_target(uri))
    raise ConfigError(
        "no runtime endpoint: pass -r/--runtime-endpoint, set "
        f"{ENDPOINT_ENV}, or set runtime-endpoint in {config_file}; "
        f"none of the default sockets exists ({', '.join(defaults)})"
    )
