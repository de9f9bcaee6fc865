"""D5 end to end: ``serve`` restarts and a container still starting keeps its startup gating.

Two daemons run one after the other on the same fake runtime and state file, as a cri-prober
restart would (KEP-4781, docs/kubelet-semantics.md §3.12).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import GC_THRESHOLDS
from cri_prober.manager.api import ProbeOnHold
from cri_prober.manager.memory import Remembered, load_state, write_state
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD, until

RULES = """
probes:
  - match: {container: app}
    startupProbe: {exec: {command: [check-start]}, periodSeconds: 1, failureThreshold: 1000}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1}
"""


def attempts(manager: ProbeManager, container_id: str, kind: ProbeKind) -> int:
    """How many attempts the container's ``kind`` probe has run (0 when not configured)."""
    return next((p.attempts for p in manager.probe_states(container_id) if p.kind is kind), 0)


def started(manager: ProbeManager, container_id: str) -> bool:
    probed = manager.probed_container(container_id)
    assert probed is not None
    return probed.health.started


@pytest.mark.parametrize("state_file", ["auto", "none"])
async def test_restart_keeps_a_starting_container_starting(tmp_path: Path, state_file: str) -> None:
    async def exec_handler(
        _container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=1 if cmd == ["check-start"] else 0)

    runtime = FakeRuntime(exec_handler=exec_handler)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    state = tmp_path / "state.json"  # "auto": beside the API socket, tmp_path/api.sock
    keep: str | None = "auto" if state_file == "auto" else None
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        async with running_daemon(
            server.target, rules, pleg="relist", relist_period=0.2, state_file=keep
        ) as (daemon, watcher):
            await watcher.until(lambda: daemon.manager.tracked() == 1, 10)
            manager = daemon.manager
            await watcher.until(lambda: attempts(manager, app.id, ProbeKind.STARTUP) >= 1, 10)
            assert not started(manager, app.id)
        if state_file == "auto":
            assert load_state(state)[app.id] == Remembered(started=False, ready=False)
        else:
            assert not state.exists()

        # Time passes: the container now started long before the next cri-prober.
        app.started_at = time.time_ns() - 3600 * 10**9
        async with running_daemon(
            server.target, rules, pleg="relist", relist_period=0.2, state_file=keep
        ) as (daemon, watcher):
            await watcher.until(lambda: daemon.manager.tracked() == 1, 10)
            manager = daemon.manager
            if state_file == "auto":
                # Remembered as still starting: startup keeps probing, liveness stays gated.
                await watcher.until(lambda: attempts(manager, app.id, ProbeKind.STARTUP) >= 1, 10)
                assert not started(manager, app.id)
                assert attempts(manager, app.id, ProbeKind.LIVENESS) == 0
            else:
                # No memory: assumed started; liveness probes, startup idles.
                await watcher.until(lambda: attempts(manager, app.id, ProbeKind.LIVENESS) >= 1, 10)
                assert started(manager, app.id)
                assert attempts(manager, app.id, ProbeKind.STARTUP) == 0


@pytest.mark.parametrize("freeze_gc", [False, True])
async def test_serve_freezes_what_lives_once_ready(tmp_path: Path, freeze_gc: bool) -> None:
    """serve (freeze_gc, the CLI's setting) moves what exists once it is ready out of every
    later garbage collection; a daemon run inside another program leaves the GC alone."""
    runtime = FakeRuntime()
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    gc.unfreeze()
    thresholds = gc.get_threshold()
    try:
        async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
            runtime.add_container(runtime.add_sandbox("web"), "app")
            async with running_daemon(server.target, rules, pleg="relist", freeze_gc=freeze_gc) as (
                daemon,
                watcher,
            ):
                await watcher.until(lambda: daemon.manager.tracked() == 1, 10)
                workers = daemon.manager.worker_count()
                frozen = gc.get_freeze_count()
                running_thresholds = gc.get_threshold()
        assert (frozen > 0) is freeze_gc
        assert not freeze_gc or frozen > workers
        # Issue 25: fewer, larger young collections once serve is ready.
        assert (running_thresholds == GC_THRESHOLDS) is freeze_gc
    finally:
        gc.unfreeze()  # the test process's own objects go back to the collector
        gc.set_threshold(*thresholds)


