"""``FailureStops.would_stop``: the one rule (§5.2) behind both a transition's
``stop_requested`` and the stop a pod sync makes under ``--on-failure stop``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from cri_prober.manager.stopping import FailureStops
from cri_prober.probing.handlers.exec import ExecReply
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.runtime.model import ContainerState
from tests.unit.slots import make_slot

RUNNING = make_slot().container


class _NoCalls:
    """A stopper the rule never reaches: deciding must not call the runtime."""

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecReply:
        raise AssertionError("would_stop ran an exec")

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None:
        raise AssertionError("would_stop stopped a container")


def _stops() -> FailureStops:
    return FailureStops(
        _NoCalls(), ResultsStore(), named_ports=lambda _id: {}, retry_later=lambda _uid: None
    )


@pytest.mark.parametrize("kind", [ProbeKind.LIVENESS, ProbeKind.STARTUP])
def test_an_attempts_failure_of_a_running_container_stops_it(kind: ProbeKind) -> None:
    assert _stops().would_stop(RUNNING, kind, Published.FAILURE, by_attempt=True)


@pytest.mark.parametrize(
    ("kind", "result", "by_attempt", "state"),
    [
        pytest.param(
            ProbeKind.READINESS,
            Published.FAILURE,
            True,
            ContainerState.CONTAINER_RUNNING,
            id="readiness",
        ),
        pytest.param(
            ProbeKind.LIVENESS,
            Published.SUCCESS,
            True,
            ContainerState.CONTAINER_RUNNING,
            id="success",
        ),
        pytest.param(
            ProbeKind.LIVENESS, None, True, ContainerState.CONTAINER_RUNNING, id="nothing-published"
        ),
        pytest.param(
            ProbeKind.LIVENESS,
            Published.FAILURE,
            False,
            ContainerState.CONTAINER_RUNNING,
            id="not-by-an-attempt",
        ),
        pytest.param(
            ProbeKind.STARTUP,
            Published.FAILURE,
            True,
            ContainerState.CONTAINER_EXITED,
            id="exited",
        ),
        pytest.param(
            ProbeKind.LIVENESS,
            Published.FAILURE,
            True,
            ContainerState.CONTAINER_CREATED,
            id="created",
        ),
    ],
)
def test_anything_less_stops_nothing(
    kind: ProbeKind, result: Published | None, by_attempt: bool, state: ContainerState
) -> None:
    container = dataclasses.replace(RUNNING, state=state)
    assert not _stops().would_stop(container, kind, result, by_attempt=by_attempt)
