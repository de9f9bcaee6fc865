"""One supervisor for every long-lived task: each starts, named, from a coroutine factory; an
unexpected exception is logged with the task's name and either restarts the task after a capped,
jittered back-off or asks serve to stop with a non-zero exit, and stop() ends them all in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Final, Literal

import structlog

log = structlog.get_logger(__name__)

Policy = Literal["restart", "fatal"]
TaskFactory = Callable[[], Coroutine[object, object, None]]

BACKOFF_INITIAL_SECONDS: Final = 0.5
BACKOFF_MAX_SECONDS: Final = 30.0
BACKOFF_JITTER: Final = 0.2  # each delay is up to 20 % longer (still capped)
# A task that ran this long before it failed was healthy: its back-off starts over.
HEALTHY_AFTER_SECONDS: Final = 60.0
EXIT_TASK_FAILED: Final = 1  # serve's exit status after a fatal task failed


class Supervisor:
    """Starts, restarts and stops the process's long-lived tasks; see the module docstring.

    ``stop`` is the process's stop request (the daemon waits on it): a fatal failure sets it,
    along with ``failed``, and makes ``exit_code`` non-zero. Once it is set, a task that ends on
    its own has simply seen it, and one that fails is logged but not restarted.
    """

    def __init__(
        self,
        *,
        stop: asyncio.Event | None = None,
        backoff_initial: float = BACKOFF_INITIAL_SECONDS,
        backoff_max: float = BACKOFF_MAX_SECONDS,
        healthy_after: float = HEALTHY_AFTER_SECONDS,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.stop_requested = stop if stop is not None else asyncio.Event()
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._healthy_after = healthy_after
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # in start order
        self._closed = False
        self.failed = asyncio.Event()
        self.exit_code = 0

    # -- starting -------------------------------------------------------------------------------

    def start(
        self, name: str, factory: TaskFactory, *, policy: Policy = "restart", forever: bool = True
    ) -> asyncio.Task[None] | None:
        """Run ``factory()`` as the task ``name`` until stopped; None once the supervisor closed.

        ``forever``: the task should run until cancelled, so ending on its own is a failure too;
        without it, returning is the task's normal end.
        """
        if self._closed:
            log.debug("task_not_started", task=name, reason="the supervisor is stopped")
            return None
        running = self._tasks.get(name)
        if running is not None and not running.done():
            raise ValueError(f"task {name!r} is already running")
        task = asyncio.get_running_loop().create_task(
            self._supervise(name, factory, policy, forever), name=name
        )
        self._tasks.pop(name, None)  # a restarted name moves to the end of the start order
        self._tasks[name] = task
        return task

    def running(self, name: str) -> bool:
        """Whether the task ``name`` is running (restart back-offs included)."""
        task = self._tasks.get(name)
        return task is not None and not task.done()

    def delay(self, attempt: int) -> float:
        """The back-off before restart ``attempt`` (1, 2, ...): doubling, jittered, capped."""
        base: float = self._backoff_initial * 2.0 ** min(attempt - 1, 32)
        return min(self._backoff_max, base * (1 + BACKOFF_JITTER * self._rng.random()))

    async def _supervise(
        self, name: str, factory: TaskFactory, policy: Policy, forever: bool
    ) -> None:
        attempt = 0
        while True:
            started = self._clock()
            error: BaseException | None = None
            current = asyncio.current_task()
            try:
                await factory()
            except asyncio.CancelledError as exc:
                if self._closed or current is None or current.cancelling():
                    raise
                error = exc  # a stray cancellation from inside, not a stop: a failure too
            except Exception as exc:
                error = exc
            stopping = self.stop_requested.is_set()
            if error is None and (not forever or stopping):
                return
            if stopping or self._closed or (current is not None and current.cancelling()):
                # It failed while being stopped: report it, and let the stop go on.
                log.error("task_failed", task=name, policy=policy, stopping=True, exc_info=error)
                return
            attempt = 1 if self._clock() - started >= self._healthy_after else attempt + 1
            failure = {
                "task": name,
                "policy": policy,
                "attempt": attempt,
                "reason": None if error is not None else "ended, but should run until stopped",
                "exc_info": error,
            }
            if policy == "fatal":
                log.error("task_failed", action="stopping serve", **failure)
                self._fatal()
                return
            delay = self.delay(attempt)
            log.error("task_failed", retry_in=round(delay, 3), **failure)
            del error, failure  # not kept alive (with its frames) through the back-off
            await self._sleep(delay)
            log.info("task_restarted", task=name, attempt=attempt)

    def _fatal(self) -> None:
        if self.failed.is_set():
            return
        self.exit_code = EXIT_TASK_FAILED
        self.failed.set()
        self.stop_requested.set()

    # -- stopping -------------------------------------------------------------------------------

    async def stop(self, names: Iterable[str] | None = None, *, grace: float = 0.0) -> None:
        """Stop the tasks ``names`` (default: all, and refuse new ones from now on): let them end
        on their own for up to ``grace`` seconds (tasks that watch the stop request finish their
        work), then cancel and await the rest one by one in reverse start order. Never raises."""
        if names is None:
            self._closed = True
            chosen = list(self._tasks)
        else:
            wanted = set(names)
            chosen = [name for name in self._tasks if name in wanted]
        if grace > 0 and chosen:
            await asyncio.wait([self._tasks[name] for name in chosen], timeout=grace)
        for name in reversed(chosen):
            task = self._tasks.pop(name, None)
            if task is None:
                continue
            task.cancel()
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                # The stop itself was cancelled: leave no task behind, then let it propagate.
                for rest in self._tasks.values():
                    rest.cancel()
                raise
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.error("task_stop_failed", task=name, exc_info=exc)


async def close_logged(name: str, closing: Awaitable[object]) -> None:
    """Await one step of a shutdown; an exception is logged with ``name``, never raised, so the
    steps after it still run."""
    try:
        await closing
    except Exception:
        log.exception("close_failed", part=name)


async def wait_first(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    if any(event.is_set() for event in events):
        return
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waiters, return_exceptions=True)


__all__ = [
    "BACKOFF_INITIAL_SECONDS",
    "BACKOFF_MAX_SECONDS",
    "EXIT_TASK_FAILED",
    "HEALTHY_AFTER_SECONDS",
    "Policy",
    "Supervisor",
    "TaskFactory",
    "close_logged",
    "wait_first",
]
