"""Log lines carry their context without passing it by hand: a pod source's lines its
``source``, an API call's lines its ``rpc`` and ``target``.

Lines are captured with structlog's context variables merged in, as ``logs.configure`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import grpc
import structlog
from structlog.testing import capture_logs

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import PolledSource
from cri_prober.serving.logcontext import MAX_TARGET_BYTES, request_fields
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeRuntimeServer
from tests.support.waiting import HANG_GUARD, until

MERGED = [structlog.contextvars.merge_contextvars]
SOURCE = "kubelet:http://127.0.0.1:10255/pods"
RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""


def _line(logs: list[MutableMapping[str, Any]], event: str) -> Mapping[str, Any]:
    (line,) = [entry for entry in logs if entry["event"] == event]
    return line


class FailingSource(PolledSource):
    """A polled source whose every read fails, after a library logged a line of its own."""

    async def poll(self) -> bool:
        structlog.get_logger("some.library").info("library_line")
        await asyncio.to_thread(structlog.get_logger("some.library").info, "thread_line")
        self.failed("connection refused")
        return True  # "changed", so the listener runs


async def test_a_sources_lines_carry_its_name_and_its_listeners_do_not() -> None:
    """Run by the registry, every line logged in the source's task or its threads carries
    ``source``; what the listener logs, and the tasks it starts, do not."""
    source = FailingSource(SOURCE, interval=60)
    registry = PodSpecs([source])
    listened = asyncio.Event()
    started: list[asyncio.Task[None]] = []

    async def worker() -> None:
        structlog.get_logger("manager").info("worker_line")

    def listener() -> None:
        structlog.get_logger("manager").info("listener_line")
        started.append(asyncio.create_task(worker()))
        listened.set()

    with capture_logs(processors=MERGED) as logs:
        registry.start(listener)
        async with asyncio.timeout(HANG_GUARD):
            await listened.wait()
            await asyncio.gather(*started)
        await registry.stop()
    assert _line(logs, "pod_source_failed")["source"] == SOURCE
    assert _line(logs, "library_line")["source"] == SOURCE
    assert _line(logs, "thread_line")["source"] == SOURCE
    assert "source" not in _line(logs, "listener_line")
    assert "source" not in _line(logs, "worker_line")
    assert structlog.contextvars.get_contextvars() == {}


def test_a_sources_own_lines_carry_its_name_even_outside_its_task() -> None:
    """The source's own lines are bound to its name, whoever calls it (the hand-passed
    ``source=`` they used to carry is gone)."""
    source = FailingSource(SOURCE, interval=60)
    with capture_logs() as logs:
        source.failed("connection refused")
        source.succeeded()
        source.replace_all([{"metadata": {"namespace": "shop"}}])  # no name: not a pod
    assert [(line["event"], line["source"]) for line in logs] == [
        ("pod_source_failed", SOURCE),
        ("pod_source_recovered", SOURCE),
        ("pod_spec_invalid", SOURCE),
    ]


async def test_a_calls_lines_carry_its_method_and_target(tmp_path: Path) -> None:
    """A line logged while TriggerProbe is served carries ``rpc`` and ``target``; the binding
    ends with the call."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as cri:
        sandbox = cri.runtime.add_sandbox("web-0")
        container = cri.runtime.add_container(sandbox, "app")
        async with running_daemon(cri.target, rules, pleg="relist", relist_period=0.1) as (
            daemon,
            _watcher,
        ):
            await until(lambda: daemon.manager.worker_count() > 0, timeout=HANG_GUARD)
            async with grpc.aio.insecure_channel(f"unix://{tmp_path}/api.sock") as channel:
                api = query_pb2_grpc.CriProberStub(channel)
                with capture_logs(processors=MERGED) as logs:
                    await api.TriggerProbe(
                        query_pb2.TriggerProbeRequest(target="default/web-0/app", kind="readiness")
                    )
    line = _line(logs, "probe_triggered")
    assert line["rpc"] == "/criprober.v1.CriProber/TriggerProbe"
    assert line["target"] == "default/web-0/app"
    assert line["container"] == f"default/web-0/app ({container.id[:13]})"
    assert structlog.contextvars.get_contextvars() == {}


def test_a_huge_target_is_clipped_and_a_request_without_one_binds_only_the_method() -> None:
    request = query_pb2.GetContainerRequest(target="x" * 10_000)
    fields = request_fields("/criprober.v1.CriProber/GetContainer", request)
    assert len(fields["target"].encode()) <= MAX_TARGET_BYTES + len("…".encode())
    listing = query_pb2.ListContainersRequest()
    assert request_fields("/m", listing) == {"rpc": "/m"}
