"""Timers as the code arms them: what a test checks instead of how long something took, which
on a busy machine says only how busy it was."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from cri_prober.probing.handlers import deadline


def record_timers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """Each ``call_later`` on the running loop from now on, as (delay, callback name).

    Only for asyncio's own loop (uvloop's methods cannot be replaced); the test's monkeypatch
    puts the loop's method back.
    """
    loop = asyncio.get_running_loop()
    armed: list[tuple[float, str]] = []
    call_later = loop.call_later

    def recording(
        delay: float, callback: Callable[..., object], *args: Any, **kwargs: Any
    ) -> asyncio.TimerHandle:
        armed.append((delay, getattr(callback, "__name__", repr(callback))))
        return call_later(delay, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_later", recording)
    return armed


@dataclass(frozen=True)
class ArmedDeadline:
    """One lag-aware probe timeout as it was armed: its deadline (loop time), how far ahead
    that was at the moment, and the probe's timeout."""

    at: float
    ahead: float
    timeout: float

    def is_for(self, timeout: float) -> bool:
        """Armed for a probe of ``timeout`` s, at most ``timeout`` s ahead (never later)."""
        return self.timeout == timeout and self.ahead <= timeout + 1e-9  # (float rounding)


def record_probe_deadlines(monkeypatch: pytest.MonkeyPatch) -> list[ArmedDeadline]:
    """Each lag-aware probe timeout armed from now on: the deadline a probe computed, rather
    than how long it took."""
    armed: list[ArmedDeadline] = []
    timeout_at, timeout_after = deadline.timeout_at, deadline.timeout_after

    def recording_at(at: float, timeout: float) -> deadline.LagAwareTimeout:
        armed.append(ArmedDeadline(at, at - asyncio.get_running_loop().time(), timeout))
        return timeout_at(at, timeout)

    def recording_after(timeout: float) -> deadline.LagAwareTimeout:
        scope = timeout_after(timeout)
        at = scope.deadline
        armed.append(ArmedDeadline(at, at - asyncio.get_running_loop().time(), timeout))
        return scope

    monkeypatch.setattr(deadline, "timeout_at", recording_at)
    monkeypatch.setattr(deadline, "timeout_after", recording_after)
    return armed


class CountingUvloop(uvloop.Loop):
    """uvloop's loop, counting the timers objects of ``counted`` arm through ``call_at`` (a hang
    guard's and the loop's other timers are not counted): how many times a timer was armed,
    where a spin re-arms it thousands of times (issue 36)."""

    counted: type = object

    def __init__(self) -> None:
        super().__init__()
        self.armed = 0

    def call_at(  # type: ignore[override]
        self, when: float, callback: Any, *args: Any, context: Any = None
    ) -> Any:
        if isinstance(getattr(callback, "__self__", None), self.counted):
            self.armed += 1
        return super().call_at(when, callback, *args, context=context)


def counting_uvloop(counted: type) -> type[CountingUvloop]:
    """A ``CountingUvloop`` class that counts the timers of ``counted``'s objects."""
    return type(f"Counting{counted.__name__}Loop", (CountingUvloop,), {"counted": counted})
