"""Shared fixtures: real containerd testbeds (scripts/testbed.py) and kubelet-like pod factories.

Fixtures (all need root; without it the tests are skipped, loudly, with a summary banner):

- ``testbed``: a session-wide `Testbed`, parametrised over containerd 1.6, 2.1 and 1.7 (ids
  ``containerd-1.6`` ...). Each version is started once per session, on first use. Restrict a
  test with ``@pytest.mark.containerd(versions=["1.7", "2.1"])``, or a whole run with
  ``--containerd-version 1.6`` (repeatable).
- ``testbed_16``: containerd 1.6 only (the same instance as ``testbed[containerd-1.6]``).
- ``pods``: a function-scoped `PodFactory` on ``testbed`` (so the test runs on every version);
  everything it created is removed after the test.
- ``pods_16``: the same on ``testbed_16``. Pair ``pods`` with ``testbed`` and ``pods_16`` with
  ``testbed_16``; asking for ``pods`` together with ``testbed_16`` is an error.

Tests marked ``both_loops`` run on asyncio's own event loop and on uvloop (serve's default),
through pytest-asyncio's loop factories; others on asyncio's.

Every async test must stop the tasks it started: ``no_leaked_tasks`` (autouse) fails one that
leaves a task pending on its loop once it and its fixtures have ended.

Tests using these fixtures or living in tests/containerd get the ``containerd`` marker. As root, a
testbed that fails to start is an ERROR, never a skip. Every testbed is stopped at session end
(and by atexit as a safety net), so no containerd or shim outlives the session.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import pytest
import structlog
import uvloop

from tests.support.leaks import check_no_leaked_tasks
from tests.support.testbed import PodFactory, Testbed

VERSIONS = ("1.6", "2.1", "1.7")
NOT_ROOT_REASON = "needs root to run a real containerd"
TESTBED_FIXTURES = frozenset({"testbed", "testbed_16", "pods", "pods_16"})
CONTAINERD_TESTS_DIR = Path(__file__).parent / "containerd"

# A failing test never crashes the run (CPython 3.11's ast race in pytest's traceback formatter).
pytest_plugins = ("tests.support.report_guard",)


LOOP_FACTORIES: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Both loops for ``both_loops`` tests (code that drives sockets and timers itself: their
    transports and timer rounding differ); asyncio's own for the rest."""
    if item.get_closest_marker("both_loops") is not None:
        return LOOP_FACTORIES
    return {"asyncio": LOOP_FACTORIES["asyncio"]}


@pytest.fixture(autouse=True)
def no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test that leaves a task of its own pending (tests/support/leaks.py)."""
    yield from check_no_leaked_tasks(request)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--containerd-version",
        action="append",
        choices=VERSIONS,
        default=[],
        help="run the `testbed` tests on these containerd versions only (repeatable)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "testbed" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("containerd")
    versions = list(marker.kwargs.get("versions", VERSIONS) if marker else VERSIONS)
    if selected := metafunc.config.getoption("--containerd-version"):
        versions = [version for version in versions if version in selected]
    metafunc.parametrize(
        "testbed", versions, indirect=True, ids=[f"containerd-{v}" for v in versions]
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    not_root = os.geteuid() != 0
    for item in items:
        uses_testbed = TESTBED_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_testbed or CONTAINERD_TESTS_DIR in item.path.parents:
            item.add_marker(pytest.mark.containerd)
        if not_root and item.get_closest_marker("containerd") is not None:
            item.add_marker(pytest.mark.skip(reason=NOT_ROOT_REASON))


@pytest.fixture(autouse=True)
def no_cached_logging() -> Iterator[None]:
    """Fails a test that leaves structlog configured to cache its loggers (``logs.configure``,
    which serve calls: e.g. ``serve`` invoked in-process). A module's logger used while that
    holds keeps the stdlib pipeline for good, so ``capture_logs`` in a later test of the same
    process sees nothing from it: a failure far from its cause. Such a test patches
    ``cri_prober.logs.configure``."""
    yield
    if structlog.get_config().get("cache_logger_on_first_use"):
        structlog.reset_defaults()
        pytest.fail(
            "this test left structlog configured with cached loggers (logs.configure ran "
            "in-process): patch cri_prober.logs.configure, or run the command in a subprocess"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if NOT_ROOT_REASON in str(report.longrepr)
    ]
    if skipped:
        terminalreporter.write_sep(
            "!",
            f"{len(skipped)} containerd tests SKIPPED because the user is not root",
            red=True,
            bold=True,
        )
        terminalreporter.write_line(
            "They start a real containerd and were NOT exercised. Run pytest as root to run them."
        )


class TestbedPool:
    """Testbeds started on demand, one per containerd version, all stopped by stop_all()."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self) -> None:
        self._started: dict[str, Testbed] = {}

    def get(self, version: str) -> Testbed:
        if version not in self._started:
            directory = Path(tempfile.mkdtemp(prefix=f"cri-prober-testbed-{version}-"))
            try:
                self._started[version] = Testbed.start(directory, version=version)
            except BaseException as error:
                # Nothing may keep running; the directory stays for its containerd.log.
                Testbed.stop_dir(directory, keep_dir=True)
                error.add_note(f"testbed directory kept for inspection: {directory}")
                raise
        return self._started[version]

    def stop_all(self) -> None:
        """Stop every testbed (idempotent); all are attempted even if one fails."""
        errors: list[Exception] = []
        while self._started:
            _, testbed = self._started.popitem()
            try:
                testbed.stop()
            except Exception as error:
                errors.append(error)
        if errors:
            raise ExceptionGroup("could not stop every testbed", errors)


@pytest.fixture(scope="session")
def testbed_pool() -> Iterator[TestbedPool]:
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT_REASON)
    pool = TestbedPool()
    atexit.register(pool.stop_all)  # in case the session dies before fixture teardown
    try:
        yield pool
    finally:
        pool.stop_all()
        atexit.unregister(pool.stop_all)


@pytest.fixture(scope="session")
def testbed(request: pytest.FixtureRequest, testbed_pool: TestbedPool) -> Testbed:
    version: str = request.param
    return testbed_pool.get(version)


@pytest.fixture(scope="session")
def testbed_16(testbed_pool: TestbedPool) -> Testbed:
    return testbed_pool.get("1.6")


@pytest.fixture
async def pods(request: pytest.FixtureRequest, testbed: Testbed) -> AsyncIterator[PodFactory]:
    if "testbed_16" in request.fixturenames:
        raise pytest.UsageError("use `pods_16` with `testbed_16` (`pods` follows `testbed`)")
    async with testbed.pods() as factory:
        yield factory


@pytest.fixture
async def pods_16(testbed_16: Testbed) -> AsyncIterator[PodFactory]:
    async with testbed_16.pods() as factory:
        yield factory