async def test_remembered_containers_that_left_are_forgotten(tmp_path: Path) -> None:
    """Entries of containers gone while cri-prober was down leave memory after the first relist
    and the file at its first write; a container removed later leaves memory when it goes."""
    runtime = FakeRuntime()
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    state = tmp_path / "state.json"
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        gone = {f"{i:064x}": Remembered(started=True, ready=False) for i in range(1000)}
        write_state(state, {**gone, app.id: Remembered(started=False, ready=False)})
        async with running_daemon(server.target, rules, pleg="relist", relist_period=0.2) as (
            daemon,
            watcher,
        ):
            await watcher.until(lambda: daemon.manager.tracked() == 1, 10)
            await until(lambda: set(daemon.manager.remembered) == {app.id}, timeout=HANG_GUARD)
            await until(lambda: set(load_state(state)) == {app.id}, timeout=HANG_GUARD)
            # The memory that matters was kept.
            assert daemon.manager.remembered[app.id] == Remembered(started=False, ready=False)
            runtime.remove_container(app.id)
            await until(lambda: not daemon.manager.remembered, timeout=HANG_GUARD)
            await until(lambda: load_state(state) == {}, timeout=HANG_GUARD)


async def test_serve_starts_over_a_deeply_nested_state_file(tmp_path: Path) -> None:
    """100,000 levels of nesting once raised RecursionError out of serve at every start; now it
    is one log line and serve runs without memory."""
    runtime = FakeRuntime()
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    state = tmp_path / "state.json"
    state.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        runtime.add_container(runtime.add_sandbox("web"), "app")
        with capture_logs() as logs:
            async with running_daemon(server.target, rules, pleg="relist") as (daemon, watcher):
                await watcher.until(lambda: daemon.manager.tracked() == 1, 10)
                # Rewritten (read raw: loading the damaged file would log again).
                await until(lambda: state.read_bytes().startswith(b"{"), timeout=HANG_GUARD)
        ignored = [line for line in logs if line["event"].startswith("state_file_")]
        assert [(line["event"], line["file"]) for line in ignored] == [
            ("state_file_ignored", str(state))
        ]


HELD_RULES = """
probes:
  - match: {container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 1}
"""


async def test_restart_keeps_a_held_liveness_failure(tmp_path: Path) -> None:
    """Issue 34 item 3, across a cri-prober restart: a held liveness failure (the kubelet acts
    on it and holds until the container is replaced) stays published and held for the same
    container, instead of being probed again from the initial value. Kept in the state file."""

    async def exec_handler(
        _container: FakeContainer, _cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=1)

    runtime = FakeRuntime(exec_handler=exec_handler)
    rules = tmp_path / "rules.yaml"
    rules.write_text(HELD_RULES)
    state = tmp_path / "state.json"
    live = ProbeKind.LIVENESS
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        async with running_daemon(
            server.target, rules, pleg="relist", relist_period=0.2, failure_hold="always"
        ) as (daemon, watcher):
            manager = daemon.manager
            await watcher.until(lambda: manager.results.get(app.id, live) is Published.FAILURE)
            await until(
                lambda: state.exists() and load_state(state)[app.id].held, timeout=HANG_GUARD
            )
        assert load_state(state)[app.id] == Remembered(started=True, ready=True, held=True)

        app.started_at = time.time_ns() - 3600 * 10**9  # long before the next cri-prober
        async with running_daemon(
            server.target, rules, pleg="relist", relist_period=0.2, failure_hold="always"
        ) as (daemon, watcher):
            manager = daemon.manager
            await watcher.until(lambda: manager.tracked() == 1, 10)
            assert manager.results.get(app.id, live) is Published.FAILURE
            with pytest.raises(ProbeOnHold):
                manager.probe_now(app.id, live)
            assert attempts(manager, app.id, live) == 0
            assert not [t for t in watcher.transitions if t.kind is live]
