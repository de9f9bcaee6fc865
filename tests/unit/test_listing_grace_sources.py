"""The listing grace counts from every source's first good read (issue 34 item 7): a pod no source
lists waits while a source has not read yet (it lists nothing), for at most
UNREAD_SOURCE_WAIT_SECONDS, on the registry's clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from cri_prober.podspecs import registry as registry_module
from cri_prober.podspecs.registry import UNREAD_SOURCE_WAIT_SECONDS, PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from tests.support.clock import ManualClock
from tests.support.waiting import HANG_GUARD

UID = "2a55a2aecce1cdf9b9a4c4197da463d8"


class ListedSource(PodSource):
    """A source whose reads the test plays by hand (``read``); ``run`` waits for ever."""

    def __init__(self, name: str, clock: ManualClock) -> None:
        super().__init__(name, stale_after=60, clock=clock)

    def read(self) -> None:
        """A good read that lists nothing (the view does not change)."""
        self.replace_all([])
        self.succeeded()

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


def _events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


def _wait(registry: PodSpecs, uid: str = UID) -> float | None:
    return registry.unlisted_wait(uid, "jobs", "batch")


def test_the_grace_counts_from_the_last_sources_first_read() -> None:
    clock = ManualClock()
    api, kubelet = ListedSource("apiserver", clock), ListedSource("manifests", clock)
    registry = PodSpecs([api, kubelet], clock=clock)
    grace = registry.listing_grace()
    kubelet.read()
    assert _wait(registry) == UNREAD_SOURCE_WAIT_SECONDS + grace  # apiserver has not read
    clock.advance(10)
    api.read()
    registry.rebuild()  # what a source's change does; the staleness check notes it too
    assert _wait(registry) == pytest.approx(grace)  # from the read, not from the first lookup
    clock.advance(grace - 0.1)
    assert _wait(registry) == pytest.approx(0.1)
    clock.advance(0.1)
    with capture_logs() as logs:
        assert _wait(registry) is None
    (passed,) = _events(logs, "pod_spec_grace_passed")
    assert passed["waited"] == pytest.approx(10 + grace)
    assert _events(logs, "pod_spec_sources_unread") == []


def test_sources_that_read_before_the_pod_came_leave_the_grace_as_it_was() -> None:
    clock = ManualClock()
    api = ListedSource("apiserver", clock)
    registry = PodSpecs([api], clock=clock)
    api.read()
    clock.advance(100)
    assert _wait(registry) == registry.listing_grace()


def test_a_source_that_never_reads_is_waited_for_at_most_the_bound_logged_once() -> None:
    clock = ManualClock()
    api = ListedSource("apiserver", clock)
    registry = PodSpecs([api], clock=clock)
    bound = UNREAD_SOURCE_WAIT_SECONDS + registry.listing_grace()
    assert _wait(registry) == bound
    clock.advance(bound - 0.1)
    assert _wait(registry) == pytest.approx(0.1)
    clock.advance(0.1)
    with capture_logs() as logs:
        assert _wait(registry) is None
        assert _wait(registry, "other-uid") is not None  # a new pod waits its own bound
        clock.advance(bound)
        assert _wait(registry, "other-uid") is None
    (unread,) = _events(logs, "pod_spec_sources_unread")  # once, not per pod
    assert unread["sources"] == ["apiserver"]
    assert unread["log_level"] == "warning"
    assert len(_events(logs, "pod_spec_grace_passed")) == 2


def test_a_source_reading_after_the_bound_does_not_make_pods_wait_again() -> None:
    clock = ManualClock()
    api = ListedSource("apiserver", clock)
    registry = PodSpecs([api], clock=clock)
    _wait(registry)
    clock.advance(UNREAD_SOURCE_WAIT_SECONDS + 1)
    api.read()
    assert _wait(registry) == pytest.approx(registry.listing_grace() - 1)  # the bound's grace


async def test_a_first_read_that_changes_nothing_wakes_the_waiting_containers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first listing that is empty calls no listener: the registry's periodic check notes
    the read and calls it, so the manager looks again without waiting out the bound."""
    monkeypatch.setattr(registry_module, "STALENESS_CHECK_SECONDS", 0.01)
    clock = ManualClock()
    api = ListedSource("apiserver", clock)
    registry = PodSpecs([api], clock=clock)
    called = asyncio.Event()
    registry.start(called.set)
    try:
        assert _wait(registry) is not None
        await asyncio.sleep(0.05)  # a few checks, with nothing to note
        assert not called.is_set()
        api.read()
        async with asyncio.timeout(HANG_GUARD):  # a hang guard only
            await called.wait()
        assert _wait(registry) == registry.listing_grace()
    finally:
        await registry.stop()
