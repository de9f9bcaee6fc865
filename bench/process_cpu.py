"""Whole-process CPU per probe: a real ``cri-prober serve`` vs a minimal paced loop, same targets.

    bench/run process_cpu [--quick] [--kinds http,tcp,grpc,exec] [--targets 100]
                          [--exec-targets 20] [--paced-loop asyncio|uvloop|both]
                          [--paced-exec aio|thread|aio,thread]
                          [--paced-http protocol|streams|protocol,streams]
                          [--rounds N] [--seconds S] [--serve-from DIR] [--serve-before DIR]
                          [--together]
                          [--serve-arg=ARG ...] [--serve-python NAME=PATH ...]
                          [--serve-also NAME=DIR ...] [--cpu-hog N] [--trace-execs]
                          [--profile DIR]

Starts a private containerd 1.6 (the testbed) with N host-network pods, each running one
long-sleeping container, and the HTTP/TCP/gRPC targets in their own process (bench.listeners,
targets spread over --ports ports of each kind, so their CPU is not counted). For each probe kind
it alternates, one at a time, in ABBA order (reversed every other round), two contenders:

- serve: a real ``cri-prober serve`` subprocess on the testbed's socket with default flags
  (relist discovery, state file beside its API socket in a temp dir) plus --metrics-address, and
  a rules file giving every container exactly one liveness probe of the kind (period 1 s,
  timeout 1 s; httpGet/tcpSocket/grpc by port number, exec ``true``);
- paced: a minimal correct probe loop in a subprocess (``--paced-child``): one asyncio task per
  target, one request per 1 s tick on a monotonic schedule, each bounded by a 1 s timeout, a new
  connection each (http: an asyncio Protocol that writes ``GET /`` on connection_made, collects
  what arrives and checks the status line at EOF, the loop issue 36 measures serve against; tcp:
  connect and close; grpc: grpc.aio Health/Check on a fresh channel with a 1 s deadline; exec:
  ExecSync ``true`` through the generated stub on one shared channel). ``--paced-loop uvloop``
  runs it on uvloop, ``both`` measures both loops as separate contenders. ``--paced-exec`` picks
  how the paced exec loop calls ExecSync: ``aio`` (the default) awaits the grpc.aio stub;
  ``thread`` runs the generated blocking stub on a ``grpc.insecure_channel`` to the same socket
  (one shared channel) in a ThreadPoolExecutor of EXEC_THREADS threads via
  ``loop.run_in_executor``, same deadline (contender ``paced-<loop>-thread``); ``aio,thread``
  measures both, each in its own child process, in the ABBA order with serve. It only changes
  exec: other kinds keep their ``paced-<loop>`` contenders, and ``--together`` uses the first mode
  listed. ``--paced-http`` likewise picks the paced http loop: ``protocol`` (the default,
  contender ``paced-<loop>-protocol``) is the Protocol loop above; ``streams`` (contender
  ``paced-<loop>``, what this benchmark measured before issue 36) is open_connection + ``GET /`` +
  reader.read() to EOF + status check, heavier by the streams' reader, writer and their futures.

Once serve probes every container (and after a warm-up), each contender's CPU over the window
is utime + stime of its whole process from /proc/PID/stat (all threads); probes done in the window
come from serve's /metrics (``prober_probe_total``, every attempt that ran) or the
paced child's own count (read on SIGUSR1), so CPU per probe is exact. serve's CPU is also split per
thread (/proc/PID/task/*/stat), and its RSS is recorded. exec uses --exec-targets containers (20 by
default: containerd 1.6 here runs out of CPU at about 50 exec/s, see benchmarks.md section 1).
``--together`` runs the two contenders at the same time on the same targets instead, as a
shadowing serve runs beside the kubelet: each window then also reports the share of its ticks
each contender ran (attempts done / targets x window / period) and, for serve, its attempts by
reason and its dropped ticks. With exec and enough --exec-targets (30 + 30 execs a second is past
containerd 1.6's ceiling here) it shows how each behaves when the runtime is saturated.
``--profile DIR`` samples serve with py-spy through each window and prints where its CPU goes
(the share of samples each function was at the top of, and on, the stack); ``--serve-arg``
passes one more argument to serve. ``--serve-from DIR`` runs serve's package from DIR (e.g.
``git archive HEAD cri_prober | tar -x -C DIR``), so a tree that others are editing does not
change under a run. ``--serve-before DIR`` adds a contender ``serve-before``: serve's package from
DIR (e.g. a snapshot of main), in the same rounds, so that two versions of serve are measured in
one window of load; the report prints ``serve / serve-before`` and each one over each paced loop.
``--serve-python NAME=PATH`` adds a contender ``serve-NAME``: the same serve run by another
interpreter (a venv's python with the project installed, e.g. a newer CPython), measured in the same
rounds, and printed as ``serve / serve-NAME``; the paced loops keep this interpreter.
``--serve-also NAME=DIR`` adds a contender ``serve-NAME`` run by this interpreter
from the package in DIR (a snapshot of another commit), so before and after are measured in the
same rounds; with ``--together`` each serve contender has windows of its own beside a fresh
paced loop, in ABBA order.

``--cpu-hog N`` runs ``stress-ng --cpu N`` through the measured rounds (started once the pods
exist, stopped at the end; the load average is printed with every round): a saturated node
(issue 36: ``--cpu-hog 4`` on 2 cores). ``--trace-execs`` runs serve through
``bench._exec_trace``, which times each exec slot's hold, each ExecSync call and the event
loop's lag inside serve, and prints their percentiles per window: where a slot's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench._common import (
    Child,
    containerd,
    fmt,
    free_port,
    listeners,
    load_average,
    machine,
    median,
    pct,
    ports,
    proc_cpu_seconds,
    py_spy,
    quiet_logs,
    rss_mib,
    say,
    spy_rows,
    start_py_spy,
    table,
    tables_first,
    thread_cpu_seconds,
)
from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from tests.support.testbed import ContainerSpec

ROOT = Path(__file__).resolve().parent.parent
PERIOD = 1.0
TIMEOUT = 1.0
EXEC_MODES = ("aio", "thread")  # how the paced exec loop calls ExecSync (--paced-exec)
HTTP_MODES = ("protocol", "streams")  # how the paced http loop sends its GET (--paced-http)
DEFAULT_MODES = ("aio", "streams")  # modes whose contender name has no suffix: paced-<loop>
EXEC_THREADS = 8  # worker threads of the paced "thread" exec mode
NAMESPACE = "bench"
KINDS = ("http", "tcp", "grpc", "exec")
HANDLERS = {
    "http": "httpGet: {{path: /, port: {port}}}",
    "tcp": "tcpSocket: {{port: {port}}}",
    "grpc": "grpc: {{port: {port}}}",
    "exec": 'exec: {{command: ["true"]}}',
}
RULE = """
  - match: {{namespace: {namespace}, container: app, labels: {{{label}: "{value}"}}}}
    livenessProbe:
      {handler}
      periodSeconds: 1
      timeoutSeconds: 1
