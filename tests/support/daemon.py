"""Run a ``serve`` daemon in-process and wait for conditions: the one copy every test and
benchmark uses.

The daemon runs on the caller's event loop, so a test can look at its manager, discovery and CRI
client directly, and await what it does through the manager's event stream instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.manager.events import ManagerEvent, subscribe_runs
from cri_prober.runtime.endpoints import Endpoint
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

if TYPE_CHECKING:
    from tests.support.fake_runtime import FakeRuntime


@dataclass(frozen=True, slots=True)
class InRuns:
    """A listener for ``running_daemon`` that takes a steady probe's repeated attempts in runs
    (``AttemptsRepeated``, ``subscribe_runs``) rather than an ``AttemptFinished`` each."""

    listener: Callable[[ManagerEvent], None]


@contextlib.asynccontextmanager
async def running_daemon(
    endpoint: str,
    rules_file: Path | None,
    *,
    ready_timeout: float = HANG_GUARD,
    stop_timeout: float = HANG_GUARD,
    listeners: Iterable[Callable[[ManagerEvent], None] | InRuns] = (),
    **config: object,
) -> AsyncIterator[tuple[Daemon, ManagerWatcher]]:
    """Run a ``serve`` daemon in-process on ``endpoint``; stop it (and require a clean stop).

    It waits until the daemon is ready (``ready_timeout`` 0: not at all) and fails with the
    daemon's own error if it dies first. Its API listens on ``api.sock`` beside ``rules_file``
    unless ``listen`` says otherwise (never the default path, which a real cri-prober on the
    machine may own). The watcher follows the daemon's manager from before its first probe, and
    so do ``listeners`` (subscribed to its events before it starts; unsubscribed at the end).
    A plain listener (the watcher too) takes every attempt, which turns the manager's steady
    fast path off while it is subscribed; one wrapped in ``InRuns`` takes repeated attempts in
    runs, as serve's own listeners do, and leaves it on (issue 36): benchmarks that measure what
    serve runs use those (and unsubscribe the watcher).
    """
    if rules_file is not None:
        config.setdefault("listen", f"unix://{rules_file.parent}/api.sock")
    serve_config = ServeConfig(
        endpoint=Endpoint(endpoint, "flag", endpoint),
        config_file=rules_file,
        **config,  # type: ignore[arg-type]
    )
    daemon = Daemon(serve_config, read_rules(rules_file))
    watcher = ManagerWatcher(daemon.manager)
    unsubscribes = [
        subscribe_runs(daemon.manager.events, listener.listener)
        if isinstance(listener, InRuns)
        else daemon.manager.events.subscribe(listener)
        for listener in listeners
    ]
    task = asyncio.create_task(daemon.run(), name="daemon under test")
    try:
        if ready_timeout > 0:
            async with asyncio.timeout(ready_timeout):
                ready = asyncio.ensure_future(daemon.ready.wait())
                try:
                    # If the daemon dies before it is ready, fail with its error, not a timeout.
                    await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ready.cancel()
                if task.done():
                    task.result()
                    raise AssertionError("the daemon returned before it was ready")
        yield daemon, watcher
    finally:
        watcher.unsubscribe()
        for unsubscribe in unsubscribes:
            unsubscribe()
        daemon.stop_event.set()
        async with asyncio.timeout(stop_timeout):
            await task


@contextlib.asynccontextmanager
async def daemon_on_fake_runtime(
    directory: Path,
    runtime: FakeRuntime,
    rules: str,
    *,
    pleg: str = "relist",
    relist_period: float = 0.2,
    **config: Any,
) -> AsyncIterator[tuple[Daemon, ManagerWatcher]]:
    """`running_daemon` on ``runtime``, served at ``directory/cri.sock``, with ``rules`` written
    to ``directory/rules.yaml``: the setup of the client command tests.

    By default the daemon finds containers by relisting every 0.2 s rather than by the event
    stream, so it sees what ``runtime`` holds within one short period; ``config`` is any other
    argument of `running_daemon`.
    """
    # Imported here, not above: benchmarks import this module into the daemon whose memory and
    # CPU they measure, and the fake runtime (about 0.4 MiB) is no part of it.
    from tests.support.fake_runtime import FakeRuntimeServer

    rules_file = directory / "rules.yaml"
    rules_file.write_text(rules)
    async with (
        FakeRuntimeServer(str(directory / "cri.sock"), runtime) as cri_server,
        running_daemon(
            cri_server.target, rules_file, pleg=pleg, relist_period=relist_period, **config
        ) as running,
    ):
        yield running


__all__ = ["InRuns", "daemon_on_fake_runtime", "running_daemon"]
