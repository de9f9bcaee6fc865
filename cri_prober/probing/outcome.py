"""The value every probe handler returns, and the one error a handler may raise."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cri_prober.errors import CriProberError

# The kubelet caps what it keeps of a probe's output (exec stdout+stderr, HTTP body) at 10 KiB,
# the same cap the CRI client applies to ExecSync output. Probing imports nothing from the
# runtime, so the runtime keeps its own equal constant (``runtime.model.MAX_EXEC_OUTPUT_BYTES``);
# tests/unit/test_cri_client.py checks that the two agree.
MAX_OUTPUT_BYTES = 10 * 1024


class ProbeResult(enum.Enum):
    """What one probe attempt said about its target."""

    SUCCESS = "success"
    # Counted as a success; the output says why it deserves a look (e.g. an unfollowed redirect).
    WARNING = "warning"
    FAILURE = "failure"
    UNKNOWN = "unknown"


class Reason:
    """Why an attempt came out as it did, or why a result was published: one machine-readable
    word from a small set (docs/interface.md, "Reasons"), on every attempt and transition."""

    OK = "ok"  # a success
    WARNING = "warning"  # counted as a success; the output says what deserves a look (a 3xx)
    TIMEOUT = "timeout"  # the probe's timeoutSeconds expired
    EXIT_CODE = "exit-code"  # an exec command exited non-zero
    HTTP_STATUS = "http-status"  # an HTTP status outside 200-399
    CONNECTION_REFUSED = "connection-refused"  # nothing listens on the port
    CONNECTION_ERROR = "connection-error"  # reset, unreachable, lookup failed, no valid answer
    TLS = "tls"  # the TLS handshake failed
    GRPC_STATUS = "grpc-status"  # the health service said not SERVING, or the call failed
    INVALID_TARGET = "invalid-target"  # a URL or port the probe cannot dial (a verdict in Go)
    UNKNOWN = "unknown"  # the probe's result was Unknown
    # Attempts that could not run: never counted, retried.
    RUNTIME_ERROR = "runtime-error"  # the runtime failed the exec (ExecSync error, a stall)
    NOT_RUN = "not-run"  # anything else: no such port, a request that cannot be built,
    # cri-prober out of descriptors or memory
    # The probe's handler has a field cri-prober cannot send as the spec asks (an unknown one,
    # or a 1.37 field's unknown value): nothing was sent, rather than a different probe.
    UNSUPPORTED = "unsupported"
    # Results published without an attempt (transitions only).
    INITIAL = "initial"  # a new container's initial value
    # The container is not running: a transition, or an errored exec that raced its stop.
    NOT_RUNNING = "not-running"
    POD_DELETING = "pod-deleting"  # liveness/startup end quietly as the pod is deleted
    # serve --mirror: the kubelet's own verdict, read from its counters or its pod status (a
    # failure's text is in its Unhealthy event, not in the counters).
    KUBELET = "kubelet"


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """The result of one probe attempt with what the target said."""

    result: ProbeResult
    output: str = ""
    exit_code: int | None = None  # exec probes
    http_status: int | None = None  # httpGet probes
    timed_out: bool = False  # a failure because the probe's timeout expired
    note: str = ""  # anything else worth showing about the attempt (not part of the verdict)
    # A ``Reason``; handlers name the failures only they can tell apart (refused, TLS...), and
    # ``reason_of`` fills in the rest from the fields above.
    reason: str = ""


def reason_of(outcome: ProbeOutcome) -> str:
    """The outcome's ``Reason``: the handler's, else what its result and fields say."""
    if outcome.reason:
        return outcome.reason
    if outcome.result is ProbeResult.SUCCESS:
        return Reason.OK
    if outcome.result is ProbeResult.WARNING:
        return Reason.WARNING
    if outcome.result is ProbeResult.UNKNOWN:
        return Reason.UNKNOWN
    if outcome.timed_out:
        return Reason.TIMEOUT
    if outcome.exit_code is not None:
        return Reason.EXIT_CODE
    if outcome.http_status is not None:
        return Reason.HTTP_STATUS
    return Reason.CONNECTION_ERROR


class ProbeError(CriProberError):
    """The probe could not be run (bad spec, runtime unreachable): not a verdict on the target.

    The worker discards such an attempt and retries it, as the kubelet does. ``reason`` is
    ``Reason.RUNTIME_ERROR`` when the runtime failed it, ``Reason.NOT_RUNNING`` when the container
    was no longer running (an exec that raced its stop or removal), else ``Reason.NOT_RUN``.
    """

    def __init__(self, message: str, *, reason: str = Reason.NOT_RUN) -> None:
        super().__init__(message)
        self.reason = reason


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with an ellipsis when cut (for messages and logs)."""
    return text if len(text) <= limit else text[:limit] + "…"


def truncate_output(data: bytes, limit: int = MAX_OUTPUT_BYTES) -> str:
    """Cut *data* to *limit* bytes and decode it leniently for display."""
    return data[:limit].decode("utf-8", errors="replace")