"""
GROUP_LABEL = "bench.cri-prober.io/port-group"  # which listener port the pod's probe uses
EXEC_LABEL = "bench.cri-prober.io/exec"  # "yes" for the pods exec probes run in
# The kubelet's counter: every attempt that ran (one that could not run is counted nowhere).
PROBES_METRIC = re.compile(r"^prober_probe_total\{([^}]*)\} (\S+)$", re.M)
REASONS_METRIC = re.compile(r"^cri_prober_probe_attempts_by_reason_total\{([^}]*)\} (\S+)$", re.M)
PACE_METRIC = re.compile(r"^cri_prober_exec_pace_seconds (\S+)$", re.M)
DROPPED_METRIC = re.compile(r"^cri_prober_probe_ticks_dropped_total(?:\{[^}]*\})? (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# -- the paced loop (its own process) -------------------------------------------------------------


def paced_probe(
    kind: str,
    stub: api_pb2_grpc.RuntimeServiceAsyncStub | None,
    sync_stub: api_pb2_grpc.RuntimeServiceStub | None = None,
    executor: ThreadPoolExecutor | None = None,
    http_mode: str = "streams",
) -> Callable[[str], Awaitable[bool]]:
    """The minimal correct request for ``kind`` on one target; returns whether it succeeded.

    With ``sync_stub`` and ``executor``, exec calls the blocking stub on a worker thread instead of
    awaiting the grpc.aio one. ``http_mode`` "protocol" sends the GET from an asyncio Protocol
    (issue 36's comparator), "streams" through open_connection's reader and writer.
    """
    loop = asyncio.get_running_loop()
    health_request = health_pb2.HealthCheckRequest(service="")

    async def http(target: str) -> bool:
        request = (
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{target}\r\nUser-Agent: kube-probe/1.34\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n"
        ).encode()
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(target))
            try:
                writer.write(request)
                data = await reader.read()
            finally:
                writer.close()
        return data.startswith(b"HTTP/1.") and 200 <= int(data[9:12]) < 400

    class GetProtocol(asyncio.Protocol):
        """One GET on a new connection: the request on connect, the bytes collected until EOF."""

        def __init__(self, request: bytes, done: asyncio.Future[bytes]) -> None:
            self.request = request
            self.done = done
            self.chunks: list[bytes] = []

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.write(self.request)  # type: ignore[attr-defined]

        def data_received(self, data: bytes) -> None:
            self.chunks.append(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.done.done():
                if exc is None:
                    self.done.set_result(b"".join(self.chunks))
                else:
                    self.done.set_exception(exc)

    async def http_protocol(target: str) -> bool:
        request = (
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{target}\r\nUser-Agent: kube-probe/1.34\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n"
        ).encode()
        done: asyncio.Future[bytes] = loop.create_future()
        transport = None
        try:
            async with asyncio.timeout(TIMEOUT):
                transport, _ = await loop.create_connection(
                    lambda: GetProtocol(request, done), "127.0.0.1", int(target)
                )
                data = await done
        finally:
            if transport is not None:
                transport.close()
        status = data.partition(b"\r\n")[0].split(b" ", 2)
        return status[0].startswith(b"HTTP/1.") and 200 <= int(status[1]) < 400

    async def tcp(target: str) -> bool:
        async with asyncio.timeout(TIMEOUT):
            transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", int(target))
        transport.close()
        return True

    async def grpc_check(target: str) -> bool:
        async with grpc.aio.insecure_channel(f"ipv4:127.0.0.1:{target}") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_request, timeout=TIMEOUT
            )
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def exec_sync(target: str) -> bool:
        assert stub is not None
        request = api_pb2.ExecSyncRequest(container_id=target, cmd=["true"], timeout=int(TIMEOUT))
        # The runtime enforces the exec's 1 s; the call's own deadline only bounds a lost answer.
        response = await stub.ExecSync(request, timeout=TIMEOUT + 1)
        return response.exit_code == 0

    async def exec_thread(target: str) -> bool:
        assert sync_stub is not None
        assert executor is not None
        request = api_pb2.ExecSyncRequest(container_id=target, cmd=["true"], timeout=int(TIMEOUT))
        # The same deadline, enforced by grpc core on the worker thread; cancelling this coroutine
        # does not stop the call, which runs on until it is answered or its deadline passes.
        call = functools.partial(sync_stub.ExecSync, request, timeout=TIMEOUT + 1)
        response = await loop.run_in_executor(executor, call)
        return response.exit_code == 0

    if kind == "exec" and sync_stub is not None:
        return exec_thread
    if kind == "http" and http_mode == "protocol":
        return http_protocol
    return {"http": http, "tcp": tcp, "grpc": grpc_check, "exec": exec_sync}[kind]


async def paced(
    kind: str,
    targets: Sequence[str],
    endpoint: str,
    exec_mode: str = "aio",
    http_mode: str = "streams",
) -> None:
    """Probe every target once per PERIOD until SIGTERM; print the counts on SIGUSR1.

    ``exec_mode`` "thread" calls exec's ExecSync through the blocking stub on EXEC_THREADS threads;
    ``http_mode`` picks the http loop (see ``paced_probe``).
    """
    loop = asyncio.get_running_loop()
    threaded = kind == "exec" and exec_mode == "thread"
    channel = grpc.aio.insecure_channel(endpoint) if kind == "exec" and not threaded else None
    stub = api_pb2_grpc.RuntimeServiceStub(channel) if channel is not None else None
    sync_channel = grpc.insecure_channel(endpoint) if threaded else None
    sync_stub = api_pb2_grpc.RuntimeServiceStub(sync_channel) if sync_channel is not None else None
    executor = (
        ThreadPoolExecutor(max_workers=EXEC_THREADS, thread_name_prefix="exec")
        if threaded
        else None
    )
    probe = paced_probe(kind, stub, sync_stub, executor, http_mode)
    counts = {"done": 0, "failed": 0}

    def report() -> None:
        sys.stdout.write(json.dumps(counts) + "\n")
        sys.stdout.flush()

    async def one(target: str) -> None:
        next_tick = loop.time() + random.uniform(0, PERIOD)
        while True:
            delay = next_tick - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_tick += PERIOD
            behind = loop.time() - next_tick
            if behind > 0:  # a slow probe: run the missed tick once, drop the older ones
                next_tick += math.floor(behind / PERIOD) * PERIOD
            try:
                ok = await probe(target)
            except (OSError, TimeoutError, ValueError, grpc.RpcError):  # aio's errors are RpcError
                ok = False
            counts["done"] += 1
            counts["failed"] += not ok

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, report)
    tasks = [asyncio.create_task(one(t)) for t in targets]
    sys.stdout.write(json.dumps({"targets": len(targets)}) + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if channel is not None:
            await channel.close()
        if sync_channel is not None:
            sync_channel.close()  # cancels the calls still running on the threads
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def paced_child_main(args: argparse.Namespace) -> None:
    targets = args.paced_targets.split(",")
    if args.paced_loop == "uvloop":
        import uvloop  # only the uvloop variant needs it

        uvloop.run(
            paced(args.paced_child, targets, args.endpoint, args.paced_exec, args.paced_http)
        )
    else:
        asyncio.run(
            paced(args.paced_child, targets, args.endpoint, args.paced_exec, args.paced_http)
        )


# -- measurements ---------------------------------------------------------------------------------


@dataclass
class Window:
    """One contender's measurement window."""

    contender: str
    cpu: float  # seconds, the whole process
    probes: int  # finished in the window
    failed: int
    seconds: float
    rss: float  # MiB at the end of the window
    containerd_cpu: float  # seconds, containerd's own process over the same window
    threads: dict[str, float] = field(default_factory=dict)  # thread group -> CPU seconds

    @property
    def ms_per_probe(self) -> float:
        return 1000 * self.cpu / self.probes if self.probes else math.nan

    @property
    def rate(self) -> float:
        return self.probes / self.seconds


def thread_groups(pid: int, before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group since ``before``: the main thread, then threads by name."""
    out: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in thread_cpu_seconds(pid).items():
        group = "main (event loop)" if tid == pid else re.sub(r"[-_ ]?\d+$", "", name) or name
        out[group] += cpu - before.get(tid, (name, 0.0))[1]
    return dict(out)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def reasons_and_dropped(port: int) -> tuple[dict[str, float], float, float]:
    """serve's attempts so far by ``probe_type/reason``, its ticks dropped so far and its exec
    pace now (NaN before it has one)."""
    text = metrics_text(port)
    reasons: dict[str, float] = {}
    for labels, value in REASONS_METRIC.findall(text):
        parsed = dict(LABEL.findall(labels))
        reasons[f"{parsed.get('probe_type')}/{parsed.get('reason')}"] = float(value)
    pace = PACE_METRIC.search(text)
    dropped = sum(float(v) for v in DROPPED_METRIC.findall(text))
    return reasons, dropped, float(pace.group(1)) if pace else math.nan


def scrape(port: int) -> dict[str, tuple[str, float]]:
    """serve's attempts so far from /metrics: (pod, result) key -> count."""
    text = metrics_text(port)
    out: dict[str, tuple[str, float]] = {}
    for labels, value in PROBES_METRIC.findall(text):
        parsed = dict(LABEL.findall(labels))
        out[f"{parsed.get('pod')}/{parsed.get('result')}"] = (
            parsed.get("result", ""),
            float(value),
        )
    return out


def attempts(counts: dict[str, tuple[str, float]]) -> tuple[int, int]:
    """(all attempts, attempts that were not a success) in a scrape."""
    total = sum(v for _, v in counts.values())
    bad = sum(v for r, v in counts.values() if r != "successful")
    return int(total), int(bad)


def spawn_serve(
    endpoint: str,
    rules: Path,
    directory: Path,
    port: int,
    log: Path,
    source: Path,
    extra: Sequence[str] = (),
    python: str = sys.executable,
    trace: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``cri-prober serve`` with default flags but its API socket in ``directory`` and metrics.

    It runs as ``python -m cri_prober`` from ``source``, the directory holding the package; with
    ``trace``, as ``python -m bench._exec_trace`` (the package still from ``source``), which
    writes its exec timings there on exit.
    """
    env = None
    module = "cri_prober"
    if trace is not None:
        module = "bench._exec_trace"
        # The package from ``source`` (the working directory comes first), bench from here.
        env = {**os.environ, "CPRB_EXEC_TRACE": str(trace), "PYTHONPATH": str(ROOT)}
    with log.open("wb") as log_file:
        return subprocess.Popen(
            [
                python,
                "-m",
                module,
                "serve",
                "-r",
                endpoint,
                "-c",
                str(rules),
                "--listen",
                f"unix://{directory}/api.sock",
                "--metrics-address",
                f"127.0.0.1:{port}",
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            cwd=source,
            env=env,
        )


@contextlib.asynccontextmanager
async def serving(
    args: argparse.Namespace,
    endpoint: str,
    rules: Path,
    expected: int,
    contender: str = "serve",
    traced: list[ExecTrace] | None = None,
) -> AsyncIterator[tuple[int, int]]:
    """A serve subprocess that probes every one of ``expected`` containers: (pid, metrics port).

    ``contender`` is ``serve``, or ``serve-NAME`` for the interpreter ``--serve-python`` or the
    package directory ``--serve-also`` named (``--serve-before DIR`` is ``--serve-also
    before=DIR``). With ``--trace-execs``, the exec timings of the whole run go into ``traced``
    once serve has stopped.
    """
    name = contender.partition("-")[2]
    python = args.serve_python.get(name, sys.executable)
    source = args.serve_also.get(name, args.serve_from)
    with tempfile.TemporaryDirectory(prefix="cprb-bench-serve-") as directory:
        port = free_port()
        log = Path(directory) / "serve.log"
        trace = Path(directory) / "trace.json" if args.trace_execs else None
        proc = spawn_serve(
            endpoint, rules, Path(directory), port, log, source, args.serve_arg, python, trace
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited {proc.returncode}: {log.read_text()[-2000:]}")
                with contextlib.suppress(OSError):
                    counts = await asyncio.to_thread(scrape, port)
                    if len({key.split("/")[0] for key in counts}) >= expected:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"serve did not probe all {expected} containers in 60 s")
                await asyncio.sleep(0.5)
            yield proc.pid, port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if trace is not None and traced is not None and trace.exists():
                traced.append(ExecTrace(**json.loads(trace.read_text(encoding="utf-8"))))


async def measure_serve(
    args: argparse.Namespace,
    kind: str,
    endpoint: str,
    rules: Path,
    expected: int,
    ctrd: int,
    contender: str = "serve",
) -> Window:
    """Start serve, wait until it probes every container, then measure one window (sampled by
    py-spy all along with ``--profile``; with ``--trace-execs`` its exec timings, ticks dropped
    and exec pace in the window are printed)."""
    traced: list[ExecTrace] = []
    async with serving(args, endpoint, rules, expected, contender, traced) as (pid, port):
        await asyncio.sleep(args.warmup)
        _, dropped0, _ = await asyncio.to_thread(reasons_and_dropped, port)
        start = time.monotonic()
        if args.profile is None:
            window = await measure_window(contender, pid, ctrd, args.seconds, serve_port=port)
        else:
            prefix = f"{contender}-{kind}-"
            out = args.profile / f"{prefix}{len(list(args.profile.glob(f'{prefix}*')))}.txt"
            spy = await start_py_spy(args.py_spy, pid, args.seconds, out)
            window = await measure_window(contender, pid, ctrd, args.seconds, serve_port=port)
            await spy.wait()
        end = time.monotonic()
        _, dropped1, pace = await asyncio.to_thread(reasons_and_dropped, port)
    if traced:
        trace = traced[0].within(start, end)
        say(
            f"  {contender}: {dropped1 - dropped0:.0f} ticks dropped, exec pace {pace:.2f} s;"
            f" ms p50 / p90 / max: slot hold {ExecTrace.summary(trace.holds)}; ExecSync call"
            f" {ExecTrace.summary(trace.calls)}; loop lag {ExecTrace.summary(trace.lags)}"
        )
    return window


@dataclass
class Together:
    """One window with serve and the paced loop running at once on the same targets."""

    serve: Window
    paced: Window
    due: float  # ticks due to each contender in the window: targets x seconds / period
    reasons: dict[str, float]  # serve's attempts in the window by probe_type/reason
    dropped: float  # serve's ticks dropped in the window
    pace: float  # serve's exec pace at the end of the window (cri_prober_exec_pace_seconds)
    load: str = ""  # the load average at the end of the window
    trace: ExecTrace | None = None  # serve's exec timings in the window (--trace-execs)

    def share(self, window: Window) -> float:
        return window.probes / self.due


@dataclass
class ExecTrace:
    """Timings from inside serve (bench._exec_trace): (CLOCK_MONOTONIC at the end, seconds)."""

    holds: list[tuple[float, float]]  # exec slots, granted to given back
    calls: list[tuple[float, float]]  # ExecSync calls, sent to answered (as the loop saw it)
    lags: list[tuple[float, float]]  # how late the loop ran a 50 ms timer

    def within(self, start: float, end: float) -> ExecTrace:
        def keep(rows: list[tuple[float, float]]) -> list[tuple[float, float]]:
            return [(at, took) for at, took in rows if start <= at <= end]

        return ExecTrace(keep(self.holds), keep(self.calls), keep(self.lags))

    @staticmethod
    def summary(rows: list[tuple[float, float]]) -> str:
        values = [took * 1000 for _, took in rows]
        if not values:
            return "-"
        return (
            f"{pct(values, 50):.0f} / {pct(values, 90):.0f} / {max(values):.0f} (n={len(values)})"
        )


async def measure_together(
    args: argparse.Namespace,
    kind: str,
    endpoint: str,
    rules: Path,
    targets: Sequence[str],
    ctrd: int,
    contender: str = "serve",
) -> Together:
    """serve and the paced loop at once, as a shadowing serve runs beside the kubelet."""
    loop = args.paced_loop if args.paced_loop != "both" else "asyncio"
    exec_mode = paced_modes(args, kind)[0]
    traced: list[ExecTrace] = []
    async with serving(args, endpoint, rules, len(targets), contender, traced) as (pid, port):
        argv = paced_child_argv(kind, loop, endpoint, targets, exec_mode)
        child = await asyncio.to_thread(Child, argv)
        try:
            await asyncio.sleep(args.warmup + 1)
            reasons0, dropped0, _ = await asyncio.to_thread(reasons_and_dropped, port)
            window_start = time.monotonic()
            serve, paced = await asyncio.gather(
                measure_window(contender, pid, ctrd, args.seconds, serve_port=port),
                measure_window(
                    paced_name(loop, exec_mode),
                    child.pid,
                    ctrd,
                    args.seconds,
                    child=child,
                ),
            )
            reasons1, dropped1, pace = await asyncio.to_thread(reasons_and_dropped, port)
            window_end = time.monotonic()
        finally:
            await asyncio.to_thread(child.stop)
    reasons = {k: v - reasons0.get(k, 0.0) for k, v in reasons1.items()}
    trace = traced[0].within(window_start, window_end) if traced else None
    return Together(
        serve=serve,
        paced=paced,
        due=len(targets) * serve.seconds / PERIOD,
        reasons={k: v for k, v in reasons.items() if v},
        dropped=dropped1 - dropped0,
        pace=pace,
        load=load_average(),
        trace=trace,
    )


def paced_counts(child: Child) -> tuple[int, int]:
    """Ask the paced child for its counts: (done, failed)."""
    assert child.proc.stdout is not None
    os.kill(child.pid, signal.SIGUSR1)
    data = json.loads(child.proc.stdout.readline())
    return int(data["done"]), int(data["failed"])


def paced_child_argv(
    kind: str, loop: str, endpoint: str, targets: Sequence[str], mode: str = "aio"
) -> list[str]:
    """The paced child's arguments; ``mode`` is exec's (``--paced-exec``) or http's
    (``--paced-http``), and ignored for the other kinds."""
    return [
        "-m",
        "bench.process_cpu",
        "--paced-child",
        kind,
        "--paced-loop",
        loop,
        "--paced-http" if kind == "http" else "--paced-exec",
        mode if kind in ("http", "exec") else "aio",
        "--endpoint",
        endpoint,
        "--paced-targets",
        ",".join(targets),
    ]


def paced_modes(args: argparse.Namespace, kind: str) -> list[str]:
    """The paced loop's modes measured for ``kind``: exec's, http's, or the one of the others."""
    modes: list[str] = {"exec": args.paced_exec, "http": args.paced_http}.get(kind, ["aio"])
    return modes


def paced_contenders(args: argparse.Namespace, kind: str) -> list[str]:
    """serve, ``serve-before`` with ``--serve-before``, ``serve-NAME`` for each
    ``--serve-python``, then the paced contenders of ``kind``: ``paced-<loop>`` (aio, streams),
    ``paced-<loop>-thread`` and ``paced-<loop>-protocol``."""
    loops = ["asyncio", "uvloop"] if args.paced_loop == "both" else [args.paced_loop]
    serves = ["serve"] + [f"serve-{name}" for name in [*args.serve_python, *args.serve_also]]
    return serves + [paced_name(loop, mode) for mode in paced_modes(args, kind) for loop in loops]


def paced_name(loop: str, mode: str) -> str:
    """A paced contender's name: ``paced-<loop>``, and ``-<mode>`` for a mode but aio/streams."""
    return f"paced-{loop}" + ("" if mode in DEFAULT_MODES else f"-{mode}")


def paced_variant(contender: str, kind: str = "exec") -> tuple[str, str]:
    """(loop, mode) of a ``paced-<loop>[-<mode>]`` contender of ``kind`` (``paced_name``'s
    inverse)."""
    loop, _, mode = contender.removeprefix("paced-").partition("-")
    return loop, mode or ("streams" if kind == "http" else "aio")


async def measure_paced(
    args: argparse.Namespace,
    kind: str,
    loop: str,
    endpoint: str,
    targets: Sequence[str],
    ctrd: int,
    exec_mode: str = "aio",
) -> Window:
    argv = paced_child_argv(kind, loop, endpoint, targets, exec_mode)
    child = await asyncio.to_thread(Child, argv)
    name = paced_name(loop, exec_mode)
    try:
        await asyncio.sleep(args.warmup + 1)
        return await measure_window(name, child.pid, ctrd, args.seconds, child=child)
    finally:
        await asyncio.to_thread(child.stop)


async def measure_window(
    name: str,
    pid: int,
    ctrd: int,
    seconds: float,
    *,
    serve_port: int | None = None,
    child: Child | None = None,
) -> Window:
    """CPU of ``pid`` and probes it finished over ``seconds``."""

    async def count() -> tuple[int, int]:
        if serve_port is not None:
            return attempts(await asyncio.to_thread(scrape, serve_port))
        assert child is not None
        return await asyncio.to_thread(paced_counts, child)

    done0, bad0 = await count()
    threads0 = thread_cpu_seconds(pid)
    cpu0, ctrd0, wall0 = proc_cpu_seconds(pid), proc_cpu_seconds(ctrd), time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, ctrd1, wall1 = proc_cpu_seconds(pid), proc_cpu_seconds(ctrd), time.monotonic()
    threads = thread_groups(pid, threads0)
    rss = rss_mib(pid)
    done1, bad1 = await count()
    return Window(
        contender=name,
        cpu=cpu1 - cpu0,
        probes=done1 - done0,
        failed=bad1 - bad0,
        seconds=wall1 - wall0,
        rss=rss,
        containerd_cpu=ctrd1 - ctrd0,
        threads=threads,
    )


# -- the run --------------------------------------------------------------------------------------


def rules_yaml(kind: str, port_list: Sequence[int]) -> str:
    """One liveness rule per listener port (pods pick theirs by label), or one exec rule."""
    if kind == "exec":
        rules = [
            RULE.format(
                namespace=NAMESPACE,
                label=EXEC_LABEL,
                value="yes",
                handler=HANDLERS["exec"].format(),
            )
        ]
    else:
        rules = [
            RULE.format(
                namespace=NAMESPACE,
                label=GROUP_LABEL,
                value=str(group),
                handler=HANDLERS[kind].format(port=port),
            )
            for group, port in enumerate(port_list)
        ]
    return "probes:" + "".join(rules)


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    say(f"machine: {machine()}; load average {load_average()}")
    load_before = load_average()
    contenders = {kind: paced_contenders(args, kind) for kind in args.kinds}
    results: dict[str, list[dict[str, Window]]] = {kind: [] for kind in args.kinds}
    together: dict[str, list[Together]] = {kind: [] for kind in args.kinds}
    n_ports = args.ports

    def tables() -> None:
        if args.together:
            report_together(args, together, load_before)
        else:
            report(args, contenders, results, load_before)

    with (
        # The tables of what was measured come first, even when a later window or a stop (serve,
        # containerd, the listeners) fails: that failure follows them (issue 35).
        tables_first(tables),
        listeners(http=n_ports, tcp=n_ports, grpc=n_ports) as targets_child,
        tempfile.TemporaryDirectory(prefix="cprb-bench-rules-") as rules_dir,
    ):
        async with containerd("1.6") as testbed, testbed.pods() as pods:
            say(f"creating {args.targets} pods")
            ids: list[str] = [""] * args.targets

            async def create(i: int) -> None:
                pod = await pods.create_pod(
                    f"pc-{i:03d}",
                    namespace=NAMESPACE,
                    labels={
                        GROUP_LABEL: str(i % n_ports),
                        EXEC_LABEL: "yes" if i < args.exec_targets else "no",
                    },
                    containers=[ContainerSpec("app", command=["sleep", "86400"])],
                )
                ids[i] = pod.container_ids["app"]

            for start in range(0, args.targets, 8):
                await asyncio.gather(
                    *(create(i) for i in range(start, min(start + 8, args.targets)))
                )
            hog = cpu_hog(args.cpu_hog) if args.cpu_hog else contextlib.nullcontext()
            with hog:
                await measure_kinds(args, testbed, ids, targets_child, rules_dir, results, together)
            say(f"load average {load_average()}")


async def measure_kinds(
    args: argparse.Namespace,
    testbed: Any,
    ids: Sequence[str],
    targets_child: Child,
    rules_dir: str,
    results: dict[str, list[dict[str, Window]]],
    together: dict[str, list[Together]],
) -> None:
    """Every kind's rounds, appended to ``results`` (or ``together``) as they are measured."""
    contenders = {kind: paced_contenders(args, kind) for kind in args.kinds}
    n_ports = args.ports
    for kind in args.kinds:
        port_list = ports(targets_child, kind) if kind != "exec" else []
        rules = Path(rules_dir) / f"{kind}.yaml"
        rules.write_text(rules_yaml(kind, port_list), encoding="utf-8")
        if kind == "exec":
            targets = ids[: args.exec_targets]
        else:
            targets = [str(port_list[i % n_ports]) for i in range(args.targets)]
        if args.together:
            serves = [c for c in contenders[kind] if not c.startswith("paced-")]
            for round_no in range(args.rounds):
                for serve in serves if round_no % 2 == 0 else serves[::-1]:
                    both = await measure_together(
                        args, kind, testbed.endpoint, rules, targets, testbed.pid, serve
                    )
                    together[kind].append(both)
                    say(
                        f"round {round_no + 1} {kind} together: {serve} ran"
                        f" {both.share(both.serve):.1%} of its ticks"
                        f" ({both.serve.failed} not successful,"
                        f" {both.dropped:.0f} dropped, exec pace {both.pace:.2f} s),"
                        f" paced {both.share(both.paced):.1%}"
                        f" ({both.paced.failed} not successful); load {both.load}"
                    )
                    if both.trace is not None:
                        say(
                            "  ms p50 / p90 / max: slot hold"
                            f" {ExecTrace.summary(both.trace.holds)}; ExecSync call"
                            f" {ExecTrace.summary(both.trace.calls)}; loop lag"
                            f" {ExecTrace.summary(both.trace.lags)}"
                        )
            continue
        for round_no in range(args.rounds):
            order = contenders[kind] if round_no % 2 == 0 else contenders[kind][::-1]
            per: dict[str, Window] = {}
            for contender in order:
                if not contender.startswith("paced-"):
                    window = await measure_serve(
                        args,
                        kind,
                        testbed.endpoint,
                        rules,
                        len(targets),
                        testbed.pid,
                        contender,
                    )
                else:
                    loop, exec_mode = paced_variant(contender, kind)
                    window = await measure_paced(
                        args, kind, loop, testbed.endpoint, targets, testbed.pid, exec_mode
                    )
                per[contender] = window
                say(
                    f"round {round_no + 1} {kind} {contender}: {window.probes} probes"
                    f" ({window.failed} not successful) in {window.seconds:.1f} s,"
                    f" {window.ms_per_probe:.3f} ms CPU per probe,"
                    f" RSS {window.rss:.0f} MiB; load {load_average()}"
                )
            results[kind].append(per)


@contextlib.contextmanager
def cpu_hog(workers: int) -> Iterator[None]:
    """``stress-ng --cpu N`` for the block, stopped by its PID: a saturated node (issue 36)."""
    hog = subprocess.Popen(
        ["stress-ng", "--cpu", str(workers), "--timeout", "3600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    say(f"stress-ng --cpu {workers} started (pid {hog.pid}); load average {load_average()}")
    try:
        yield
    finally:
        hog.terminate()
        try:
            hog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            hog.kill()
            hog.wait()
        say(f"stress-ng stopped; load average {load_average()}")


def partial(args: argparse.Namespace, measured: Mapping[str, Sequence[object]]) -> None:
    """Say so when a run that failed part-way measured fewer rounds than it asked for."""
    done = {kind: len(measured.get(kind, ())) for kind in args.kinds}
    if any(n < args.rounds for n in done.values()):
        kinds = ", ".join(f"{kind} {n}" for kind, n in done.items())
        print(f"**A partial run**: rounds measured, of {args.rounds} asked: {kinds}.\n")


def report_together(
    args: argparse.Namespace, together: dict[str, list[Together]], load_before: str
) -> None:
    print(f"\n## serve beside a paced loop, at the same time on the same targets ({machine()})\n")
    together = {kind: rounds for kind, rounds in together.items() if rounds}
    partial(args, together)
    print(
        f"{args.targets} targets at 1/s for http/tcp/grpc, {args.exec_targets} containers for exec"
        f" (each probed by both); containerd 1.6; {args.rounds} rounds of {args.seconds:g} s"
        f" after {args.warmup:g} s warm-up; serve's extra arguments:"
        f" {' '.join(args.serve_arg) or 'none'}. Load average before: {load_before}, after:"
        f" {load_average()}. A share is attempts done / ticks due (targets x window / period).\n"
    )
    if args.cpu_hog:
        print(f"Beside `stress-ng --cpu {args.cpu_hog}` through every round.\n")
    rows = []
    traces = []
    for kind, all_rounds in together.items():
        by_serve: dict[str, list[Together]] = defaultdict(list)
        for r in all_rounds:
            by_serve[r.serve.contender].append(r)
        for serve, rounds in by_serve.items():
            for name in ("serve", "paced"):
                windows = [getattr(r, name) for r in rounds]
                shares = [r.share(w) for r, w in zip(rounds, windows, strict=True)]
                rows.append(
                    [
                        kind,
                        serve if name == "serve" else f"{windows[0].contender} (beside {serve})",
                        " / ".join(f"{share:.1%}" for share in shares),
                        f"**{median(shares):.1%}**",
                        sum(w.failed for w in windows),
                        fmt(median([w.ms_per_probe for w in windows]), 3),
                        " / ".join(f"{r.dropped:.0f}" for r in rounds) if name == "serve" else "",
                        " / ".join(r.load.split(" / ")[0] for r in rounds),
                    ]
                )
            for number, r in enumerate(rounds, 1):
                if r.trace is not None:
                    traces.append(
                        [
                            kind,
                            serve,
                            number,
                            ExecTrace.summary(r.trace.holds),
                            ExecTrace.summary(r.trace.calls),
                            ExecTrace.summary(r.trace.lags),
                        ]
                    )
    print(
        table(
            [
                "probe",
                "contender",
                "ticks run per round",
                "median",
                "not successful",
                "CPU ms/probe",
                "ticks dropped (serve's metric)",
                "load (1 min) per round",
            ],
            rows,
        )
    )
    if traces:
        print("\nInside serve (--trace-execs), ms p50 / p90 / max per window:\n")
        print(
            table(
                [
                    "probe",
                    "contender",
                    "round",
                    "exec slot held",
                    "ExecSync call (sent to answered)",
                    "loop lag (50 ms timer)",
                ],
                traces,
            )
        )
    print("\nserve's attempts by reason, all rounds:\n")
    totals: dict[str, float] = defaultdict(float)
    for rounds in together.values():
        for r in rounds:
            for key, value in r.reasons.items():
                totals[key] += value
    print(
        table(
            ["probe_type/reason", "attempts"], [[k, f"{v:.0f}"] for k, v in sorted(totals.items())]
        )
    )


def report(
    args: argparse.Namespace,
    contenders: dict[str, list[str]],
    results: dict[str, list[dict[str, Window]]],
    load_before: str,
) -> None:
    print(f"\n## Whole-process CPU per probe ({machine()})\n")
    results = {kind: rounds for kind, rounds in results.items() if rounds}
    partial(args, results)
    print(
        f"{args.targets} targets at 1/s for http/tcp/grpc (spread over {args.ports} ports each),"
        f" {args.exec_targets} containers for exec; containerd 1.6; {args.rounds} rounds (ABBA),"
        f" {args.seconds:g} s windows after {args.warmup:g} s warm-up."
        f" serve's extra arguments: {' '.join(args.serve_arg) or 'none'}."
        f" Load average before: {load_before}, after: {load_average()}."
        f" serve from {args.serve_from}"
        + "".join(f", serve-{name} from {path}" for name, path in args.serve_also.items())
        + ".\n"
    )
    rows = []
    for kind, rounds in results.items():
        for contender in contenders[kind]:
            windows = [r[contender] for r in rounds]
            rows.append(
                [
                    kind,
                    contender,
                    " / ".join(fmt(w.ms_per_probe, 3) for w in windows),
                    f"**{fmt(median([w.ms_per_probe for w in windows]), 3)}**",
                    fmt(median([w.rate for w in windows]), 1),
                    sum(w.failed for w in windows),
                    fmt(median([w.rss for w in windows]), 0),
                    fmt(median([1000 * w.containerd_cpu / max(w.probes, 1) for w in windows]), 3),
                ]
            )
    print(
        table(
            [
                "probe",
                "contender",
                "CPU ms/probe per round",
                "median",
                "probes/s",
                "not successful",
                "RSS MiB",
                "containerd ms/probe",
            ],
            rows,
        )
    )
    print()
    rows = []
    for kind, rounds in results.items():
        # Each serve over each later contender: serve / serve-before, then both over each loop.
        serves = [c for c in contenders[kind] if c in ("serve", "serve-before")]
        for numerator in serves:
            for contender in contenders[kind][1:]:
                if contender in serves[: serves.index(numerator) + 1]:
                    continue
                if numerator != "serve" and not contender.startswith("paced-"):
                    continue
                ratios = [r[numerator].ms_per_probe / r[contender].ms_per_probe for r in rounds]
                rows.append(
                    [
                        kind,
                        f"{numerator} / {contender}",
                        " / ".join(fmt(x, 2) for x in ratios),
                        f"**{fmt(median(ratios), 2)}**",
                    ]
                )
        for contender in contenders[kind][1:]:  # the thread exec mode beside its aio twin
            aio = contender.removesuffix("-thread")
            if contender == aio or aio not in contenders[kind]:
                continue
            ratios = [r[contender].ms_per_probe / r[aio].ms_per_probe for r in rounds]
            rows.append(
                [
                    kind,
                    f"{contender} / {aio}",
                    " / ".join(fmt(x, 2) for x in ratios),
                    f"**{fmt(median(ratios), 2)}**",
                ]
            )
    print(table(["probe", "ratio", "per round", "median"], rows))
    threaded = any(c.endswith("-thread") for cs in contenders.values() for c in cs)
    several = threaded or bool(args.serve_python) or bool(args.serve_also)
    whose = "CPU" if threaded else "serve's CPU"
    print(f"\n{whose} per thread group (ms per probe, median over rounds):\n")
    rows = []
    for kind, rounds in results.items():
        # With a thread exec mode, the paced children's threads too (where its CPU moved to).
        serves = [c for c in contenders[kind] if not c.startswith("paced-")]
        shown = contenders[kind] if threaded else serves
        for contender in shown:
            groups: dict[str, list[float]] = defaultdict(list)
            for r in rounds:
                w = r[contender]
                for group, cpu in w.threads.items():
                    groups[group].append(1000 * cpu / max(w.probes, 1))
            for group, values in sorted(groups.items(), key=lambda kv: -median(kv[1])):
                if median(values) >= 0.0005:
                    rows.append(
                        [kind, *([contender] if several else []), group, fmt(median(values), 3)]
                    )
    print(table(["probe", *(["contender"] if several else []), "thread", "ms/probe"], rows))
    if args.profile is not None:
        print(f"\nwhere serve's CPU goes (py-spy samples of every round, in {args.profile}):\n")
        spied = [
            row
            for kind in results
            for row in spy_rows(sorted(args.profile.glob(f"serve-{kind}-*.txt")), kind)
        ]
        print(table(["probe", "function (file)", "self", "on the stack"], spied))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 short rounds")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--targets", type=int, default=100, help="pods (and http/tcp/grpc loops)")
    parser.add_argument("--exec-targets", type=int, default=20, help="containers probed by exec")
    parser.add_argument("--ports", type=int, default=4, help="listener ports per kind")
    parser.add_argument("--paced-loop", choices=["asyncio", "uvloop", "both"], default="asyncio")
    parser.add_argument(
        "--paced-exec",
        default="aio",
        help="how the paced exec loop calls ExecSync, comma-separated contenders: aio (grpc.aio"
        f" stub), thread (blocking stub on {EXEC_THREADS} worker threads)",
    )
    parser.add_argument(
        "--paced-http",
        default="protocol",
        help="how the paced http loop sends its GET, comma-separated contenders: protocol (an"
        " asyncio Protocol, issue 36's comparator), streams (open_connection's reader and writer)",
    )
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float, help="measurement window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument(
        "--serve-from",
        type=Path,
        default=ROOT,
        help="run serve's cri_prober package from this directory (e.g. a snapshot of a commit)",
    )
    parser.add_argument(
        "--serve-before",
        type=Path,
        help="one more serve contender, serve-before, running the cri_prober package from this"
        " directory (e.g. a snapshot of main) in the same rounds",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more argument for serve (repeatable), e.g. --serve-arg=--max-concurrent-execs=16",
    )
    parser.add_argument(
        "--serve-python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one more serve contender, serve-NAME, run by the interpreter PATH (repeatable), e.g."
        " --serve-python py3.13=/tmp/venv313/bin/python",
    )
    parser.add_argument(
        "--serve-also",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="one more serve contender, serve-NAME, run from the cri_prober package in DIR"
        " (repeatable), e.g. a snapshot of main: --serve-also base=/tmp/sat-base",
    )
    parser.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="run stress-ng --cpu N through the measured rounds (a saturated node)",
    )
    parser.add_argument(
        "--trace-execs",
        action="store_true",
        help="time exec slot holds, ExecSync calls and the loop's lag inside serve and print them"
        " per window (with --together)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="sample serve with py-spy through each window into this directory and print where"
        " its CPU goes (needs py-spy: pip install py-spy)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run serve and the paced loop at once on the same targets (shadowing)",
    )
    # The paced loop's own process (internal).
    parser.add_argument("--paced-child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--paced-targets", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paced_child:
        paced_child_main(args)
        return
    if args.profile is not None:
        args.py_spy = py_spy()
        if args.py_spy is None:
            parser.error("--profile needs py-spy (pip install py-spy)")
        args.profile.mkdir(parents=True, exist_ok=True)
    args.kinds = args.kinds.split(",")
    pythons = [entry.partition("=") for entry in args.serve_python]
    if any(not name or not path or "-" in name or name == "before" for name, _, path in pythons):
        parser.error("--serve-python takes NAME=PATH, NAME without '-' and not 'before'")
    args.serve_python = {name: path for name, _, path in pythons}
    also = [entry.partition("=") for entry in args.serve_also]
    if any(not name or not path or "-" in name for name, _, path in also):
        parser.error("--serve-also takes NAME=DIR, NAME without '-'")
    args.serve_also = {name: Path(path) for name, _, path in also}
    if "before" in args.serve_also and args.serve_before is not None:
        parser.error("--serve-before is --serve-also before=DIR: give one of them")
    if args.serve_before is not None:
        args.serve_also["before"] = args.serve_before  # contender serve-before
    if set(args.serve_also) & set(args.serve_python):
        parser.error("--serve-also and --serve-python need different NAMEs")
    args.paced_exec = list(dict.fromkeys(args.paced_exec.split(",")))
    if set(args.paced_exec) - set(EXEC_MODES):
        parser.error(f"--paced-exec takes {' and/or '.join(EXEC_MODES)}, comma-separated")
    args.paced_http = list(dict.fromkeys(args.paced_http.split(",")))
    if set(args.paced_http) - set(HTTP_MODES):
        parser.error(f"--paced-http takes {' and/or '.join(HTTP_MODES)}, comma-separated")
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    args.exec_targets = min(args.exec_targets, args.targets)
    if args.quick:
        args.rounds = args.rounds or 2
        args.seconds = args.seconds or 8.0
    else:
        args.rounds = args.rounds or 4
        args.seconds = args.seconds or 20.0
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
