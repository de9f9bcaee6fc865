"""A real ``cri-prober serve`` subprocess for end-to-end and reliability tests, and helpers to
talk to it.

`launch` starts one with any flags; `start_serve` wraps it for the containerd tests (a stale
socket to replace, a metrics port, ready before use, exit 0 on SIGTERM required). Test modules
wrap `start_serve` in a module-scoped fixture (one daemon per module keeps the suite fast); each
test then opens its own grpc.aio channel on its own event loop. A thread follows the daemon's
output, so a `Serve` outlives any one event loop and `Serve.until` wakes on each new line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cri_prober
from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.runtime.client import CriClient
from tests.support.testbed import Testbed
from tests.support.waiting import HANG_GUARD, describe, until

_T = TypeVar("_T")

# Hang guards (tests.support.waiting.HANG_GUARD), not bounds: how long serve may take to get ready
# and to exit on SIGTERM before a test calls it a hang.
READY_TIMEOUT = HANG_GUARD
STOP_TIMEOUT = HANG_GUARD
# The directory that holds the cri_prober package under test; subprocesses import it from there.
SOURCE_ROOT = Path(cri_prober.__file__).resolve().parent.parent


def cli_env() -> dict[str, str]:
    """The environment for a ``python -m cri_prober`` subprocess running the code under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def stale_socket(path: Path) -> None:
    """Leave a socket file at ``path`` that nobody listens on, as a crashed server would."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


class Serve:
    """A running ``cri-prober serve``, whose output is kept line by line (with arrival times),
    parsed as JSON where it is, and copied to ``log_path``."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        socket_path: Path,
        log_path: Path,
        metrics_port: int | None = None,
    ) -> None:
        self.process = process
        self.socket_path = socket_path
        self.log_path = log_path
        self.metrics_port = metrics_port
        # (time.monotonic() at arrival, line without its newline), in order.
        self.lines: list[tuple[float, str]] = []
        self.records: list[dict[str, Any]] = []
        self._ended = threading.Event()  # the output reached EOF: serve exited (or closed it)
        self._lock = threading.Lock()
        # Loops and events of the tasks awaiting output; the reader sets each on every line.
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._reader = threading.Thread(target=self._read, name="serve-output", daemon=True)
        self._reader.start()

    @property
    def address(self) -> str:
        """The --listen / --address URI."""
        return f"unix://{self.socket_path}"

    @property
    def target(self) -> str:
        """The gRPC target of the API."""
        return f"unix:{self.socket_path}"

    def log(self) -> str:
        """What the daemon logged so far."""
        return "\n".join(line for _, line in self.lines)

    def tail(self, lines: int = 30) -> str:
        """Its last ``lines`` lines."""
        return "\n".join(line for _, line in self.lines[-lines:])

    def logged(self, event: str) -> list[dict[str, Any]]:
        """Every JSON record of this ``event`` so far."""
        return [r for r in self.records if r.get("event") == event]

    def open_fds(self) -> int:
        """How many descriptors it has open now."""
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def cpu_seconds(self) -> float:
        """User and system CPU time it has used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def until(
        self, predicate: Callable[[], object], *, timeout: float, message: str | None = None
    ) -> None:
        """Wait for output after which ``predicate()`` holds; fail at once if serve exits first,
        and with its last lines if ``timeout`` runs out."""
        what = message if message is not None else describe(predicate)

        def holds() -> bool:
            if predicate():
                return True
            if self._ended.is_set():
                raise AssertionError(f"serve exited before {what}:\n{self.tail()}")
            return False

        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(waiter)
        try:
            await until(holds, timeout=timeout, message=what, changed=waiter[1])
        except TimeoutError as error:
            raise TimeoutError(f"{error}; serve's last lines:\n{self.tail()}") from None
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    async def stop(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; the exit status and how long it took (``TimeoutError`` after ``timeout``)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        await self.until(self._ended.is_set, timeout=timeout, message="serve's output to end")
        try:
            left = max(0.1, started + timeout - time.monotonic())
            code = await asyncio.to_thread(self.process.wait, left)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"serve did not exit within {timeout} s of SIGTERM") from None
        return code, time.monotonic() - started

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait (blocking) for the exit status; killed after ``timeout``."""
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join()
        return code

    async def close(self, timeout: float = HANG_GUARD) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``; its status unchecked."""
        if self.process.poll() is None:
            with suppress(TimeoutError):
                await self.stop(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it (idempotent)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join()

    def _read(self) -> None:
        """The output thread: keep every line, copy it to the log file, wake the waiters."""
        assert self.process.stdout is not None
        with self.log_path.open("wb") as log_file:
            try:
                for raw in self.process.stdout:
                    log_file.write(raw)
                    log_file.flush()
                    line = raw.decode(errors="replace").rstrip("\n")
                    try:
                        record = json.loads(line)
                    except ValueError:
                        record = None
                    if isinstance(record, dict):
                        self.records.append(record)
                    self.lines.append((time.monotonic(), line))
                    self._wake()
            finally:
                self.process.stdout.close()
                self._ended.set()
                self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with suppress(RuntimeError):  # that loop has closed: its test is over
                loop.call_soon_threadsafe(event.set)


def launch(
    endpoint: str,
    directory: Path,
    rules: str,
    *extra: str,
    metrics_address: str | None = None,
    bootstrap: str | None = None,
    new_session: bool = False,
) -> Serve:
    """Start ``serve`` on the runtime at ``endpoint`` with ``rules`` (written to
    ``directory/rules.yaml``), its API at ``directory/api.sock``, JSON logs, a 0.5 s relist
    and ``extra`` flags. ``metrics_address``: --metrics-address, if given. ``bootstrap``: Python
    code run with ``-c`` instead of ``-m cri_prober`` (it must end by calling the CLI).
    ``new_session``: in its own session, so anything it spawns can be found afterwards."""
    rules_file = directory / "rules.yaml"
    rules_file.write_text(rules)
    socket_path = directory / "api.sock"
    program = ["-c", bootstrap] if bootstrap is not None else ["-m", "cri_prober"]
    metrics = ["--metrics-address", metrics_address] if metrics_address is not None else []
    process = subprocess.Popen(
        [
            sys.executable,
            *program,
            "serve",
            "-r",
            endpoint,
            "-c",
            str(rules_file),
            "--listen",
            f"unix://{socket_path}",
            *metrics,
            "--relist-period",
            "0.5",
            "--log-format",
            "json",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=cli_env(),
        start_new_session=new_session,
    )
    return Serve(process, socket_path, directory / "serve.log")


def _wait_serving(serve: Serve) -> None:
    """Block until Health "" is SERVING: the socket exists and discovery answered."""
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(serve.target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(
            health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=READY_TIMEOUT
        )
        try:
            for response in stream:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        finally:
            stream.cancel()


@contextmanager
def start_serve(testbed: Testbed, directory: Path, rules: str) -> Iterator[Serve]:
    """Run ``serve`` on ``testbed`` with ``rules``, ready; on exit SIGTERM it and require exit 0."""
    stale_socket(directory / "api.sock")  # the daemon must replace it
    metrics_port = free_port()
    serve = launch(testbed.endpoint, directory, rules, metrics_address=f"127.0.0.1:{metrics_port}")
    serve.metrics_port = metrics_port
    try:
        try:
            _wait_serving(serve)
        except grpc.RpcError as error:
            raise RuntimeError(f"serve did not become ready: {error}\n{serve.log()}") from error
        yield serve
    finally:
        code = serve.terminate(STOP_TIMEOUT)
        assert code == 0, f"serve exited {code} after SIGTERM:\n{serve.log()}"


async def read_until(
    stream: AsyncIterable[_T], predicate: Callable[[_T], bool], timeout: float = HANG_GUARD
) -> list[_T]:
    """Read ``stream`` until an item satisfies ``predicate``; return everything read."""
    seen: list[_T] = []
    async with asyncio.timeout(timeout):
        async for item in stream:
            seen.append(item)
            if predicate(item):
                return seen
    raise AssertionError(f"stream ended before the condition held; saw {seen}")


async def run_cli(*args: str, timeout: float = HANG_GUARD) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cri_prober ARGS`` without blocking the test's event loop.

    ``timeout`` is a hang guard, not a bound: an interpreter starting on a busy machine took
    over 30 s. A command still running then is killed (and the test fails on the timeout)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cri_prober",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


def unique(prefix: str) -> str:
    """A pod name no other test uses, matching the rules' ``prefix-*`` glob."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def wait_status(health: Any, service: str, want: int) -> list[int]:
    """Watch ``service`` until it reports ``want``; return every status seen."""
    call = health.Watch(health_pb2.HealthCheckRequest(service=service))
    try:
        seen = await read_until(call, lambda response: response.status == want)
    finally:
        call.cancel()
    return [response.status for response in seen]


