"""A probe manager on an in-memory fake runtime whose exec checks exit as the test says: the
world of the tests of failure holds (``test_failure_hold``, ``test_hold_thresholds``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import FailureHold, OnFailure, ProbeManager
from cri_prober.manager.state import ProbeState
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import Published
from cri_prober.probing.spec import RulesFile
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.watchers import ManagerWatcher


@dataclass
class World:
    runtime: FakeRuntime
    discovery: Discovery
    manager: ProbeManager
    watcher: ManagerWatcher
    exit_codes: dict[str, int]  # by the command's first word: what the check exits with

    async def start(self) -> FakeContainer:
        """Run container ``app`` in pod ``web`` and let the manager see it (one relist)."""
        sandbox = self.runtime.add_sandbox("web")
        app = self.runtime.add_container(sandbox, "app")
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())
        return app

    def state(self, container_id: str, kind: ProbeKind) -> ProbeState:
        [state] = [p for p in self.manager.probe_states(container_id) if p.kind is kind]
        return state

    def published(self, container_id: str, kind: ProbeKind) -> Published | None:
        return self.manager.results.get(container_id, kind)


@contextlib.asynccontextmanager
async def manager_world(
    rules: RulesFile,
    exit_codes: dict[str, int],
    *,
    failure_hold: FailureHold = "auto",
    on_failure: OnFailure = "report",
) -> AsyncIterator[World]:
    """A `World` with ``rules``, its checks exiting with ``exit_codes`` (the test changes them
    in place); with ``on_failure="stop"`` the manager stops containers through the fake runtime.
    On exit the manager shuts down."""

    async def exec_handler(
        _container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=exit_codes[cmd[0]], stdout=b"checked")

    runtime = FakeRuntime(exec_handler=exec_handler)
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=rules,
            prober_started_at=0,  # long ago: no start-up jitter, no KEP-4781 adoption
            on_failure=on_failure,
            stopper=cri if on_failure == "stop" else None,
            failure_hold=failure_hold,
        )
        world = World(runtime, Discovery(cri), manager, ManagerWatcher(manager), exit_codes)
        try:
            yield world
        finally:
            world.watcher.unsubscribe()
            await manager.shutdown(grace=2)


__all__ = ["World", "manager_world"]
