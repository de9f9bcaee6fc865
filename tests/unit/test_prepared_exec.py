"""A prepared exec probe (issue 36): the ``$(VAR)`` expansion and the ExecSync request are built
once per prepared probe and sent again at every attempt, and built anew when what they depend
on changes (the container, its env, the command, the timeout); every attempt is still one
ExecSync call, counted as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.probing.handlers import exec as exec_handler
from cri_prober.probing.handlers.exec import MAX_COMMAND_BYTES, CommandTooLarge
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeResult
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.spec import parse_probe_json
from cri_prober.probing.spec.model import Probe
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import CriCall
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.memory_cri import memory_client


async def echo(_c: FakeContainer, cmd: list[str], _timeout: int) -> api_pb2.ExecSyncResponse:
    """Every command succeeds and prints its argv."""
    return api_pb2.ExecSyncResponse(exit_code=0, stdout=" ".join(cmd).encode())


@pytest.fixture(name="runtime")
def _runtime() -> FakeRuntime:
    return FakeRuntime(exec_handler=echo)


@pytest.fixture(name="cri")
async def _cri(runtime: FakeRuntime) -> AsyncIterator[CriClient]:
    async with memory_client(runtime) as client:
        yield client


def sent_requests(cri: CriClient, monkeypatch: pytest.MonkeyPatch) -> list[api_pb2.ExecSyncRequest]:
    """Each ExecSyncRequest the client hands grpc, the object itself, as it sends it."""
    requests: list[api_pb2.ExecSyncRequest] = []
    stub = cri._stub
    call = stub.ExecSync

    def recording(request: api_pb2.ExecSyncRequest, *, timeout: float | None = None) -> Any:
        requests.append(request)
        return call(request, timeout=timeout)

    monkeypatch.setattr(stub, "ExecSync", recording)
    return requests


def exec_probe(command: list[str], *, timeout: int = 1) -> Probe:
    spec = f'{{"exec": {{"command": {command!r}}}, "timeoutSeconds": {timeout}}}'
    return parse_probe_json(spec.replace("'", '"'), ProbeKind.READINESS, source="test")


def target(runtime: FakeRuntime, env: dict[str, str] | None = None) -> ProbeTarget:
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    return ProbeTarget(container.id, env=env)


async def test_repeated_attempts_send_the_request_built_once(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = sent_requests(cri, monkeypatch)
    aim = target(runtime, {"WHO": "world"})
    prepared = Prober(cri).prepare(exec_probe(["echo", "$(WHO)"], timeout=3), aim)
    outcomes = [await prepared.run() for _ in range(3)]
    assert [(o.result, o.output) for o in outcomes] == [(ProbeResult.SUCCESS, "echo $(WHO)")] * 3
    assert len(requests) == 3  # one ExecSync per attempt, as before
    # On the code before issue 36: a new message per attempt.
    assert requests[0] is requests[1] is requests[2]
    assert (requests[0].container_id, list(requests[0].cmd), requests[0].timeout) == (
        aim.container_id,
        ["echo", "world"],
        3,
    )


async def test_the_command_is_expanded_once_per_prepared_probe(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    expansions: list[list[str]] = []
    expand = exec_handler.expand

    def counting(command: Any, env: Any, **kwargs: Any) -> exec_handler.Expansion:
        expansions.append(list(command))
        return expand(command, env, **kwargs)

    monkeypatch.setattr(exec_handler, "expand", counting)
    prepared = Prober(cri).prepare(exec_probe(["echo", "$(A)"]), target(runtime, {"A": "1"}))
    for _ in range(3):
        assert (await prepared.run()).output == "echo $(A)"  # the value is masked
    assert expansions == [["echo", "$(A)"]]  # on the code before issue 36: once per attempt


async def test_what_the_request_depends_on_builds_a_new_one(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new env value, another container, command or timeout is sent from the next prepared
    probe on (the worker prepares again when ``fits`` says the old one no longer does)."""
    requests = sent_requests(cri, monkeypatch)
    prober = Prober(cri)
    probe = exec_probe(["echo", "$(A)"])
    first = target(runtime, {"A": "1"})
    changed_env = ProbeTarget(first.container_id, env={"A": "2"})
    other = target(runtime, {"A": "1"})
    prepared = prober.prepare(probe, first)
    assert not prepared.fits(prober, probe, changed_env, "rules")
    runs = [
        (probe, first),
        (probe, changed_env),
        (probe, other),
        (exec_probe(["echo", "b"]), first),
        (exec_probe(["echo", "$(A)"], timeout=5), first),
    ]
    for spec, aim in runs:
        await prober.prepare(spec, aim).run()
    assert [(r.container_id, list(r.cmd), r.timeout) for r in requests] == [
        (first.container_id, ["echo", "1"], 1),
        (first.container_id, ["echo", "2"], 1),
        (other.container_id, ["echo", "1"], 1),
        (first.container_id, ["echo", "b"], 1),
        (first.container_id, ["echo", "1"], 5),
    ]


async def test_a_command_too_large_errors_at_every_attempt_without_an_exec(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    big = "x" * (MAX_COMMAND_BYTES // 2)
    aim = target(runtime, {"BIG": big})
    prepared = Prober(cri).prepare(exec_probe(["echo", "$(BIG)", "$(BIG)", "$(BIG)"]), aim)
    for _ in range(2):
        with pytest.raises(CommandTooLarge):
            await prepared.run()
    assert "ExecSync" not in runtime.calls


async def test_every_attempt_is_one_cri_call_as_before(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    """cri_prober_cri_requests_total counts what the client publishes: one call per exec."""
    calls: list[CriCall] = []
    cri.calls.subscribe(calls.append)
    prepared = Prober(cri).prepare(exec_probe(["true"]), target(runtime))
    for _ in range(3):
        await prepared.run()
    assert [(c.method, c.code) for c in calls] == [("ExecSync", "OK")] * 3


async def test_an_exec_call_sends_its_request_at_each_call(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = sent_requests(cri, monkeypatch)
    aim = target(runtime)
    call = cri.exec_call(aim.container_id, ["echo", "hi"], timeout=2)
    results = [await call() for _ in range(2)]
    assert [(r.exit_code, r.stdout) for r in results] == [(0, b"echo hi")] * 2
    assert requests[0] is requests[1]
    # exec_sync is the same call built for one exec.
    assert (await cri.exec_sync(aim.container_id, ["echo", "hi"], timeout=2)).stdout == b"echo hi"
    assert requests[2] == requests[0]
    assert (cri.execs_in_flight, cri.execs_outstanding) == (0, 0)


async def test_execs_share_one_timer_for_their_slot_bounds(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot's start hold and longest hold are kept by one timer for all slots, armed for the
    earliest bound, not by two timers made and cancelled per exec (on the code before: 10)."""
    armed: list[str] = []
    loop = asyncio.get_running_loop()
    call_at = loop.call_at

    def recording(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        armed.append(getattr(callback, "__qualname__", repr(callback)))
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", recording)
    prepared = Prober(cri).prepare(exec_probe(["true"]), target(runtime))
    for _ in range(5):
        assert (await prepared.run()).result is ProbeResult.SUCCESS
    slot_timers = [name for name in armed if "soften" in name or "give_back" in name]
    slot_timers += [name for name in armed if name.startswith("ExecSlots.")]
    assert slot_timers == ["ExecSlots._on_timer"]
