"""A real ``cri-prober serve`` subprocess for end-to-end tests, and helpers to talk to it.

Test modules wrap `start_serve` in a module-scoped fixture (one daemon per module keeps the suite
fast); each test then opens its own grpc.aio channel on its own event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cri_prober
from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.runtime.client import CriClient
from tests.support.testbed import Testbed

_T = TypeVar("_T")

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
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


@dataclass
class Serve:
    """A running ``cri-prober serve``."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    metrics_port: int
    log_path: Path

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
        return self.log_path.read_text(errors="replace")


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
    """Run ``serve`` on ``testbed`` with ``rules``; on exit SIGTERM it and require exit 0."""
    rules_file = directory / "rules.yaml"
    rules_file.write_text(rules)
    socket_path = directory / "api.sock"
    stale_socket(socket_path)  # the daemon must replace it
    metrics_port = free_port()
    log_path = directory / "serve.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cri_prober",
                "serve",
                "-r",
                testbed.endpoint,
                "-c",
                str(rules_file),
                "--listen",
                f"unix://{socket_path}",
                "--metrics-address",
                f"127.0.0.1:{metrics_port}",
                "--relist-period",
                "0.5",
                "--log-format",
                "json",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=cli_env(),
        )
    serve = Serve(process, socket_path, metrics_port, log_path)
    try:
        try:
            _wait_serving(serve)
        except grpc.RpcError as error:
            raise RuntimeError(f"serve did not become ready: {error}\n{serve.log()}") from error
        yield serve
    finally:
        serve.process.send_signal(signal.SIGTERM)
        try:
            code = serve.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            serve.process.kill()
            serve.process.wait()
            raise
        assert code == 0, f"serve exited {code} after SIGTERM:\n{serve.log()}"


async def until(
    stream: AsyncIterable[_T], predicate: Callable[[_T], bool], timeout: float = 20.0
) -> list[_T]:
    """Read ``stream`` until an item satisfies ``predicate``; return everything read."""
    seen: list[_T] = []
    async with asyncio.timeout(timeout):
        async for item in stream:
            seen.append(item)
            if predicate(item):
                return seen
    raise AssertionError(f"stream ended before the condition held; saw {seen}")


async def run_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cri_prober ARGS`` without blocking the test's event loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cri_prober",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


def unique(prefix: str) -> str:
    """A pod name no other test uses, matching the rules' ``prefix-*`` glob."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def wait_status(health: Any, service: str, want: int) -> list[int]:
    """Watch ``service`` until it reports ``want``; return every status seen."""
    call = health.Watch(health_pb2.HealthCheckRequest(service=service))
    try:
        seen = await until(call, lambda response: response.status == want)
    finally:
        call.cancel()
    return [response.status for response in seen]


async def check(health: Any, service: str) -> int:
    """Health Check ``service``; its status."""
    response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    status: int = response.status
    return status


async def touch_ready(testbed: Testbed, container_id: str) -> None:
    """Create /tmp/ready in the container, which the tests' readiness probes look for."""
    async with CriClient.connect(testbed.endpoint) as cri:
        result = await cri.exec_sync(container_id, ["touch", "/tmp/ready"], timeout=5)
    assert result.exit_code == 0


async def eventually(
    read: Callable[[], Awaitable[Any]], predicate: Callable[[Any], bool], timeout: float = 15.0
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
    response = await api.GetContainer(query_pb2.GetContainerRequest(target=target), timeout=5)
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
