"""The API's listen address: ``unix://PATH`` or ``tcp://HOST:PORT``, and unix-socket safety.

The API can run commands in every container (RunProbe with an exec probe), so a unix socket's
parent directory is created 0700 and an existing socket file is replaced only when nothing answers
on it. Clients parse ``--address`` with the same function.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

from cri_prober.errors import ConfigError

log = structlog.get_logger(__name__)

# The kernel's limit on a unix socket path (sun_path is 108 bytes including the final NUL).
MAX_UNIX_PATH_BYTES = 107
# How long a connection attempt to an existing socket file may take before it counts as stale.
STALE_PROBE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A ``--listen`` URI: a unix socket path, or a TCP host and port."""

    uri: str
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def grpc_address(self) -> str:
        """The address as ``add_insecure_port`` and ``insecure_channel`` take it."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(uri: str, *, flag: str = "--listen") -> ListenAddress:
    """Parse ``unix://PATH`` (absolute) or ``tcp://HOST:PORT``; raise ``ConfigError`` otherwise.

    ``flag`` names the option in messages (clients take the same URIs as ``--address``).
    """
    if uri.startswith("unix://"):
        path = uri.removeprefix("unix://")
        if not path.startswith("/"):
            raise ConfigError(f"{flag} {uri!r}: a unix socket needs an absolute path")
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ConfigError(
                f"{flag} {uri!r}: the socket path is longer than {MAX_UNIX_PATH_BYTES} bytes"
            )
        return ListenAddress(uri, unix_path=Path(path))
    if uri.startswith("tcp://"):
        hostport = uri.removeprefix("tcp://").rstrip("/")
        host, sep, port = hostport.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{flag} {uri!r}: expected tcp://HOST:PORT")
        return ListenAddress(uri, host=host, port=int(port))
    raise ConfigError(f"{flag} {uri!r}: unsupported; use unix:///PATH or tcp://HOST:PORT")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def prepare_unix_socket(path: Path) -> None:
    """Create the parent directory (0700) and clear a stale socket file; refuse anything else."""
    _make_private_parents(path)
    if not _socket_exists(path):
        return
    if await _answers(path):
        raise ConfigError(
            f"--listen: another process is serving on {path} (is another cri-prober running?); "
            "stop it or choose another --listen address"
        )
    _remove_stale_socket(path)


# The filesystem steps below are local metadata operations: fast enough to run on the loop.


def _make_private_parents(path: Path) -> None:
    missing = [parent for parent in (path.parent, *path.parent.parents) if not parent.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"--listen: cannot create {directory}: {exc.strerror}") from exc
        # mkdir's mode is filtered through the umask; the directory must be private regardless.
        directory.chmod(0o700)


def _remove_stale_socket(path: Path) -> None:
    # Nobody listens: a leftover from a process that died without cleaning up.
    log.info("api_stale_socket_removed", path=str(path))
    path.unlink(missing_ok=True)


def _socket_exists(path: Path) -> bool:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--listen: {path} exists and is not a socket; refusing to replace it")
    return True


async def _answers(path: Path) -> bool:
    try:
        async with asyncio.timeout(STALE_PROBE_SECONDS):
            _reader, writer = await asyncio.open_unix_connection(str(path))
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        return False
    except OSError as exc:
        raise ConfigError(f"--listen: cannot check the existing socket {path}: {exc}") from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


__all__ = ["ListenAddress", "is_loopback", "parse_listen", "prepare_unix_socket"]
