"""How the client commands lay out what the daemon answers for people: the ``ps`` and ``watch``
tables (sized to fit 120 columns, crictl's truncated IDs) and ``inspect``'s short summary, each
built from the API's protobuf messages. Machine output (``-o json|yaml``) is not made here.

Every string the API carries may be tenant text (names, a probe's output, a pod spec's argv):
what leaves here is sanitized (`cri_prober.text`), each table cell before it is measured or cut
and each summary line as a whole, so no control character reaches a terminal.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any, Literal

from google.protobuf import duration_pb2, timestamp_pb2

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.text import CELL, ONE_LINE, sanitize

ID_WIDTH = 13  # crictl's truncated IDs
ELLIPSIS = "…"
KIND_NAMES: tuple[Literal["liveness", "readiness", "startup"], ...] = (
    "liveness",
    "readiness",
    "startup",
)
# The compact PROBES cell of `ps`: one letter per kind, one short word per published result.
KIND_LETTERS = {"liveness": "L", "readiness": "R", "startup": "S"}
RESULT_WORDS = {"success": "ok", "failure": "fail", "unknown": "?"}
# Longest cells `ps` prints before it cuts them in the middle (--no-trunc prints them whole):
# with them the default table stays within 120 columns for any name.
PS_POD_WIDTH = 26
PS_NAME_WIDTH = 14
# Fixed column widths for `watch -o table`: a stream cannot size columns to its rows. Cells are
# cut to them (--no-trunc: not cut, then columns may not line up). At most 120 columns with the
# longest reason, its count and the hold ("connection-refused 3/3 held"); results in ps's short
# words ("ok -> fail"); -o json has the exact time and every field.
WATCH_COLUMNS = (
    ("TIME", 8),
    ("SEQ", 6),
    ("CONTAINER", ID_WIDTH),
    ("POD", 19),
    ("NAME", 10),
    ("PROBE", 9),
    ("RESULT", 14),
    ("REASON", 0),
)
# One line of `inspect`'s summary per output: at most this many characters unless --no-trunc.
OUTPUT_WIDTH = 100


# -- cells ----------------------------------------------------------------------------------------


def cut(text: str, width: int) -> str:
    """``text`` as a table cell (sanitized) in at most ``width`` characters, cut in the middle
    with an ellipsis: pod names differ at their end (a ReplicaSet's hash suffix), so both ends
    are kept."""
    text = sanitize(text, CELL)
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def one_line(text: str, width: int | None) -> str:
    """``text`` on one line (newlines shown as ``⏎``), sanitized, cut at its end to ``width``
    if given."""
    parts = (part.strip() for part in text.strip().splitlines())
    flat = sanitize(" ⏎ ".join(part for part in parts if part), ONE_LINE)
    if width is not None and len(flat) > width:
        return flat[: width - 1] + ELLIPSIS
    return flat


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], gap: int = 3) -> str:
    """Columns as wide as their widest cell, ``gap`` spaces apart, trailing blanks dropped;
    every cell sanitized first (no tab or newline either: they would break the columns)."""
    rows = [[sanitize(cell, CELL) for cell in row] for row in rows]
    widths = [
        max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)
    ]
    return "\n".join(
        (" " * gap)
        .join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        .rstrip()
        for line in [headers, *rows]
    )


def state_name(state: query_pb2.ContainerState.ValueType) -> str:
    """CONTAINER_RUNNING -> Running, as crictl shows it."""
    return query_pb2.ContainerState.Name(state).removeprefix("CONTAINER_").capitalize()


def yes_no(value: bool) -> str:
    return "true" if value else "false"


def seconds_of(timestamp: timestamp_pb2.Timestamp | duration_pb2.Duration) -> float:
    return timestamp.seconds + timestamp.nanos / 1e9


# -- durations and ages ---------------------------------------------------------------------------


def human_duration(seconds: float) -> str:
    """Go's units.HumanDuration, which crictl uses for ages ("2 minutes", "About an hour")."""
    whole = int(seconds)
    minutes = int(seconds / 60)
    hours = round(seconds / 3600)
    if whole < 1:
        text = "Less than a second"
    elif whole == 1:
        text = "1 second"
    elif whole < 60:
        text = f"{whole} seconds"
    elif minutes == 1:
        text = "About a minute"
    elif minutes < 60:
        text = f"{minutes} minutes"
    elif hours == 1:
        text = "About an hour"
    elif hours < 48:
        text = f"{hours} hours"
    elif hours < 24 * 7 * 2:
        text = f"{hours // 24} days"
    elif hours < 24 * 30 * 2:
        text = f"{hours // 24 // 7} weeks"
    elif hours < 24 * 365 * 2:
        text = f"{hours // 24 // 30} months"
    else:
        text = f"{int(seconds / 3600) // 24 // 365} years"
    return text


def short_duration(seconds: float) -> str:
    """A duration as people write it: ``130ms``, ``1.5s``, ``12s``, ``2m3s``, ``1h5m``, ``3d4h``
    (Go's Duration.String, rounded to what a glance needs)."""
    if seconds < 0:
        seconds = 0.0
    if seconds < 1:
        millis = round(seconds * 1000)
        if millis >= 1000:
            return "1s"
        if millis == 0 and seconds > 0:
            return f"{round(seconds * 1e6)}µs"
        return f"{millis}ms"
    if seconds < 10:
        tenths = round(seconds, 1)
        return f"{tenths:g}s" if tenths < 10 else "10s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours}h" if hours else f"{days}d"


def age(timestamp: timestamp_pb2.Timestamp, now: float) -> str:
    """How long ago, crictl's way (``2 minutes ago``)."""
    return human_duration(now - seconds_of(timestamp)) + " ago"


# -- ps -------------------------------------------------------------------------------------------

PS_HEADERS = (
    "CONTAINER",
    "POD",
    "NAME",
    "ATTEMPT",
    "STATE",
    "READY",
    "HEALTHY",
    "PROBES",
    "AGE",
)
PS_WIDE_HEADERS = (
    "CONTAINER",
    "POD",
    "NAMESPACE",
    "NAME",
    "ATTEMPT",
    "STATE",
    "STARTED",
    "READY",
    "HEALTHY",
    "LIVENESS",
    "READINESS",
    "STARTUP",
    "CREATED",
    "SOURCE",
)


def probes_cell(probes: query_pb2.Probes) -> str:
    """``L:fail(exit-code,held) R:ok S:?``: each configured probe's published result, liveness
    first, a failure with its last attempt's reason (and ``held`` when on hold until the
    container restarts); ``-`` when the container has none."""
    cells = []
    for kind in KIND_NAMES:
        if not probes.HasField(kind):
            continue
        status: query_pb2.ProbeStatus = getattr(probes, kind)
        word = RESULT_WORDS.get(status.result, status.result)
        cells.append(f"{KIND_LETTERS[kind]}:{word}{failure_why(status)}")
    return " ".join(cells) or "-"


def failure_why(status: query_pb2.ProbeStatus) -> str:
    """``(exit-code,held)`` after a failure: its last attempt's reason, and ``held`` when on
    hold until the container restarts; "" for any other result."""
    if status.result != "failure":
        return ""
    why = [status.last_attempt.reason] if status.last_attempt.reason else []
    if status.hold and status.hold != "passed":
        why.append("held")
    return f"({','.join(why)})" if why else ""


def ps_row(container: query_pb2.Container, now: float, *, no_trunc: bool) -> tuple[str, ...]:
    """One container in the default ``ps`` table (at most 120 columns unless ``no_trunc``)."""
    pod = f"{container.pod_namespace}/{container.pod_name}"
    return (
        container.id if no_trunc else container.id[:ID_WIDTH],
        pod if no_trunc else cut(pod, PS_POD_WIDTH),
        container.name if no_trunc else cut(container.name, PS_NAME_WIDTH),
        str(container.attempt),
        state_name(container.state),
        yes_no(container.ready),
        yes_no(container.healthy),
        probes_cell(container.probes),
        # Whole seconds, as kubectl's AGE: a tenth of a second is noise in an age.
        short_duration(int(max(0.0, now - seconds_of(container.created_at)))),
    )


def ps_wide_row(container: query_pb2.Container, now: float, *, no_trunc: bool) -> tuple[str, ...]:
    """One container in ``ps -o wide``: every column the table had before it was made to fit."""
    c = container
    # A failure with its reason, as the narrow table's PROBES cell has it: failure(exit-code).
    probes = [
        (status := getattr(c.probes, kind)).result + failure_why(status)
        if c.probes.HasField(kind)
        else "-"
        for kind in KIND_NAMES
    ]
    # Who wrote the probes, in liveness/readiness/startup order, each named once.
    origins = dict.fromkeys(
        getattr(c.probes, kind).origin for kind in KIND_NAMES if c.probes.HasField(kind)
    )
    return (
        c.id if no_trunc else c.id[:ID_WIDTH],
        c.pod_name,
        c.pod_namespace,
        c.name,
        str(c.attempt),
        state_name(c.state),
        yes_no(c.started),
        yes_no(c.ready),
        yes_no(c.healthy),
        *probes,
        age(c.created_at, now),
        ",".join(origin for origin in origins if origin) or "-",
    )


# -- watch ----------------------------------------------------------------------------------------


def watch_line(cells: Sequence[str], *, no_trunc: bool) -> str:
    """One line of ``watch -o table``, each cell sanitized and cut to its column unless
    ``no_trunc``."""
    return "  ".join(
        (sanitize(cell, CELL) if no_trunc or not width else cut(cell, width)).ljust(width)
        for cell, (_, width) in zip(cells, WATCH_COLUMNS, strict=True)
    ).rstrip()


def transition_reason(transition: query_pb2.Transition) -> str:
    """``exit-code 3/3 held``: why, how many attempts in a row out of the threshold, and what
    it caused: ``held`` (on hold until the container restarts) or ``stop`` (cri-prober stops the
    container); ``initial`` for a new container's first value."""
    reason = transition.reason or "-"
    if transition.threshold:
        reason += f" {transition.consecutive}/{transition.threshold}"
    if transition.stop_requested:
        reason += " stop"  # on hold too, until the stop brings a new container
    elif transition.held:
        reason += " held"
    if transition.source:
        reason += f" [{transition.source}]"  # the kubelet's verdict, mirrored (serve --mirror)
    return reason


def transition_cells(transition: query_pb2.Transition, *, no_trunc: bool) -> list[str]:
    moment = datetime.datetime.fromtimestamp(seconds_of(transition.time))
    result = RESULT_WORDS.get(transition.result, transition.result)
    if transition.reason == "initial":
        # A new container's initial value (readiness starts as failure): not a flap.
        change = f"(initial) {result}"
    else:
        previous = RESULT_WORDS.get(transition.previous, transition.previous) or "(none)"
        change = f"{previous} -> {result}"
    return [
        moment.strftime("%H:%M:%S"),
        str(transition.sequence),
        transition.container_id if no_trunc else transition.container_id[:ID_WIDTH],
        f"{transition.pod_namespace}/{transition.pod_name}",
        transition.container_name,
        transition.kind,
        change,
        transition_reason(transition),
    ]


def run_text(run: int, threshold: int) -> str:
    """``2/3`` toward a threshold; ``5 in a row`` once past it (a probe that keeps running after
    its failure was published, as in report mode)."""
    return f"{run}/{threshold}" if run <= threshold else f"{run} in a row"


def not_serving_lines(containers: Sequence[query_pb2.Container]) -> list[str]:
    """Why each container is not SERVING, one line per probe that keeps it out: ``shop/web/app:
    liveness failure (exit-code 3/3, on hold until the container restarts): <last output>``."""
    lines: list[str] = []
    for c in containers:
        name = f"{c.pod_namespace}/{c.pod_name}/{c.name}"
        before = len(lines)
        if c.state != query_pb2.CONTAINER_RUNNING:
            lines.append(f"{name}: not running ({state_name(c.state)})")
        for kind in KIND_NAMES:
            if not c.probes.HasField(kind):
                continue
            status: query_pb2.ProbeStatus = getattr(c.probes, kind)
            if status.result == "success" or (kind == "liveness" and status.result == "unknown"):
                continue
            attempt = status.last_attempt
            why = [attempt.reason] if attempt.reason else []
            if why and attempt.threshold and attempt.result not in ("success", "warning"):
                why = [f"{attempt.reason} {run_text(attempt.run, attempt.threshold)}"]
            if status.hold and status.hold != "passed":
                why.append(status.hold)
            text = f"{name}: {kind} {status.result}"
            if status.result == "unknown":
                text += " (no result yet)"
            elif why:
                text += f" ({', '.join(why)})"
            if status.result == "failure" and attempt.output.strip():
                text += f": {one_line(attempt.output, OUTPUT_WIDTH)}"
            lines.append(text)
        if len(lines) == before:
            lines.append(f"{name}: not serving (no failing probe: not started or not ready yet)")
    return [sanitize(line, ONE_LINE) for line in lines]


# -- inspect --------------------------------------------------------------------------------------


def container_summary(
    container: query_pb2.Container, now: float, *, no_trunc: bool = False
) -> list[str]:
    """``inspect``'s default output: the container in a few ``Key: value`` lines (crictl's
    inspect table), then one block per configured probe (`probe_summary`); each line sanitized
    (a newline in a name cannot start a line of its own)."""
    c = container
    lines = [
        f"ID: {c.id}",
        f"Name: {c.pod_namespace}/{c.pod_name}/{c.name}",
        f"Attempt: {c.attempt}",
        f"State: {state_name(c.state)}",
        f"Created: {age(c.created_at, now)}",
    ]
    if c.HasField("started_at"):
        lines.append(f"Started: {age(c.started_at, now)}")
    if c.HasField("finished_at"):
        lines.append(f"Finished: {age(c.finished_at, now)}")
    lines.append(
        f"Startup passed: {yes_no(c.started)}   Ready: {yes_no(c.ready)}   "
        f"Healthy: {yes_no(c.healthy)}"
    )
    configured = [kind for kind in KIND_NAMES if c.probes.HasField(kind)]
    if not configured:
        lines.append("Probes: none")
    for kind in configured:
        lines.append("")
        status = getattr(c.probes, kind)
        lines.extend(probe_summary(kind, status, now, no_trunc=no_trunc, started=c.started))
    return [sanitize(line, ONE_LINE) for line in lines]


def probe_summary(
    kind: str,
    status: query_pb2.ProbeStatus,
    now: float,
    *,
    no_trunc: bool = False,
    started: bool = False,
) -> list[str]:
    """One probe's block: what it runs, its published result and whether it is on hold, the
    counts, the last attempt (time, duration, result, output on one line) and the history."""
    spec = _spec(status)
    lines = [f"{kind.capitalize()} probe: {describe_spec(spec)}"]
    if status.origin or status.source:
        lines.append(f"  From: {status.origin or '-'} ({status.source or '-'})")
    result = status.result
    if status.hold == "passed":
        result += " (passed: it runs no more for this container)"
    elif status.hold or status.on_hold:
        result += f", {status.hold or 'on hold until the container restarts'} (no attempts)"
    elif not status.active:
        result += " (no longer probed: the container is gone)"
    elif status.result == "failure" and not status.holds_failures:
        result += " (still probed: nothing restarts it, so a recovery is published)"
    if kind == "startup" and status.result == "unknown" and started:
        # KEP-4781, as the kubelet after its own restart: a container already running when
        # cri-prober started (or remembered as started) is not startup-probed again.
        result += (
            " (not run: the container was running when cri-prober started, so it counts as started)"
        )
    lines.append(f"  Result: {result}")
    lines.append(
        f"  In a row: {_count(status.consecutive_successes, 'success', 'successes')}, "
        f"{_count(status.consecutive_failures, 'failure', 'failures')}{_thresholds(spec)}; "
        f"{_count(status.attempts, 'attempt', 'attempts')} in all"
    )
    if status.in_progress or status.HasField("probing_since"):
        since = status.probing_since
        running = f"  In progress: since {short_duration(now - seconds_of(since))}"
        lines.append(running + (f": {status.in_progress}" if status.in_progress else ""))
    if status.HasField("last_attempt"):
        lines.extend(attempt_lines(status.last_attempt, now, no_trunc=no_trunc))
    lines.append(f"  History: {history_text(status.detail.history)}")
    return [sanitize(line, ONE_LINE) for line in lines]


def attempt_lines(
    attempt: query_pb2.ProbeAttempt, now: float, *, no_trunc: bool = False
) -> list[str]:
    """The last attempt: when, how long, its result with exit code or HTTP status, its output."""
    moment = seconds_of(attempt.time)
    clock = datetime.datetime.fromtimestamp(moment).strftime("%H:%M:%S")
    details = [attempt.result]
    if attempt.HasField("exit_code"):
        details.append(f"exit code {attempt.exit_code}")
    if attempt.HasField("http_status"):
        details.append(f"HTTP {attempt.http_status}")
    if attempt.timed_out:
        details.append("timed out")
    took = short_duration(seconds_of(attempt.duration))
    if attempt.source and not seconds_of(attempt.duration):
        took = "?"  # the kubelet times successful and unknown attempts only
    lines = [
        f"  Last attempt: {clock} ({short_duration(now - moment)} ago), took {took}: "
        f"{', '.join(details)}"
    ]
    if attempt.source:
        lines.append(f"  Ran by: {_ran_by(attempt)}")
    if attempt.reason:
        lines.append(f"  Reason: {attempt.reason}{_counted(attempt)}")
    if lateness := _lateness(attempt):
        lines.append(f"  Came: {lateness}")
    if attempt.HasField("pressure"):
        pressure = attempt.pressure
        lines.append(
            f"  Node pressure then: cpu {pressure.cpu:g}%, memory {pressure.memory:g}%, "
            f"io {pressure.io:g}% (PSI some avg10)"
        )
    width = None if no_trunc else OUTPUT_WIDTH
    if attempt.output.strip():
        lines.append(f"  Output: {one_line(attempt.output, width)}")
    if attempt.note:
        lines.append(f"  Note: {one_line(attempt.note, width)}")
    return [sanitize(line, ONE_LINE) for line in lines]


def _ran_by(attempt: query_pb2.ProbeAttempt) -> str:
    """``the kubelet (kubelet-mirror), within the 1s before the read that showed it``: who ran
    an attempt cri-prober did not run, and when (serve --mirror knows only the window)."""
    if attempt.source != "kubelet-mirror":
        return attempt.source
    text = "the kubelet (kubelet-mirror)"
    if attempt.HasField("window"):
        window = short_duration(seconds_of(attempt.window))
        text += f", within the {window} before the read that showed it"
    return text


# Lateness a person should hear of: a tick served later than this (or after dropped ones).
LATE_WORTH_SAYING = 0.1


def _lateness(attempt: query_pb2.ProbeAttempt) -> str:
    """``1.2s after its tick, 2 ticks dropped before it (the attempt before ran past them)``, or
    "" for an attempt on time."""
    late = seconds_of(attempt.late) if attempt.HasField("late") else 0.0
    if late < LATE_WORTH_SAYING and not attempt.ticks_dropped:
        return ""
    text = f"{short_duration(late)} after its tick"
    if attempt.ticks_dropped:
        text += (
            f", {_count(attempt.ticks_dropped, 'tick', 'ticks')} dropped before it"
            " (the attempt before ran past them)"
        )
    return text


def _counted(attempt: query_pb2.ProbeAttempt) -> str:
    """`` (failure 2/3, published, on hold)``: how the attempt counted and what it caused."""
    if not attempt.threshold:
        return " (not counted)" if attempt.result == "error" else ""
    parts = [f"{attempt.result} {run_text(attempt.run, attempt.threshold)}"]
    if attempt.changed:
        parts.append("changed the result")
    if attempt.held:
        parts.append("put the probe on hold")
    return f" ({', '.join(parts)})"


def history_text(history: Sequence[query_pb2.ProbeAttempt]) -> str:
    """The kept attempts, oldest first, as runs: ``success x12, failure x2``."""
    if not history:
        return "none kept"
    runs: list[list[Any]] = []
    for attempt in history:
        if runs and runs[-1][0] == attempt.result:
            runs[-1][1] += 1
        else:
            runs.append([attempt.result, 1])
    text = ", ".join(f"{result} x{count}" for result, count in runs)
    mirrored = sum(1 for attempt in history if attempt.source)
    by_kubelet = f", {mirrored} run by the kubelet" if mirrored else ""
    return f"{text} (oldest first, {len(history)} kept{by_kubelet})"


def _spec(status: query_pb2.ProbeStatus) -> dict[str, Any]:
    try:
        spec = json.loads(status.detail.spec_json or "{}")
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def describe_spec(spec: dict[str, Any]) -> str:
    """The handler and the timing of a probe spec, in one line (``exec [cat /tmp/alive] every
    2s, timeout 1s``)."""
    if "exec" in spec:
        handler = f"exec [{' '.join(map(str, spec['exec'].get('command', [])))}]"
    elif "httpGet" in spec:
        get = spec["httpGet"]
        handler = (
            f"httpGet {get.get('scheme', 'HTTP').lower()}://{get.get('host') or '<pod>'}:"
            f"{get.get('port')}{get.get('path', '/')}"
        )
    elif "tcpSocket" in spec:
        handler = (
            f"tcpSocket {spec['tcpSocket'].get('host') or '<pod>'}:{spec['tcpSocket'].get('port')}"
        )
    elif "grpc" in spec:
        service = spec["grpc"].get("service")
        handler = f"grpc port {spec['grpc'].get('port')}" + (
            f" service {service!r}" if service else ""
        )
    else:
        return "(spec not available)"
    timing = [
        f"every {short_duration(spec['periodSeconds'])}" if "periodSeconds" in spec else "",
        f"timeout {short_duration(spec['timeoutSeconds'])}" if "timeoutSeconds" in spec else "",
        f"delay {short_duration(spec['initialDelaySeconds'])}"
        if spec.get("initialDelaySeconds")
        else "",
    ]
    return ", ".join([handler, *filter(None, timing)])


def _thresholds(spec: dict[str, Any]) -> str:
    if "failureThreshold" not in spec:
        return ""
    return (
        f" (thresholds: success {spec.get('successThreshold', 1)}, "
        f"failure {spec['failureThreshold']})"
    )


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


__all__ = [
    "ID_WIDTH",
    "KIND_NAMES",
    "PS_HEADERS",
    "PS_WIDE_HEADERS",
    "WATCH_COLUMNS",
    "age",
    "attempt_lines",
    "container_summary",
    "cut",
    "describe_spec",
    "failure_why",
    "history_text",
    "human_duration",
    "one_line",
    "probe_summary",
    "probes_cell",
    "ps_row",
    "ps_wide_row",
    "short_duration",
    "state_name",
    "table",
    "transition_cells",
    "watch_line",
    "yes_no",
]
