"""systemd's notify protocol (``sd_notify``) in the standard library: readiness, status, watchdog.

Under ``Type=notify`` systemd hands the service ``NOTIFY_SOCKET``, a unix datagram socket (a path,
or an abstract name written with a leading ``@``), and waits for ``READY=1`` before it counts the
service as started. ``WatchdogSec=`` adds ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``): the service
must send ``WATCHDOG=1`` more often than that or systemd kills and restarts it. Without
``NOTIFY_SOCKET`` (run by hand, in a container, under Kubernetes) every call here does nothing.

Sending never blocks and never raises: a full socket buffer (systemd busy) drops the datagram with
a debug log, any other error logs a warning. A notification is advice to the service manager and
must not be able to stall or crash the daemon that sends it.

The heartbeat runs as a task on the daemon's event loop (`watchdog_loop`), not in a thread, so a
loop wedged by blocking code stops the heartbeat and systemd restarts the process, which is the
point of the watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


def socket_address(value: str) -> str | None:
    """The ``AF_UNIX`` address for a ``NOTIFY_SOCKET`` value; None when it is not a unix one.

    ``@name`` is the abstract name ``\\0name``; an absolute path is used as it is. systemd also
    knows ``vsock:`` addresses (for virtual machines), which this implementation does not speak.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


class Notifier:
    """Sends ``KEY=VALUE`` notifications to systemd; inert when there is no notify socket."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: str | None = None,
        watchdog_pid: str | None = None,
    ) -> None:
        self.address = address
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._socket: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """A notifier for ``NOTIFY_SOCKET`` and the watchdog settings systemd put in *environ*."""
        raw = environ.get(NOTIFY_SOCKET_ENV) or None
        address = socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("notify_socket_unsupported", notify_socket=raw)
        return cls(
            address,
            watchdog_usec=environ.get(WATCHDOG_USEC_ENV),
            watchdog_pid=environ.get(WATCHDOG_PID_ENV),
        )

    @property
    def enabled(self) -> bool:
        """Whether there is a notify socket to send to."""
        return self.address is not None

    def __repr__(self) -> str:
        shown = None if self.address is None else self.address.replace("\0", "@", 1)
        return f"<Notifier {shown or 'disabled'}>"

    # -- sending --------------------------------------------------------------------------------

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; True if it went out.

        ``notify(READY=1, STATUS="probing 3 containers")``. Newlines in values become spaces (the
        protocol is line-based).
        """
        if self.address is None or not fields:
            return False
        message = "".join(
            f"{key}={str(value).replace(chr(10), ' ')}\n" for key, value in fields.items()
        )
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(message.encode(), self.address)
        except BlockingIOError:
            log.debug("sd_notify_dropped", reason="socket buffer full", message=message.strip())
            return False
        except OSError as exc:
            log.warning("sd_notify_failed", error=str(exc), message=message.strip())
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd the service is up (``READY=1``), optionally with a status line."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd a clean shutdown has begun (``STOPPING=1``)."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """One watchdog heartbeat (``WATCHDOG=1``)."""
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        """Close the datagram socket (a later notification opens a new one)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # -- watchdog -------------------------------------------------------------------------------

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout systemd enforces, in seconds; None when no heartbeat is expected.

        None when there is no notify socket, ``WATCHDOG_USEC`` is unset or not a positive integer,
        or ``WATCHDOG_PID`` is set to another process (the settings were meant for a parent or a
        child, as in ``sd_watchdog_enabled(3)``). Heartbeats should go at half this interval.
        """
        if self.address is None or not self._watchdog_usec:
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            usec = 0
        if usec <= 0:
            log.warning("watchdog_usec_invalid", value=self._watchdog_usec)
            return None
        if self._watchdog_pid:
            try:
                pid = int(self._watchdog_pid)
            except ValueError:
                log.warning("watchdog_pid_invalid", value=self._watchdog_pid)
                return None
            if pid != os.getpid():
                return None
        return usec / 1_000_000


async def watchdog_loop(notifier: Notifier, stop: asyncio.Event) -> None:
    """Send ``WATCHDOG=1`` every half watchdog interval until *stop* is set.

    Returns at once when systemd expects no heartbeat. Runs on the event loop on purpose: when the
    loop is blocked the heartbeat stops and systemd restarts the daemon.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    period = interval / 2
    log.debug("watchdog_enabled", timeout_seconds=interval, heartbeat_seconds=period)
    while not stop.is_set():
        notifier.watchdog()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period):
                await stop.wait()
