"""Run ``cri-prober serve`` with its exec path timed from inside: ``python -m bench._exec_trace
serve ...`` (the package comes from the working directory, as ``python -m cri_prober`` would).

``bench/run process_cpu --trace-execs`` uses it to tell where an exec slot's time goes on a
starved loop (issue 36): each slot's hold (granted to given back), each ExecSync call (sent to
answered, as the awaiting coroutine saw it) and the event loop's lag (how late a 50 ms timer
fires), all on CLOCK_MONOTONIC, which every process shares. The events go to the JSON file named
by ``CPRB_EXEC_TRACE`` when serve exits; the benchmark keeps those of its window. It wraps only
names every version of the exec path has (``ExecSlots._grant``, ``ExecSlots._release``,
``CriClient._call``), so it times the code of any commit the same way.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

LAG_PERIOD = 0.05


def install(path: str) -> None:
    from cri_prober.runtime import client, exec_slots

    holds: list[tuple[float, float]] = []  # (given back at, held seconds)
    calls: list[tuple[float, float]] = []  # (answered at, call seconds)
    lags: list[tuple[float, float]] = []  # (fired at, seconds late)
    granted: dict[int, float] = {}
    lag_task: list[asyncio.Task[None]] = []

    grant = exec_slots.ExecSlots._grant
    release = exec_slots.ExecSlots._release
    call = client.CriClient._call

    def traced_grant(self: Any, *args: Any, **kwargs: Any) -> Any:
        slot = grant(self, *args, **kwargs)
        granted[id(slot)] = time.monotonic()
        return slot

    def traced_release(self: Any, slot: Any) -> None:
        now = time.monotonic()
        if (at := granted.pop(id(slot), None)) is not None:
            holds.append((now, now - at))
        release(self, slot)

    async def lag_loop() -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + LAG_PERIOD
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            lags.append((time.monotonic(), now - due))
            due = now + LAG_PERIOD

    async def traced_call(self: Any, method: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if not lag_task:
            lag_task.append(asyncio.get_running_loop().create_task(lag_loop()))
        if method != "ExecSync":
            return await call(self, method, fn)
        started = time.monotonic()
        try:
            return await call(self, method, fn)
        finally:
            now = time.monotonic()
            calls.append((now, now - started))

    exec_slots.ExecSlots._grant = traced_grant  # type: ignore[method-assign]
    exec_slots.ExecSlots._release = traced_release  # type: ignore[method-assign]
    client.CriClient._call = traced_call  # type: ignore[method-assign,assignment]

    def dump() -> None:
        with open(path, "w", encoding="utf-8") as out:
            json.dump({"holds": holds, "calls": calls, "lags": lags}, out)

    atexit.register(dump)


def main() -> None:
    install(os.environ["CPRB_EXEC_TRACE"])
    from cri_prober.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
