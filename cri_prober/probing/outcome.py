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


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """The result of one probe attempt with what the target said."""

    result: ProbeResult
    output: str = ""
    exit_code: int | None = None  # exec probes
    http_status: int | None = None  # httpGet probes
    timed_out: bool = False  # a failure because the probe's timeout expired
    note: str = ""  # anything else worth showing about the attempt (not part of the verdict)


class ProbeError(CriProberError):
    """The probe could not be run (bad spec, runtime unreachable): not a verdict on the target.

    The worker discards such an attempt and retries it, as the kubelet does.
    """


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with an ellipsis when cut (for messages and logs)."""
    return text if len(text) <= limit else text[:limit] + "…"


def truncate_output(data: bytes, limit: int = MAX_OUTPUT_BYTES) -> str:
    """Cut *data* to *limit* bytes and decode it leniently for display."""
    return data[:limit].decode("utf-8", errors="replace")
