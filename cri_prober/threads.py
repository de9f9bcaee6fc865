"""Worker threads that never hold up the process's exit: serve's default executor.

``asyncio.to_thread`` runs on the loop's default executor, whose threads both the loop's shutdown
and the interpreter's exit wait for, so one call stuck in the kernel (open() of a FIFO with no
writer, a read from a hung NFS mount) kept serve from ever exiting, SIGTERM or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(slots=True)
class _Job:
    future: Future[Any]
    call: Callable[[], Any]
    name: str


def describe(call: Callable[..., object]) -> str:
    """What a submitted callable runs, for a log line: ``module.qualname`` of the function inside
    any ``functools.partial`` and ``Context.run`` wrapping (``asyncio.to_thread`` adds both)."""
    while isinstance(call, functools.partial):
        inner = call.func
        owner = getattr(inner, "__self__", None)
        if isinstance(owner, contextvars.Context) and call.args and callable(call.args[0]):
            call = call.args[0]  # to_thread's partial(context.run, func, *args)
        else:
            call = inner
    module = getattr(call, "__module__", None)
    name = getattr(call, "__qualname__", None) or type(call).__qualname__
    return f"{module}.{name}" if module else name


class WorkerThreads(ThreadPoolExecutor):
    """A thread pool of daemon threads whose shutdown waits at most ``join_timeout`` seconds.

    A thread still running a call after that is abandoned: as a daemon thread it ends with the
    process. ``running()`` names what such threads are doing. Subclassing ThreadPoolExecutor is
    only for ``loop.set_default_executor``, which accepts nothing else; none of its machinery is
    used, since its threads are exactly the ones the interpreter joins at exit.
    """

    def __init__(
        self, max_workers: int | None = None, *, join_timeout: float, name: str = "worker"
    ) -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        # The default of ThreadPoolExecutor: I/O-bound work, a few more threads than CPUs.
        self._limit = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._join_timeout = join_timeout
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._idle = threading.Semaphore(0)  # one release per thread waiting for a job
        self._workers: list[threading.Thread] = []
        self._running: dict[int, str] = {}  # thread ident -> what it runs
        self._on_finished: list[Callable[[], None]] = []  # wait_running's wake-ups
        self._closed = False

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` on a worker thread (a new one if none is idle)."""
        future: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put(_Job(future, functools.partial(fn, *args, **kwargs), describe(fn)))
            if not self._idle.acquire(blocking=False) and len(self._workers) < self._limit:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True
                )
                thread.start()
                self._workers.append(thread)
        return future

    def _work(self) -> None:
        ident = threading.get_ident()
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.put(None)  # one stop marker wakes every thread in turn
                return
            if job.future.set_running_or_notify_cancel():
                with self._lock:
                    self._running[ident] = job.name
                try:
                    job.future.set_result(job.call())
                except BaseException as exc:  # the caller gets it, as from ThreadPoolExecutor
                    job.future.set_exception(exc)
                finally:
                    with self._lock:
                        del self._running[ident]
                        self._changed.notify_all()
                        for wake in self._on_finished:
                            wake()
            del job  # its result, before waiting for the next one
            self._idle.release()

    def running(self) -> list[str]:
        """What each thread busy with a call is running, sorted (see ``describe``)."""
        with self._lock:
            return sorted(self._running.values())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; idle threads end. ``wait``: wait for the running calls, but at
        most ``join_timeout`` seconds (what still runs then is abandoned)."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job.future.cancel()
            self._jobs.put(None)
            if wait:
                deadline = time.monotonic() + self._join_timeout
                while self._running and (left := deadline - time.monotonic()) > 0:
                    self._changed.wait(left)

    async def wait_running(self, timeout: float) -> list[str]:
        """Wait on the event loop up to ``timeout`` seconds for the running calls to return;
        what still runs then (empty if nothing)."""
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()

        def wake() -> None:  # on a worker thread, as one of its calls returns
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(finished.set)

        with self._lock:
            self._on_finished.append(wake)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while True:
                        finished.clear()
                        if not self.running():
                            break
                        await finished.wait()
        finally:
            with self._lock:
                self._on_finished.remove(wake)
        return self.running()


__all__ = ["WorkerThreads", "describe"]
