"""PreStop hooks: parsing the kubelet's annotation, running exec/httpGet/sleep hooks within the
grace period, and the grace period left for StopContainer.

exec hooks run against a small fake runner, httpGet hooks against an in-process HTTP server.
Tests of a hook cut at the grace period wait one real second: grace periods are whole seconds.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from cri_prober.errors import CriNotFound
from cri_prober.probing.hooks import (
    LIFECYCLE_USER_AGENT,
    MIN_GRACE_SECONDS,
    PRE_STOP_ANNOTATION,
    HookOutcome,
    InvalidPreStop,
    PreStopHook,
    parse_pre_stop,
    pre_stop_hook,
    remaining_grace,
    run_pre_stop,
)
from cri_prober.probing.prober import ProbeTarget
from cri_prober.probing.spec import ExecAction, HTTPGetAction
from cri_prober.probing.spec.lifecycle import SleepAction
from cri_prober.runtime.model import ExecResult
from tests.support.local_server import LocalServer

CONTAINER = "c0ffee"


def _hook(annotation: object) -> PreStopHook:
    parsed = parse_pre_stop(json.dumps(annotation))
    assert isinstance(parsed, PreStopHook), parsed
    return parsed


def _invalid(annotation: str) -> str:
    parsed = parse_pre_stop(annotation)
    assert isinstance(parsed, InvalidPreStop), parsed
    return parsed.message


# -- parsing ---------------------------------------------------------------------------------


def test_parses_the_three_hook_types_as_the_kubelet_writes_them() -> None:
    exec_hook = _hook({"exec": {"command": ["sh", "-c", "nginx -s quit"]}})
    assert exec_hook.kind == "exec"
    assert exec_hook.action == ExecAction(command=("sh", "-c", "nginx -s quit"))

    http_hook = _hook({"httpGet": {"path": "/shutdown", "port": "http", "scheme": "HTTPS"}})
    assert http_hook.kind == "httpGet"
    assert isinstance(http_hook.action, HTTPGetAction)
    assert (http_hook.action.port, http_hook.action.scheme) == ("http", "HTTPS")

    sleep_hook = _hook({"sleep": {"seconds": 5}})
    assert sleep_hook.kind == "sleep"
    assert sleep_hook.action == SleepAction(seconds=5)


def test_http_defaults_and_go_style_leniency() -> None:
    # The API defaults path and scheme; Go ignores unknown keys and treats null as unset.
    hook = _hook({"httpGet": {"port": 8080}, "exec": None, "futureField": {"x": 1}})
    assert isinstance(hook.action, HTTPGetAction)
    assert (hook.action.path, hook.action.scheme, hook.action.host) == ("/", "HTTP", "")


def test_the_first_handler_in_the_kubelets_order_wins() -> None:
    assert _hook({"sleep": {"seconds": 1}, "exec": {"command": ["true"]}}).kind == "exec"
    assert _hook({"sleep": {"seconds": 1}, "httpGet": {"port": 80}}).kind == "httpGet"
    # tcpSocket is not runnable, so a sleep beside it is what runs.
    assert _hook({"tcpSocket": {"port": 80}, "sleep": {"seconds": 1}}).kind == "sleep"


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        ('{"exec": ', "not valid JSON: line 1, column 10"),
        ("[1, 2]", "must be a JSON object"),
        ("{}", "names no handler type"),
        ('{"preStart": {"command": ["true"]}}', "names no handler type"),
        ('{"tcpSocket": {"port": 80}}', "tcpSocket is not supported"),
        ('{"exec": {"command": []}}', "exec.command: must not be empty"),
        ('{"sleep": {"seconds": "5"}}', "sleep.seconds: must be an integer"),
        ('{"httpGet": {"port": 0}}', "httpGet.port: must be a valid port name or number"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
)
def test_unusable_annotations_give_an_error_value(annotation: str, expected: str) -> None:
    assert expected in _invalid(annotation)


def test_pre_stop_hook_reads_the_annotation() -> None:
    assert pre_stop_hook({}) is None
    hook = pre_stop_hook({PRE_STOP_ANNOTATION: '{"sleep": {"seconds": 3}}'})
    assert isinstance(hook, PreStopHook)
    assert hook.kind == "sleep"
    assert isinstance(pre_stop_hook({PRE_STOP_ANNOTATION: "nope"}), InvalidPreStop)


# -- the grace arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grace", "elapsed", "remaining"),
    [
        (30, 0, 30),  # no hook, or one that took under a second
        (30, 5, 25),
        (30, 28, 2),
        (30, 29, 2),  # 1 s left is raised to the 2 s floor
        (30, 30, 2),  # cut at the grace period
        (45, 40, 5),
        (2, 0, 2),
        (1, 0, 2),
        (0, 0, 2),  # no time for a hook, still a 2 s SIGTERM window
    ],
)
def test_remaining_grace(grace: int, elapsed: int, remaining: int) -> None:
    assert remaining_grace(grace, elapsed) == remaining


# -- exec -------------------------------------------------------------------------------------


@dataclass
class _Runner:
    """A fake ExecRunner: answers ``result`` (or raises it), or blocks until cancelled."""

    result: ExecResult | Exception = field(default_factory=lambda: ExecResult(0, b"", b""))
    block: bool = False
    calls: list[tuple[str, list[str], int]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        self.calls.append((container_id, list(cmd), timeout))
        self.started.set()
        if self.block:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


_TARGET = ProbeTarget(container_id=CONTAINER, pod_ip="127.0.0.1", env={"GREETING": "hi"})


async def test_exec_hook_runs_the_command_verbatim_in_the_container() -> None:
    runner = _Runner()
    hook = _hook({"exec": {"command": ["echo", "$(GREETING)"]}})
    run = await run_pre_stop(hook, _TARGET, grace_seconds=30, exec_runner=runner)
    assert (run.kind, run.outcome, run.message) == ("exec", HookOutcome.COMPLETED, "")
    assert (run.elapsed_seconds, run.grace_seconds, run.remaining_grace) == (0, 30, 30)
    # No $(VAR) expansion for hooks; the runtime's own timeout only backs up the grace period.
    assert runner.calls == [(CONTAINER, ["echo", "$(GREETING)"], 31)]


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ExecResult(3, b"draining\n", b"boom"), "command 'drain' exited with 3: draining\nboom"),
        (ExecResult(None, b"", b"", timed_out=True), "command 'drain' timed out"),
        (
            CriNotFound("ExecSync", grpc.StatusCode.NOT_FOUND, "no such container"),
            "command 'drain' could not run: ExecSync: NOT_FOUND: no such container",
        ),
        (RuntimeError("runner bug"), "unexpected error: RuntimeError: runner bug"),
    ],
)
async def test_exec_hook_errors_are_reported_not_raised(
    result: ExecResult | Exception, expected: str
) -> None:
    runner = _Runner(result=result)
    hook = _hook({"exec": {"command": ["drain"]}})
    run = await run_pre_stop(hook, _TARGET, grace_seconds=10, exec_runner=runner)
    assert run.outcome is HookOutcome.FAILED
    assert run.message == expected
    assert run.remaining_grace == 10


async def test_a_hook_longer_than_the_grace_period_is_cut_at_it() -> None:
    runner = _Runner(block=True)
    hook = _hook({"exec": {"command": ["sleep", "3600"]}})
    run = await run_pre_stop(hook, _TARGET, grace_seconds=1, exec_runner=runner)
    assert run.outcome is HookOutcome.CUT
    assert "grace period of 1s" in run.message
    assert run.elapsed_seconds == 1
    assert run.seconds >= 0.9
    assert run.remaining_grace == MIN_GRACE_SECONDS
    assert runner.cancelled, "the ExecSync call is cancelled, not left running"


async def test_no_hook_runs_without_a_grace_period() -> None:
    runner = _Runner()
    hook = _hook({"exec": {"command": ["drain"]}})
    run = await run_pre_stop(hook, _TARGET, grace_seconds=0, exec_runner=runner)
    assert (run.outcome, run.elapsed_seconds, run.remaining_grace) == (HookOutcome.SKIPPED, 0, 2)
    assert runner.calls == []


async def test_cancelling_the_caller_is_not_swallowed() -> None:
    runner = _Runner(block=True)
    hook = _hook({"exec": {"command": ["drain"]}})
    task = asyncio.create_task(run_pre_stop(hook, _TARGET, grace_seconds=30, exec_runner=runner))
    await runner.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runner.cancelled


# -- sleep ------------------------------------------------------------------------------------


async def test_sleep_hook_sleeps_and_its_whole_seconds_are_subtracted() -> None:
    run = await run_pre_stop(
        _hook({"sleep": {"seconds": 1}}), _TARGET, grace_seconds=5, exec_runner=_Runner()
    )
    assert (run.kind, run.outcome) == ("sleep", HookOutcome.COMPLETED)
    assert run.seconds >= 1.0
    assert (run.elapsed_seconds, run.remaining_grace) == (1, 4)


async def test_a_zero_sleep_returns_at_once() -> None:
    run = await run_pre_stop(
        _hook({"sleep": {"seconds": 0}}), _TARGET, grace_seconds=5, exec_runner=_Runner()
    )
    assert (run.outcome, run.elapsed_seconds, run.remaining_grace) == (HookOutcome.COMPLETED, 0, 5)


async def test_a_sleep_past_the_grace_period_is_cut() -> None:
    run = await run_pre_stop(
        _hook({"sleep": {"seconds": 60}}), _TARGET, grace_seconds=1, exec_runner=_Runner()
    )
    assert (run.outcome, run.elapsed_seconds, run.remaining_grace) == (HookOutcome.CUT, 1, 2)


# -- httpGet ----------------------------------------------------------------------------------


@dataclass
class _Request:
    line: str
    headers: dict[str, str]


@dataclass
class _Server(LocalServer):
    """A plain HTTP/1.1 server answering every request with ``status``; it also answers a TLS
    ClientHello with a plain HTTP 400, as Go's and most servers do."""

    status: int = 200
    stall: bool = False
    requests: list[_Request] = field(default_factory=list)
    tls_hellos: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(1)
        if first == b"\x16":  # a TLS handshake record
            self.tls_hellos += 1
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            return
        head = (first + await reader.readuntil(b"\r\n\r\n")).decode()
        line, *header_lines = head.split("\r\n")[:-2]
        headers = dict(h.split(": ", 1) for h in header_lines)
        self.requests.append(_Request(line, headers))
        if self.stall:
            await asyncio.Event().wait()
        body = b"not what you hoped"
        writer.write(
            f"HTTP/1.1 {self.status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()


@pytest.fixture
async def server() -> AsyncIterator[_Server]:
    srv = _Server()
    await srv.start()
    yield srv
    await srv.stop()


def _ports(**named: int) -> str:
    return json.dumps(
        [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in named.items()]
    )


async def test_http_hook_requests_the_pod_ip_with_the_kubelets_headers(server: _Server) -> None:
    server.status = 500  # the kubelet never looks at the status
    target = ProbeTarget(
        container_id=CONTAINER, pod_ip="127.0.0.1", ports_annotation=_ports(web=server.port)
    )
    hook = _hook(
        {
            "httpGet": {
                "path": "/drain?now=1",
                "port": "web",
                "httpHeaders": [{"name": "X-Token", "value": "t"}],
            }
        }
    )
    run = await run_pre_stop(hook, target, grace_seconds=30, exec_runner=_Runner())
    assert (run.kind, run.outcome, run.message) == ("httpGet", HookOutcome.COMPLETED, "")
    [request] = server.requests
    assert request.line == "GET /drain?now=1 HTTP/1.1"
    assert request.headers["Host"] == f"127.0.0.1:{server.port}"
    assert request.headers["User-Agent"] == LIFECYCLE_USER_AGENT
    assert LIFECYCLE_USER_AGENT.startswith("kube-lifecycle/1.")
    assert request.headers["Accept"] == "*/*"
    assert request.headers["X-Token"] == "t"


async def test_http_hook_host_and_user_agent_from_the_spec(server: _Server) -> None:
    target = ProbeTarget(container_id=CONTAINER, pod_ip="", host_network=True)
    hook = _hook(
        {
            "httpGet": {
                "host": "127.0.0.1",
                "port": server.port,
                "httpHeaders": [{"name": "user-agent", "value": "mine"}],
            }
        }
    )
    run = await run_pre_stop(hook, target, grace_seconds=5, exec_runner=_Runner())
    assert run.outcome is HookOutcome.COMPLETED
    assert server.requests[0].headers["User-Agent"] == "mine"


async def test_https_hook_answered_in_plain_http_is_retried_over_http(server: _Server) -> None:
    target = ProbeTarget(container_id=CONTAINER, pod_ip="127.0.0.1")
    hook = _hook(
        {
            "httpGet": {
                "port": server.port,
                "scheme": "HTTPS",
                "httpHeaders": [
                    {"name": "Authorization", "value": "Bearer x"},
                    {"name": "X-A", "value": "1"},
                ],
            }
        }
    )
    run = await run_pre_stop(hook, target, grace_seconds=5, exec_runner=_Runner())
    assert run.outcome is HookOutcome.COMPLETED, run.message
    assert server.tls_hellos == 1
    [request] = server.requests
    assert "Authorization" not in request.headers
    assert request.headers["X-A"] == "1"


@pytest.mark.parametrize(
    ("target", "port", "expected"),
    [
        # A host-network pod has no sandbox IP; the kubelet fails such hooks too.
        (ProbeTarget(container_id=CONTAINER, host_network=True), 80, "failed to find networking"),
        (
            ProbeTarget(container_id=CONTAINER, pod_ip="127.0.0.1"),
            "admin",
            'port "admin" not found',
        ),
    ],
)
async def test_http_hook_that_cannot_be_aimed_fails(
    target: ProbeTarget, port: int | str, expected: str
) -> None:
    run = await run_pre_stop(
        _hook({"httpGet": {"port": port}}), target, grace_seconds=5, exec_runner=_Runner()
    )
    assert run.outcome is HookOutcome.FAILED
    assert expected in run.message


async def test_http_hook_to_a_closed_port_fails() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    target = ProbeTarget(container_id=CONTAINER, pod_ip="127.0.0.1")
    run = await run_pre_stop(
        _hook({"httpGet": {"port": port}}), target, grace_seconds=5, exec_runner=_Runner()
    )
    assert run.outcome is HookOutcome.FAILED
    assert "connect" in run.message
    assert run.remaining_grace == 5


async def test_http_hook_that_never_answers_is_cut_at_the_grace_period(server: _Server) -> None:
    server.stall = True
    target = ProbeTarget(container_id=CONTAINER, pod_ip="127.0.0.1")
    run = await run_pre_stop(
        _hook({"httpGet": {"port": server.port}}), target, grace_seconds=1, exec_runner=_Runner()
    )
    assert (run.outcome, run.elapsed_seconds, run.remaining_grace) == (HookOutcome.CUT, 1, 2)
    assert len(server.requests) == 1
