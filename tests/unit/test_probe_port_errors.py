"""A probe naming a port nobody declares (issue 23): every attempt errors, as the kubelet's does,
but the log says so once (then once per ERROR_REPEAT_LOG_SECONDS, with a count), and names where
the ports were looked for."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeError, ProbeOutcome
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.results import ResultsStore
from cri_prober.probing.spec import KUBELET_PORTS_ANNOTATION, ProbeOrigin, parse_probe_json
from cri_prober.probing.worker import (
    ERROR_REPEAT_LOG_SECONDS,
    ContainerView,
    ProbeRunner,
    ProbeWorker,
)
from cri_prober.runtime.model import ExecResult
from tests.support.clock import WALL0, WorkerClock

PORT_ERROR = 'port "metrics" not found in the pod spec\'s container ports'


class _NoExec:
    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        raise AssertionError("no exec expected")


@pytest.mark.parametrize(
    ("origin", "annotation", "where"),
    [
        pytest.param(
            "pod-spec",
            None,
            "the pod spec's container ports or the kubelet's "
            f"{KUBELET_PORTS_ANNOTATION} annotation (the container has none)",
            id="pod-spec",
        ),
        pytest.param(
            "rules",
            json.dumps([{"name": "http", "containerPort": 80}]),
            f"the rule's ports or the kubelet's {KUBELET_PORTS_ANNOTATION} annotation",
            id="rules",
        ),
        pytest.param(
            "annotation",
            None,
            "the annotation's ports or the kubelet's "
            f"{KUBELET_PORTS_ANNOTATION} annotation (the container has none)",
            id="annotation",
        ),
    ],
)
async def test_an_undeclared_port_says_where_ports_were_looked_for(
    origin: ProbeOrigin, annotation: str | None, where: str
) -> None:
    probe = parse_probe_json(
        '{"tcpSocket": {"port": "metrics"}}', ProbeKind.LIVENESS, source="test"
    )
    target = ProbeTarget("c1", pod_ip="10.0.0.9", ports={"http": 8080}, ports_annotation=annotation)
    with pytest.raises(ProbeError) as raised:
        await Prober(_NoExec()).run(probe, target, origin=origin)
    assert str(raised.value) == f'port "metrics" not found in {where}'


class _Timing:
    initial_delay_seconds = 0
    period_seconds = 10
    success_threshold = 1
    failure_threshold = 3


def _liveness_worker(clock: WorkerClock, run_probe: ProbeRunner) -> ProbeWorker:
    """A liveness worker on a running container, whose attempts ``run_probe`` makes."""
    return ProbeWorker(
        ProbeKind.LIVENESS,
        _Timing(),
        status=lambda: ContainerView(id="c1", running=True, started_at=WALL0 - 100, started=True),
        run_probe=run_probe,
        results=ResultsStore(),
        prober_started_at=WALL0 - 3600,
        clock=clock,
    )


async def test_a_probe_that_errors_every_attempt_is_logged_once_then_with_a_count() -> None:
    """Issue 23: 964 lines in 16 min (one per attempt). Now: one, then one per 5 min."""
    clock = WorkerClock()

    async def cannot_run(_view: ContainerView) -> ProbeOutcome:
        raise ProbeError(PORT_ERROR)

    worker = _liveness_worker(clock, cannot_run)
    steps_per_window = int(ERROR_REPEAT_LOG_SECONDS // _Timing.period_seconds)
    with capture_logs() as logs:
        for _ in range(steps_per_window):
            assert await worker.step()
            clock.advance(_Timing.period_seconds)
    errored = [e for e in logs if e["event"] == "probe_errored"]
    assert len(errored) == 1
    assert errored[0]["error"] == PORT_ERROR
    assert "repeated" not in errored[0]
    # Every attempt still counts as one that could not run (history, attempts).
    assert worker.probes_run == steps_per_window
    with capture_logs() as later:
        assert await worker.step()  # the window is over: logged again, with the count
        assert await worker.step()
    [again] = [e for e in later if e["event"] == "probe_errored"]
    assert again["repeated"] == steps_per_window - 1


async def test_a_new_error_text_is_logged_at_once() -> None:
    clock = WorkerClock()
    texts = iter([PORT_ERROR, PORT_ERROR, "dial tcp: connection refused", PORT_ERROR])

    tries: list[str] = []

    async def cannot_run(_view: ContainerView) -> ProbeOutcome:
        raise ProbeError(tries.pop())

    worker = _liveness_worker(clock, cannot_run)
    with capture_logs() as logs:
        for text in texts:
            tries[:] = [text] * 3  # three tries per attempt
            assert await worker.step()
            clock.advance(10)
    assert [e["error"] for e in logs if e["event"] == "probe_errored"] == [
        PORT_ERROR,
        "dial tcp: connection refused",
        PORT_ERROR,
    ]
