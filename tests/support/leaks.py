"""The leaked-task check behind the suite's autouse ``no_leaked_tasks`` fixture (tests/conftest.py):
an async test must end with no task it (or its fixtures) started still pending on its loop.

pytest-asyncio cancels whatever is left when it closes a test's loop, which would hide a task a
test (or the product under it) forgot to stop; this makes that a test error that names it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

# The runner (and so the loop) of a test whose loop scope is "function", the suite's default.
FUNCTION_RUNNER_FIXTURE = "_function_scoped_runner"
# Event loop turns a finished test gets for its tasks to see a cancellation or a close and end.
SETTLE_TURNS = 20
# Then at most this long for tasks still winding down (e.g. a closed channel's last callbacks):
# generous, since a busy machine slows them, and only a task that is really left costs the wait.
SETTLE_SECONDS = 10.0


def describe_task(task: asyncio.Task[object]) -> str:
    """The task's name, its coroutine and where that coroutine is suspended."""
    coro = task.get_coro()
    what = getattr(coro, "__qualname__", repr(coro))
    frame = getattr(coro, "cr_frame", None)
    where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    return f"{task.get_name()}: {what}{where}"


async def pending_after(before: set[asyncio.Task[object]]) -> list[asyncio.Task[object]]:
    """The tasks on the running loop that were not in ``before`` and do not end by themselves
    within a few loop turns and `SETTLE_SECONDS` (this coroutine's own task excluded)."""

    def new() -> set[asyncio.Task[object]]:
        return asyncio.all_tasks() - before - {asyncio.current_task()}

    for _ in range(SETTLE_TURNS):
        if not new():
            return []
        await asyncio.sleep(0)
    if leaked := new():
        await asyncio.wait(leaked, timeout=SETTLE_SECONDS)
    return sorted(new(), key=lambda task: task.get_name())


def uses_function_loop(item: pytest.Item) -> bool:
    """Whether ``item`` is an async test run on its own function-scoped loop (which is all of
    them here: asyncio_mode=auto marks every coroutine test, and none asks for a wider scope)."""
    marker = item.get_closest_marker("asyncio")
    if marker is None:
        return False
    scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope") or "function"
    return bool(scope == "function")


def check_no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fixture's body: note the loop's tasks before the test, fail if new ones outlive it.

    Sync tests are skipped (they have no test loop; those that run a loop of their own close it
    themselves). Its setup runs before the test's other function fixtures and its teardown after
    theirs, so what they stop in their teardown does not count as leaked.
    """
    if not uses_function_loop(request.node):
        yield
        return
    runner: asyncio.Runner = request.getfixturevalue(FUNCTION_RUNNER_FIXTURE)
    before = asyncio.all_tasks(runner.get_loop())
    yield
    leaked = runner.run(pending_after(before))
    if leaked:
        names = "\n  ".join(describe_task(task) for task in leaked)
        pytest.fail(
            f"{len(leaked)} task(s) the test started are still pending after it and its "
            f"fixtures ended (stop them in the test or a fixture's teardown):\n  {names}",
            pytrace=False,
        )
