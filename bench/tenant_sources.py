"""What hostile pod sources cost ``cri-prober serve``, per source tree side by side in one run.

    bench/run tenant_sources [--tree NAME=DIR ...] [--scenario NAME ...] [--quick]
                             [--normal S] [--attack S] [--after S] [--rss-limit MIB]
                             [--content-length]

A pod source is read from where tenants write: a pod's env, the number of pods, what the API
server streams. This benchmark runs a real ``cri-prober serve`` child process (``python -m
cri_prober serve`` with PYTHONPATH and cwd set to each ``--tree`` DIR, so a "before" worktree
and the current one run side by side) against a private containerd 1.6 with one canary pod,
whose container gets an exec readiness probe (``true``, period 1 s) from a small rules file
(``-c``), so the canary does not depend on the pod source. serve reads its pods from a loopback
server in this process (``--probes-from kubelet:http://127.0.0.1:PORT/pods``, or ``apiserver``
with a kubeconfig pointing at it), which serves the recorded kubelet v1.28.7 ``/pods``
(tests/fixtures) and then, for the attack, one of these (each built once, as one bytes object
streamed in 1 MiB pieces, chunked like a kubelet's Go server unless ``--content-length``):

- ``env38``: 38 pods whose container has a ~1.5 MB env list (12,000 entries) and normal
  probes, ~57 MB;
- ``empty60``: a PodList whose items are 60 MiB of ``{}``;
- ``pods50k``: 50,000 small pods (~20 MB), which leave again when the attack ends;
- ``real5k``: the recorded pods replicated to 5,000, each with its own name and UID (~16 MB);
- ``full110``: 110 pods of ~1.5 MB each (~165 MB, over the source's 64 MiB cap: it should be
  refused with one clear line while the last good view stays);
- ``endless-line`` (``--probes-from apiserver``): the list is normal, then the open watch sends
  one line that never ends (64 KiB pieces, no newline) for the whole attack, and is cut at its end.

Each scenario runs for each tree in turn (the order reversed every other scenario): serve is
started, and once the canary is probed and health ``""`` is SERVING come three phases, normal
(``--normal``, 10 s), attack (``--attack``, 30 s) and normal again (``--after``, 20 s), then
SIGTERM. Measured, from outside serve:

- RSS: VmRSS from /proc/PID/status every 0.1 s (its last value before the attack, its max from
  the attack's start to the end, and its value at the end, ``--after`` s after the attack), and
  VmHWM (the process's peak, start-up included); CPU seconds (utime + stime) per phase;
- the canary's lateness: its attempts' start times, from serve's history (``GetContainer`` over
  the local API every 2 s, ``--history-size 512``); each gap between consecutive starts minus
  the 1 s period (0 if less), counted in the phase its later start falls in (a silence up to
  the end of the run counts in the last phase); max and p99;
- health ``""``: grpc.health.v1 Check every 0.25 s with a 1 s deadline (a thread of its own):
  timeouts, NOT_SERVING answers and the max latency per phase;
- serve's log lines (``--log-format json``, stderr to a file) per phase, with the most frequent
  events, and each distinct ``pod_source_failed`` error;
- whether serve exited (or was killed by this benchmark for passing ``--rss-limit``, 6 GiB by
  default, to protect the shared machine; the phases after that show "-"), and whether SIGTERM
  ended it within 10 s (else SIGKILL).

A scenario where serve dies or stops answering still prints its column (marked). serve, the
loopback server and containerd are always stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench._common import (
    containerd,
    fmt,
    load_average,
    machine,
    pct,
    proc_cpu_seconds,
    quiet_logs,
    say,
    table,
)
from bench.podsources import node_pods
from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from tests.support.testbed import ContainerSpec

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "kubelet-1.28.7" / "pods-running.json"
NODE = "bench-node"
NAMESPACE = "bench"
CANARY = f"{NAMESPACE}/canary/app"
PERIOD = 1.0  # the canary's periodSeconds
RULES = """
probes:
  - match: {namespace: bench, container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
      timeoutSeconds: 1
"""
PIECE = 1 << 20  # bytes per write (and per chunk) of a body
FILLER = b"a" * 65536  # the endless line's pieces
RSS_EVERY = 0.1
HEALTH_EVERY = 0.25
HEALTH_DEADLINE = 1.0
HISTORY_EVERY = 2.0
SIGTERM_WAIT = 10.0
Phase = Literal["normal", "attack", "after"]
PHASES: tuple[Phase, ...] = ("normal", "attack", "after")


# -- the bodies -----------------------------------------------------------------------------------

HEAD = b'{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"100"},"items":['
TAIL = b"]}"
PROBES = (
    b'"readinessProbe":{"httpGet":{"path":"/healthz","port":8080},"periodSeconds":10},'
    b'"livenessProbe":{"tcpSocket":{"port":8080},"periodSeconds":10,"failureThreshold":3}'
)


def env_list(target_bytes: int = 1_500_000) -> bytes:
    """The inside of a ~1.5 MB ``env`` list: {"name":"V123","value":"..."} entries."""
    value = b"x" * 100
    entry_size = len(b'{"name":"V00000","value":""},') + len(value)
    count = target_bytes // entry_size
    return b",".join(b'{"name":"V%05d","value":"%s"}' % (i, value) for i in range(count))


def env_pods(count: int) -> bytes:
    """``count`` pods, each one container with a ~1.5 MB env list and normal probes."""
    env = env_list()
    parts = [HEAD]
    for i in range(count):
        parts += [
            b"," if i else b"",
            b'{"metadata":{"name":"env-%d","namespace":"tenant","uid":"env-uid-%06d"},'
            b'"spec":{"nodeName":"%s","containers":[{"name":"app","image":"busybox","env":['
            % (i, i, NODE.encode()),
            env,  # the same object each time: no copy until the join
            b"]," + PROBES + b'}]},"status":{"phase":"Running"}}',
        ]
    parts.append(TAIL)
    return b"".join(parts)


def empty_items(size: int = 60 << 20) -> bytes:
    """A PodList of ``size`` bytes whose items are all ``{}``."""
    count = (size - len(HEAD) - len(TAIL) + 1) // 3
    return HEAD + b"{}," * (count - 1) + b"{}" + TAIL


def small_pods(count: int) -> bytes:
    """``count`` small valid pods (~400 bytes each), one container with a readiness probe."""
    template = (
        b'{"metadata":{"name":"small-%d","namespace":"tenant-%d","uid":"small-uid-%08d",'
        b'"labels":{"app":"small","tier":"backend","team":"tenant-%d"}},'
        b'"spec":{"nodeName":"' + NODE.encode() + b'","containers":[{"name":"app",'
        b'"image":"registry.example/tenant/app:1.0","ports":[{"containerPort":8080}],'
        b'"readinessProbe":{"httpGet":{"path":"/ready","port":8080},"periodSeconds":10}}]},'
        b'"status":{"phase":"Running","podIP":"10.1.%d.%d"}}'
    )
    items = b",".join(
        template % (i, i % 100, i, i % 100, (i >> 8) % 256, i % 256) for i in range(count)
    )
    return HEAD + items + TAIL


def real_pods(count: int) -> bytes:
    """The recorded pods replicated to ``count``, each with its own name and UID."""
    return json.dumps({"kind": "PodList", "apiVersion": "v1", "items": node_pods(count)}).encode()


def normal_listing() -> bytes:
    """The recorded kubelet's /pods, bound to this node (also the API server's list)."""
    document = json.loads(FIXTURE.read_text())
    for pod in document["items"]:
        pod["spec"]["nodeName"] = NODE
    document.setdefault("metadata", {})["resourceVersion"] = "100"
    return json.dumps(document).encode()


@dataclass(frozen=True)
class Scenario:
    name: str
    source: Literal["kubelet", "apiserver"]
    what: str
    build: Callable[[], bytes] | None  # the attack's /pods body; None: the endless watch line


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("env38", "kubelet", "38 pods with a ~1.5 MB env list each", lambda: env_pods(38)),
        Scenario("empty60", "kubelet", "a PodList of 60 MiB of {} items", empty_items),
        Scenario(
            "pods50k", "kubelet", "50,000 small pods, which then leave", lambda: small_pods(50_000)
        ),
        Scenario(
            "real5k", "kubelet", "the recorded pods replicated to 5,000", lambda: real_pods(5000)
        ),
        Scenario(
            "full110",
            "kubelet",
            "110 pods of ~1.5 MB each, over the 64 MiB cap",
            lambda: env_pods(110),
        ),
        Scenario(
            "endless-line",
            "apiserver",
            "the watch sends one line that never ends (apiserver source)",
            None,
        ),
    )
}


# -- the loopback pod source ----------------------------------------------------------------------


class HostileServer:
    """Answers ``GET /pods`` (the kubelet) and ``GET /api/v1/pods`` list and watch (the API
    server) on 127.0.0.1, with the normal listing or, while attacking, the hostile one.

    A minimal HTTP/1.1 server on asyncio streams, keep-alive included. A body is written from
    the one bytes object in ``PIECE``-sized slices (chunked, like a kubelet's Go server, or with
    a Content-Length), so nothing is copied per request. A watch stays open and silent until
    ``endless`` is set; it then sends one line that never ends, and is cut when ``endless`` is
    cleared.
    """

    def __init__(self, normal: bytes, *, chunked: bool) -> None:
        self.normal = normal
        self.chunked = chunked
        self.attack_body: bytes | None = None
        self.endless = asyncio.Event()
        self.requests = 0
        self.bytes_sent = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def cut(self) -> None:
        """End every connection (between scenarios: serve's keep-alive one included)."""
        for task in list(self._tasks):
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
                if len(parts) != 3 or parts[0] != "GET":
                    writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                    return
                url = urllib.parse.urlsplit(parts[1])
                query = dict(urllib.parse.parse_qsl(url.query))
                self.requests += 1
                if url.path == "/pods":
                    await self._send(writer, self.attack_body or self.normal)
                elif url.path == "/api/v1/pods" and query.get("watch") in ("1", "true"):
                    await self._watch(writer)
                    return
                elif url.path == "/api/v1/pods":
                    await self._send(writer, self.normal)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
        except (ConnectionError, OSError):
            pass  # serve stopped reading (a cap, or it went away)
        except asyncio.CancelledError:
            return  # cut() or stop(): the connection ends here (asyncio would log a cancelled one)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        framing = (
            b"Transfer-Encoding: chunked" if self.chunked else b"Content-Length: %d" % len(body)
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + framing + b"\r\n\r\n"
        )
        view = memoryview(body)
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            if self.chunked:
                writer.write(b"%x\r\n" % len(piece))
            writer.write(piece)
            if self.chunked:
                writer.write(b"\r\n")
            await writer.drain()
            self.bytes_sent += len(piece)
        if self.chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _watch(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        await self.endless.wait()  # an idle watch until then: nothing changes on this node

        def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n" % len(data) + data + b"\r\n")
            self.bytes_sent += len(data)

        chunk(b'{"type":"ADDED","object":{"kind":"Pod","metadata":{"name":"')
        transport = writer.transport
        while self.endless.is_set():
            if transport.is_closing():
                return
            if transport.get_write_buffer_size() < PIECE:
                chunk(FILLER)
                await asyncio.sleep(0)
            else:  # serve is not reading as fast: do not pile up here
                await asyncio.sleep(0.01)
        transport.abort()  # the line never ended: cut the stream


# -- watching serve from outside ------------------------------------------------------------------


@dataclass
class Observed:
    """What the observer threads saw of one serve process."""

    rss: list[tuple[float, float]] = field(default_factory=list)  # (wall time, MiB)
    hwm: float = math.nan  # VmHWM, MiB, last read
    # (wall time sent, seconds, "SERVING" / "NOT_SERVING" / "timeout" / an error code)
    health: list[tuple[float, float, str]] = field(default_factory=list)
    attempts: dict[float, str] = field(default_factory=dict)  # canary start (wall) -> result
    killed: str = ""  # why this benchmark killed serve, if it did
    killed_at: float = math.nan


def read_status(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    rss = hwm = math.nan
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


class Observer:
    """Three threads watching a serve process: RSS (and the RSS guard), health "", history."""

    def __init__(self, proc: subprocess.Popen[bytes], socket: str, rss_limit: float) -> None:
        self.proc = proc
        self.socket = socket
        self.rss_limit = rss_limit
        self.seen = Observed()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._rss, name="rss", daemon=True),
            threading.Thread(target=self._health, name="health", daemon=True),
            threading.Thread(target=self._history, name="history", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _rss(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                rss, hwm = read_status(self.proc.pid)
            except (OSError, ValueError):
                break
            if math.isnan(rss):  # a zombie: it has exited
                break
            self.seen.rss.append((time.time(), rss))
            self.seen.hwm = hwm
            if rss > self.rss_limit and not self.seen.killed:
                self.seen.killed = f"RSS {rss:.0f} MiB > --rss-limit {self.rss_limit:.0f}"
                self.seen.killed_at = time.time()
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
            self._stop.wait(RSS_EVERY)

    def _health(self) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            next_at = time.monotonic()
            while not self._stop.is_set():
                sent, started = time.time(), time.monotonic()
                try:
                    response = stub.Check(request, timeout=HEALTH_DEADLINE)
                    answer = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                except grpc.RpcError as exc:
                    code = exc.code()
                    answer = "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name
                self.seen.health.append((sent, time.monotonic() - started, answer))
                next_at += HEALTH_EVERY
                self._stop.wait(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at, time.monotonic() - HEALTH_EVERY)

    def _history(self) -> None:
        request = query_pb2.GetContainerRequest(target=CANARY)
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            stub = query_pb2_grpc.CriProberStub(channel)
            while not self._stop.is_set():
                self.read_history(stub, request)
                self._stop.wait(HISTORY_EVERY)

    def read_history(
        self, stub: query_pb2_grpc.CriProberStub, request: query_pb2.GetContainerRequest
    ) -> bool:
        try:
            response = stub.GetContainer(request, timeout=2 * HISTORY_EVERY)
        except grpc.RpcError:
            return False
        for attempt in response.container.probes.readiness.detail.history:
            self.seen.attempts[attempt.time.seconds + attempt.time.nanos / 1e9] = attempt.result
        return True

    def final_history(self) -> bool:
        """One more history read (before SIGTERM): the attempts since the last periodic one."""
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            return self.read_history(
                query_pb2_grpc.CriProberStub(channel), query_pb2.GetContainerRequest(target=CANARY)
            )


# -- one scenario on one tree ---------------------------------------------------------------------


@dataclass
class Result:
    tree: str
    outcome: str = "ok"
    started: bool = True  # the canary was probed and health "" SERVING before the phases
    bounds: dict[Phase, tuple[float, float]] = field(default_factory=dict)  # wall times
    cpu: dict[Phase, float] = field(default_factory=dict)
    log_lines: dict[Phase, int] = field(default_factory=dict)
    log_events: dict[Phase, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # distinct pod_source_failed errors
    requests_attack: int = 0
    mib_sent_attack: float = 0.0
    sigterm: str = "-"
    exited_at: float = math.nan  # wall time serve was seen gone before the end (nan: alive)
    seen: Observed = field(default_factory=Observed)
    end: float = 0.0  # wall time the observation ended
    load: str = ""


def spawn_serve(
    tree: Path, endpoint: str, work: Path, source_args: Sequence[str]
) -> subprocess.Popen[bytes]:
    """``cri-prober serve`` from ``tree``, its API socket and log in ``work``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with (work / "serve.log").open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable, "-m", "cri_prober", "serve",
                "-r", endpoint,
                "-c", str(work / "rules.yaml"),
                "--listen", f"unix://{work}/api.sock",
                "--state-file", "none",
                "--history-size", "512",
                "--node-name", NODE,
                "--pleg", "relist",
                "--log-format", "json",
                *source_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=tree,
            env=env,
        )  # fmt: skip


def kubeconfig(server: HostileServer) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.port}"}}
            ],
            "users": [{"name": "fake", "user": {"token": "bench"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
    )


def phase_of(bounds: dict[Phase, tuple[float, float]], when: float) -> Phase | None:
    for phase, (start, end) in bounds.items():
        if start <= when < end:
            return phase
    return None


def where(bounds: dict[Phase, tuple[float, float]], when: float) -> str:
    phase = phase_of(bounds, when)
    if phase is None:
        return "before the phases" if not bounds or when < bounds["normal"][0] else "at the end"
    return f"{phase} +{when - bounds[phase][0]:.1f} s"


async def run_one(
    args: argparse.Namespace,
    scenario: Scenario,
    tree_name: str,
    tree: Path,
    endpoint: str,
    server: HostileServer,
) -> Result:
    result = Result(tree_name)
    server.attack_body = None
    server.endless.clear()
    server.cut()
    with tempfile.TemporaryDirectory(prefix="cprb-tenant-") as directory:
        work = Path(directory)
        (work / "rules.yaml").write_text(RULES, encoding="utf-8")
        if scenario.source == "kubelet":
            source_args = ["--probes-from", f"kubelet:http://127.0.0.1:{server.port}/pods"]
        else:
            (work / "kubeconfig").write_text(kubeconfig(server), encoding="utf-8")
            source_args = ["--probes-from", "apiserver", "--kubeconfig", str(work / "kubeconfig")]
        log_path = work / "serve.log"
        proc = spawn_serve(tree, endpoint, work, source_args)
        observer = Observer(proc, str(work / "api.sock"), args.rss_limit)
        observer.start()
        offsets: list[int] = []
        try:
            await wait_started(proc, observer, result, log_path)
            offsets.append(log_path.stat().st_size)
            for phase, seconds in zip(PHASES, (args.normal, args.attack, args.after), strict=True):
                if phase == "attack":
                    requests0, sent0 = server.requests, server.bytes_sent
                    if scenario.build is None:
                        server.endless.set()
                    else:
                        server.attack_body = args.bodies[scenario.name]
                start = time.time()
                cpu0 = cpu_or_nan(proc.pid)
                await hold(proc, seconds)
                result.cpu[phase] = cpu_or_nan(proc.pid) - cpu0
                result.bounds[phase] = (start, time.time())
                offsets.append(log_path.stat().st_size)
                if phase == "attack":
                    server.attack_body = None
                    server.endless.clear()
                    result.requests_attack = server.requests - requests0
                    result.mib_sent_attack = (server.bytes_sent - sent0) / (1 << 20)
                if proc.poll() is not None:
                    result.exited_at = time.time()
                    break
            result.end = time.time()
            if proc.poll() is None and not await asyncio.to_thread(observer.final_history):
                result.outcome = "**not answering at the end** (GetContainer failed)"
        finally:
            result.end = result.end or time.time()
            result.sigterm = await asyncio.to_thread(stop_serve, proc)
            observer.stop()
            result.seen = observer.seen
            result.load = load_average()
        if observer.seen.killed:
            result.outcome = f"**killed by the bench** ({observer.seen.killed}) at " + where(
                result.bounds, observer.seen.killed_at
            )
        elif not math.isnan(result.exited_at):
            result.outcome = f"**exited {proc.returncode}** at " + where(
                result.bounds, result.exited_at
            )
        read_logs(log_path, offsets, result)
    return result


async def hold(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """Sleep ``seconds``, or until serve exits."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            return
        await asyncio.sleep(min(0.2, left))


async def wait_started(
    proc: subprocess.Popen[bytes],
    observer: Observer,
    result: Result,
    log: Path,
    timeout: float = 60.0,
) -> None:
    """Until the canary has two attempts and health "" answers SERVING (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode} at start: {log_tail(log)}")
        health = observer.seen.health
        if len(observer.seen.attempts) >= 2 and health and health[-1][2] == "SERVING":
            return
        await asyncio.sleep(0.2)
    result.started = False
    say("  serve did not probe the canary with health SERVING within 60 s; going on")


def log_tail(path: Path) -> str:
    try:
        return path.read_bytes()[-300:].decode("utf-8", "replace").strip()
    except OSError:
        return ""


def cpu_or_nan(pid: int) -> float:
    try:
        return proc_cpu_seconds(pid)
    except (OSError, ValueError):
        return math.nan


def stop_serve(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM, then SIGKILL after SIGTERM_WAIT s; what happened, for the table."""
    if proc.poll() is not None:
        return f"- (already gone, exit {proc.returncode})"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(SIGTERM_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"**no** (SIGKILL after {SIGTERM_WAIT:g} s)"
    return f"yes, {time.monotonic() - started:.1f} s (exit {code})"


def read_logs(path: Path, offsets: list[int], result: Result) -> None:
    """Lines and events per phase from serve's JSON log; distinct pod_source_failed errors."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    for index, phase in enumerate(PHASES):
        if index + 1 >= len(offsets):
            break
        chunk = data[offsets[index] : offsets[index + 1]]
        lines = chunk.splitlines()
        result.log_lines[phase] = len(lines)
        events: Counter[str] = Counter()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                events["(not JSON)"] += 1
                continue
            event = str(record.get("event", "?"))
            events[event if len(event) <= 60 else event[:59] + "…"] += 1
            if record.get("event") == "pod_source_failed":
                error = str(record.get("error", ""))
                error = error if len(error) <= 200 else error[:199] + "…"
                if error not in result.failures:
                    result.failures.append(error)
        result.log_events[phase] = events


# -- the report -----------------------------------------------------------------------------------


def lateness(result: Result) -> dict[Phase, list[float]]:
    """The canary's gaps minus the period, by the phase of each gap's later start."""
    starts = sorted(result.seen.attempts)
    out: dict[Phase, list[float]] = {phase: [] for phase in PHASES}
    for previous, start in pairwise(starts):
        phase = phase_of(result.bounds, start)
        if phase is not None:
            out[phase].append(max(0.0, start - previous - PERIOD))  # early by jitter: on time
    # A silence up to the end (serve stuck) is a gap too, if serve was still there.
    if starts and result.bounds and math.isnan(result.exited_at) and not result.seen.killed:
        tail = result.end - starts[-1] - PERIOD
        if tail > 0:
            out[list(result.bounds)[-1]].append(tail)
    return out


def health_stats(result: Result, phase: Phase) -> tuple[int, int, int, int, float]:
    """(checks, timeouts, NOT_SERVING, other errors, max latency s) sent within ``phase``."""
    if phase not in result.bounds:
        return 0, 0, 0, 0, math.nan
    start, end = result.bounds[phase]
    checks = [h for h in result.seen.health if start <= h[0] < end]
    timeouts = sum(1 for h in checks if h[2] == "timeout")
    not_serving = sum(1 for h in checks if h[2] == "NOT_SERVING")
    errors = sum(1 for h in checks if h[2] not in ("SERVING", "NOT_SERVING", "timeout"))
    return len(checks), timeouts, not_serving, errors, max((h[1] for h in checks), default=math.nan)


def rss_row(result: Result) -> tuple[str, str, str]:
    """(before the attack, peak from the attack on / VmHWM, at the end) in MiB."""
    samples = result.seen.rss
    if "attack" not in result.bounds:
        return "-", "-", "-"
    attack = result.bounds["attack"][0]
    before = [mib for t, mib in samples if t < attack]
    later = [mib for t, mib in samples if attack <= t <= result.end]
    end = "-"
    if "after" in result.bounds and later and math.isnan(result.exited_at):
        end = fmt(later[-1], 0)
    peak = fmt(max(later), 0) if later else "-"
    return (fmt(before[-1], 0) if before else "-", f"{peak} / {fmt(result.seen.hwm, 0)}", end)


def per_phase(values: dict[Phase, str]) -> str:
    return " / ".join(values.get(phase, "-") for phase in PHASES)


def ms(value: float) -> str:
    return fmt(1000 * value, 0)


def report(args: argparse.Namespace, scenario: Scenario, results: list[Result], load: str) -> None:
    body = args.bodies.get(scenario.name)
    size = f"{len(body) / (1 << 20):.1f} MiB body" if body is not None else "endless"
    print(f"\n### {scenario.name}: {scenario.what} ({size}, --probes-from {scenario.source})\n")
    print(
        f"normal {args.normal:g} s, attack {args.attack:g} s, normal again {args.after:g} s;"
        f" canary exec probe every {PERIOD:g} s from the rules file;"
        f" {'Content-Length' if args.content_length else 'chunked'} bodies;"
        f" {machine()}; load average before: {load}, after: {results[-1].load}\n"
    )
    rows: list[list[str]] = []

    def row(name: str, cell: Callable[[Result], str]) -> None:
        rows.append([name, *(cell(r) for r in results)])

    row("serve", lambda r: r.outcome + ("" if r.started else " (start not confirmed)"))
    row("RSS MiB before the attack", lambda r: rss_row(r)[0])
    row("RSS MiB peak from the attack on / VmHWM", lambda r: rss_row(r)[1])
    row(f"RSS MiB {args.after:g} s after the attack", lambda r: rss_row(r)[2])
    row(
        "serve CPU s (normal / attack / after)",
        lambda r: per_phase({p: fmt(v, 1) for p, v in r.cpu.items()}),
    )
    row(
        "canary late max ms (normal / attack / after)",
        lambda r: per_phase(
            {p: ms(max(v)) if v else "-" for p, v in lateness(r).items() if p in r.bounds}
        ),
    )
    row(
        "canary late p99 ms (normal / attack / after)",
        lambda r: per_phase(
            {p: ms(pct(v, 99)) if v else "-" for p, v in lateness(r).items() if p in r.bounds}
        ),
    )

    def attempts(r: Result) -> str:
        if "attack" not in r.bounds:
            return "-"
        start, end = r.bounds["attack"]
        inside = [res for t, res in r.seen.attempts.items() if start <= t < end]
        after = r.bounds.get("after", (end, end))[1]
        bad = sum(
            1 for t, res in r.seen.attempts.items() if start <= t < after and res != "success"
        )
        return f"{len(inside)} of ~{(end - start) / PERIOD:.0f} ({bad} not success)"

    row("canary attempts in the attack (not success, attack + after)", attempts)

    def health_cell(r: Result, what: int) -> str:
        cells = {}
        for phase in PHASES:
            stats = health_stats(r, phase)
            if stats[0]:
                cells[phase] = f"{stats[what]}/{stats[0]}" if what else ms(stats[4])
        return per_phase(cells)

    row('health "" timeouts / checks (normal / attack / after)', lambda r: health_cell(r, 1))
    row('health "" NOT_SERVING / checks (normal / attack / after)', lambda r: health_cell(r, 2))
    row('health "" other errors / checks (normal / attack / after)', lambda r: health_cell(r, 3))
    row('health "" max latency ms (normal / attack / after)', lambda r: health_cell(r, 0))
    row(
        "serve log lines (normal / attack / after)",
        lambda r: per_phase({p: str(n) for p, n in r.log_lines.items()}),
    )

    def top_events(r: Result) -> str:
        events = r.log_events.get("attack", Counter()) + r.log_events.get("after", Counter())
        return ", ".join(f"{e} ×{n}" for e, n in events.most_common(3)) or "-"

    row("top log events (attack + after)", top_events)
    row(
        "requests to the source in the attack (MiB sent)",
        lambda r: f"{r.requests_attack} ({r.mib_sent_attack:.0f})",
    )
    row(f"SIGTERM ends it within {SIGTERM_WAIT:g} s", lambda r: r.sigterm)
    print(table(["", *(r.tree for r in results)], rows))
    for r in results:
        if r.failures:
            print(f"\n{r.tree}: pod_source_failed errors ({len(r.failures)} distinct):")
            for error in r.failures[:5]:
                print(f"- `{error}`")
    sys.stdout.flush()


# -- the run --------------------------------------------------------------------------------------


def parse_trees(values: Sequence[str]) -> list[tuple[str, Path]]:
    trees: list[tuple[str, Path]] = []
    for value in values or [f"current={ROOT}"]:
        name, sep, directory = value.partition("=")
        path = Path(directory).resolve()
        if not sep or not name or not (path / "cri_prober" / "__main__.py").is_file():
            raise SystemExit(f"--tree {value!r}: expected NAME=DIR, DIR holding cri_prober/")
        trees.append((name, path))
    return trees


def check_tree(path: Path) -> str:
    """Where ``python -m cri_prober`` resolves from the tree (it must be the tree), and its
    commit."""
    found = subprocess.run(
        [sys.executable, "-c", "import cri_prober; print(cri_prober.__file__)"],
        env={**os.environ, "PYTHONPATH": str(path)},
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(path):
        raise SystemExit(f"the tree {path} imports cri_prober from {found}")
    commit = subprocess.run(
        ["git", "-C", str(path), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return commit or "?"


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    start = time.monotonic()
    yield
    say(f"  {what} in {time.monotonic() - start:.1f} s")


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    trees = parse_trees(args.tree)
    commits = {name: check_tree(path) for name, path in trees}
    print(f"## Hostile pod sources ({machine()})\n")
    print(
        "trees: "
        + ", ".join(f"{name} = {path} ({commits[name]})" for name, path in trees)
        + f"; load average at the start: {load_average()}"
    )
    sys.stdout.flush()
    args.bodies = {}
    server = HostileServer(normal_listing(), chunked=not args.content_length)
    await server.start()
    try:
        async with containerd("1.6") as testbed, testbed.pods() as pods:
            await pods.create_pod(
                "canary",
                namespace=NAMESPACE,
                containers=[ContainerSpec("app", command=["sleep", "86400"])],
            )
            for index, name in enumerate(args.scenario):
                scenario = SCENARIOS[name]
                if scenario.build is not None:
                    with timed(f"{name}: built the attack body"):
                        args.bodies = {name: await asyncio.to_thread(scenario.build)}
                else:
                    args.bodies = {}
                load = load_average()
                order = trees if index % 2 == 0 else trees[::-1]
                results: dict[str, Result] = {}
                for tree_name, path in order:
                    say(f"{name} on {tree_name} ({path}); load {load_average()}")
                    try:
                        results[tree_name] = await run_one(
                            args, scenario, tree_name, path, testbed.endpoint, server
                        )
                    except RuntimeError as exc:
                        say(f"  {exc}")
                        results[tree_name] = Result(tree_name, outcome=f"**{exc}**")
                    say(f"  {results[tree_name].outcome}; SIGTERM: {results[tree_name].sigterm}")
                report(args, scenario, [results[t] for t, _ in trees], load)
                args.bodies = {}
    finally:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=DIR",
        help="a source tree to run serve from (repeatable; default: this one)",
    )  # fmt: skip
    parser.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), default=[],
        help="repeatable; default: all",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="shorter phases (5 / 12 / 10 s)")
    parser.add_argument("--normal", type=float, help="seconds of normal /pods first (10)")
    parser.add_argument("--attack", type=float, help="seconds of the attack (30)")
    parser.add_argument("--after", type=float, help="seconds of normal /pods after it (20)")
    parser.add_argument(
        "--rss-limit", type=float, default=6144.0, metavar="MIB",
        help="kill serve past this RSS (the machine is shared); the table says so",
    )  # fmt: skip
    parser.add_argument(
        "--content-length", action="store_true",
        help="declare each body's length instead of chunked encoding (a kubelet sends chunked)",
    )  # fmt: skip
    args = parser.parse_args()
    args.scenario = args.scenario or list(SCENARIOS)
    quick = args.quick
    args.normal = args.normal if args.normal is not None else (5.0 if quick else 10.0)
    args.attack = args.attack if args.attack is not None else (12.0 if quick else 30.0)
    args.after = args.after if args.after is not None else (10.0 if quick else 20.0)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
