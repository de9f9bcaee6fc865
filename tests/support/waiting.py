"""The one way a test waits for a condition: `until`, which re-checks it on an event when there
is one and polls briefly when there is none, and names what it awaited when time runs out."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeAlias

# How long a test waits for something before it calls it a hang: a guard, never a bound on
# speed. Generous, since on a busy machine (stress-ng beside the suite) a CLI subprocess's start-up
# alone took 20-30 s; a test asserts what happened (order, counts, relations), and timing claims
# live in bench/.
HANG_GUARD = 120.0
# How often a condition with no event to wait on is re-checked: short, since the fakes it
# watches change within milliseconds, and cheap, since predicates only read state.
POLL_SECONDS = 0.005
# A predicate's source in a timeout message is cut at this many characters.
_MAX_DESCRIPTION = 300

Changed: TypeAlias = asyncio.Event | Callable[[], Awaitable[object]]


async def until(
    predicate: Callable[[], object],
    *,
    timeout: float = HANG_GUARD,
    message: str | None = None,
    changed: Changed | None = None,
    poll: float = POLL_SECONDS,
) -> None:
    """Return as soon as ``predicate()`` is true; ``TimeoutError`` naming it after ``timeout`` s.

    ``changed`` says when the watched state may have changed, so the predicate is re-checked
    then and only then: an `asyncio.Event` (cleared before each wait, set by whoever changes the
    state) or a factory of awaitables (e.g. a watcher's next event). Without it the predicate is
    re-checked every ``poll`` seconds, for state with no signal (a fake's counters, files,
    other processes). ``message`` names what is awaited; by default the predicate's source.
    """
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                if changed is None:
                    await asyncio.sleep(poll)
                elif isinstance(changed, asyncio.Event):
                    changed.clear()
                    await changed.wait()
                else:
                    await changed()
    except TimeoutError:
        what = message if message is not None else describe(predicate)
        raise TimeoutError(f"not true within {timeout} s: {what}") from None


def describe(predicate: Callable[[], object]) -> str:
    """A readable name for ``predicate``: its source line(s) for a lambda, else its name."""
    name = getattr(predicate, "__qualname__", repr(predicate))
    if getattr(predicate, "__name__", None) == "<lambda>":
        try:
            source = " ".join(line.strip() for line in inspect.getsource(predicate).splitlines())
        except (OSError, TypeError):
            return name
        return source[:_MAX_DESCRIPTION]
    return name


__all__ = ["HANG_GUARD", "POLL_SECONDS", "Changed", "describe", "until"]