async def check(health: Any, service: str) -> int:
    """Health Check ``service``; its status."""
    response = await health.Check(
        health_pb2.HealthCheckRequest(service=service), timeout=HANG_GUARD
    )
    status: int = response.status
    return status


async def touch_ready(testbed: Testbed, container_id: str) -> None:
    """Create /tmp/ready in the container, which the tests' readiness probes look for."""
    async with CriClient.connect(testbed.endpoint) as cri:
        result = await cri.exec_sync(container_id, ["touch", "/tmp/ready"], timeout=int(HANG_GUARD))
    assert result.exit_code == 0


async def eventually(
    read: Callable[[], Awaitable[Any]],
    predicate: Callable[[Any], bool],
    timeout: float = HANG_GUARD,
) -> Any:
    """Poll ``read()`` (a remote state, no event to wait on) until ``predicate`` holds."""
    async with asyncio.timeout(timeout):
        while True:
            value = await read()
            if predicate(value):
                return value
            await asyncio.sleep(0.1)


async def get(api: query_pb2_grpc.CriProberAsyncStub, target: str) -> query_pb2.Container:
    """GetContainer ``target``."""
    response = await api.GetContainer(
        query_pb2.GetContainerRequest(target=target), timeout=HANG_GUARD
    )
    return response.container


async def settled(
    api: query_pb2_grpc.CriProberAsyncStub,
    target: str,
    predicate: Callable[[query_pb2.Container], bool],
) -> query_pb2.Container:
    """The container once ``predicate`` holds for it (it may not even be discovered yet)."""

    async def read() -> query_pb2.Container | None:
        try:
            return await get(api, target)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    container: query_pb2.Container = await eventually(
        read, lambda c: c is not None and predicate(c)
    )
    return container
