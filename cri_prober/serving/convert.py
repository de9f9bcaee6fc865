"""Protobuf conversion: the read model's frozen values as ``criprober.v1`` messages."""

from __future__ import annotations

import json
import time

from google.protobuf import duration_pb2, timestamp_pb2

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.state import Health, ProbeState
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.serving.transitions import Transition


def _timestamp_ns(ns: int) -> timestamp_pb2.Timestamp | None:
    if ns <= 0:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(ns)
    return stamp


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    return _timestamp_ns(int(seconds * 1e9)) or timestamp_pb2.Timestamp()


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


def attempt_pb(record: ProbeRecord) -> query_pb2.ProbeAttempt:
    """One probe attempt as the API reports it."""
    return query_pb2.ProbeAttempt(
        container_id=record.container_id,
        time=_timestamp(record.started_at),
        duration=_duration(record.duration),
        result=record.result,
        output=record.output,
        exit_code=record.exit_code,
        http_status=record.http_status,
        timed_out=record.timed_out,
        note=record.note,
        reason=record.reason,
        run=record.run,
        threshold=record.threshold,
        changed=record.changed,
        held=record.held,
        pressure=(
            None
            if record.pressure is None
            else query_pb2.Pressure(
                cpu=record.pressure.cpu, memory=record.pressure.memory, io=record.pressure.io
            )
        ),
        late=_duration(record.late) if record.late > 0 else None,
        ticks_dropped=record.dropped,
        source=record.source,
        window=_duration(record.window) if record.window > 0 else None,
    )


def in_progress(state: ProbeState, now: float) -> str:
    """What the attempt in progress is doing, for a person looking at it (D1)."""
    if state.probing_since is None:
        return ""
    elapsed = max(now - state.probing_since, 0.0)
    timeout = state.probe.timeout_seconds
    kind = "exec" if state.probe.exec is not None else "probe"
    if state.probe.exec is not None and elapsed > timeout:
        return (
            f"exec running for {elapsed:.1f}s, past its {timeout}s timeout: waiting for the "
            "exec's I/O to drain (the kubelet waits up to the timeout plus 2 min)"
        )
    return f"{kind} running for {elapsed:.1f}s"


def probe_status_pb(state: ProbeState, *, detail: bool) -> query_pb2.ProbeStatus:
    """One configured probe; ``detail`` adds its spec, named ports, history and whole output."""
    status = query_pb2.ProbeStatus(
        result=(state.published or Published.UNKNOWN).value,
        origin=state.origin,
        source=state.source,
    )
    if state.has_worker or state.attempts:
        # The counts outlive the worker (issue 23): a probe whose worker ended (its container
        # exited for good) still says what it did beside its history.
        status.consecutive_successes = state.consecutive_successes
        status.consecutive_failures = state.consecutive_failures
        status.threshold = state.threshold
        status.attempts = state.attempts
    if state.has_worker:
        status.on_hold = state.on_hold
        status.hold = state.hold
        status.holds_failures = state.holds_failures
        status.active = state.active
        if state.probing_since is not None:
            status.probing_since.CopyFrom(_timestamp(state.probing_since))
            status.in_progress = in_progress(state, time.time())
    if state.last_record is not None and state.history:
        # The list shows the history's shortened copy of the same attempt, keeping a node's
        # worth of containers in one message.
        last = state.last_record if detail else state.history[-1]
        status.last_attempt.CopyFrom(attempt_pb(last))
    if detail:
        spec = state.probe.model_dump(mode="json", by_alias=True, exclude_none=True)
        status.detail.spec_json = json.dumps(spec, separators=(",", ":"))
        status.detail.named_ports.update(state.ports)
        status.detail.history.extend(attempt_pb(record) for record in state.history)
    return status


def container_pb(
    info: ContainerInfo, health: Health, probes: tuple[ProbeState, ...], *, detail: bool
) -> query_pb2.Container:
    """A container with its probe state; ``detail`` adds specs, histories and whole outputs."""
    container = query_pb2.Container(
        id=info.id,
        name=info.name,
        pod_name=info.pod.name,
        pod_namespace=info.pod.namespace,
        pod_uid=info.pod.uid,
        pod_sandbox_id=info.pod_sandbox_id,
        attempt=info.attempt,
        state=query_pb2.ContainerState.ValueType(info.state),
        created_at=_timestamp_ns(info.created_at),
        started_at=_timestamp_ns(info.started_at),
        finished_at=_timestamp_ns(info.finished_at),
        started=health.started,
        ready=health.ready,
        healthy=health.serving,
    )
    container.probes.SetInParent()  # `probes: {}` for a container without any
    for state in probes:
        getattr(container.probes, state.kind.value).CopyFrom(probe_status_pb(state, detail=detail))
    return container


def transition_pb(transition: Transition) -> query_pb2.Transition:
    """A logged transition as the API streams it."""
    return query_pb2.Transition(
        sequence=transition.sequence,
        incarnation=transition.incarnation,
        time=_timestamp(transition.time),
        container_id=transition.container_id,
        container_name=transition.container_name,
        pod_name=transition.pod_name,
        pod_namespace=transition.pod_namespace,
        pod_uid=transition.pod_uid,
        kind=transition.kind.value,
        previous=transition.previous.value if transition.previous is not None else "",
        result=transition.result.value,
        consecutive=transition.consecutive,
        output=transition.output,
        started=transition.started,
        ready=transition.ready,
        healthy=transition.healthy,
        reason=transition.reason,
        threshold=transition.threshold,
        held=transition.held,
        stop_requested=transition.stop_requested,
        source=transition.source,
    )


__all__ = ["attempt_pb", "container_pb", "probe_status_pb", "transition_pb"]
