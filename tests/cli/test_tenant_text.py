"""Issue 34: tenant text is data, never terminal control. A probe's output and every pod-spec
string reach ``inspect`` (table and ``--no-trunc``), ``ps``, ``watch``, ``health``'s stderr,
``check``, error lines and the console log shown visibly; ``-o json|yaml`` keep the exact text
as escapes. Built from API messages without a daemon, then (below) against one."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cri_prober import logs
from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.cli.check import _print_record
from cri_prober.cli.client import _emit
from cri_prober.cli.common import fail
from cri_prober.cli.tables import (
    PS_HEADERS,
    PS_WIDE_HEADERS,
    container_summary,
    not_serving_lines,
    ps_row,
    ps_wide_row,
    table,
    transition_cells,
    watch_line,
)
from cri_prober.cli.version import version_lines
from cri_prober.daemon import Daemon
from cri_prober.probing.results import ProbeRecord
from cri_prober.runtime.model import RuntimeVersion
from tests.cli.test_tables import NOW, ts
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.serve import cli_env, run_cli
from tests.support.waiting import HANG_GUARD
from tests.unit.test_text import ANY_TEXT, TITLE_AND_CLEAR, raw_controls

SHOWN = "^[]0;TITLE^G^[[2J"


def hostile_container(text: str, argv: list[str], output: str) -> query_pb2.Container:
    """A container whose every string a tenant could write holds ``text``; its liveness probe
    runs ``argv``, failed with ``output``, and names ``text`` in each pod-spec string."""
    spec = {
        "exec": {"command": argv},
        "periodSeconds": 2,
        "timeoutSeconds": 1,
        "failureThreshold": 3,
    }
    http = {"httpGet": {"host": text, "port": text, "path": text, "scheme": "HTTP"}}
    grpc = {"grpc": {"port": 1, "service": text}}
    last = query_pb2.ProbeAttempt(
        time=ts(NOW - 1), result="failure", exit_code=1, output=output, note=output,
        reason=text, run=1, threshold=3,
    )  # fmt: skip

    def status(spec: dict[str, Any]) -> query_pb2.ProbeStatus:
        return query_pb2.ProbeStatus(
            result="failure", hold=text, origin=text, source=text, active=True,
            in_progress=text, last_attempt=last,
            detail=query_pb2.ProbeDetail(spec_json=json.dumps(spec), history=[last]),
        )  # fmt: skip

    return query_pb2.Container(
        id=text + "4857b031d6f2a9e0c1d2", name=text, pod_name=text, pod_namespace=text,
        state=query_pb2.CONTAINER_RUNNING, created_at=ts(NOW - 60),
        probes=query_pb2.Probes(liveness=status(spec), readiness=status(http),
                                startup=status(grpc)),
    )  # fmt: skip


def hostile_transition(text: str) -> query_pb2.Transition:
    return query_pb2.Transition(
        sequence=7, time=ts(NOW), container_id=text, container_name=text, pod_name=text,
        pod_namespace=text, kind=text, previous=text, result=text, reason=text,
        consecutive=1, threshold=3,
    )  # fmt: skip


def console_line(**event: Any) -> str:
    """What the console log renderer prints for ``event``, as logs.configure chains it."""
    rendered = structlog.dev.ConsoleRenderer(colors=False)(
        None, "warning", logs.shown_for_console(None, "warning", dict(event))
    )
    assert isinstance(rendered, str)
    return rendered


def human_outputs(
    text: str, argv: list[str], output: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, str]:
    """Everything a person reads that can carry ``text``, by renderer."""
    c = hostile_container(text, argv, output)
    t = hostile_transition(text)
    out = {
        "ps": table(PS_HEADERS, [ps_row(c, NOW, no_trunc=False)], gap=2),
        "ps --no-trunc": table(PS_HEADERS, [ps_row(c, NOW, no_trunc=True)], gap=2),
        "ps -o wide": table(PS_WIDE_HEADERS, [ps_wide_row(c, NOW, no_trunc=True)]),
        "watch": watch_line(transition_cells(t, no_trunc=False), no_trunc=False),
        "watch --no-trunc": watch_line(transition_cells(t, no_trunc=True), no_trunc=True),
        "inspect": "\n".join(container_summary(c, NOW)),
        "inspect --no-trunc": "\n".join(container_summary(c, NOW, no_trunc=True)),
        "health stderr": "\n".join(not_serving_lines([c])),
        "version": "\n".join(version_lines("0.1.0", text, RuntimeVersion(text, text, text, text))),
        "console log": console_line(event=text, output=output, argv=argv),
    }
    capsys.readouterr()
    _print_record(ProbeRecord(text, NOW, 0.1, "failure", output, exit_code=1), 1, 1)
    out["check"] = capsys.readouterr().out
    with pytest.raises(SystemExit):
        fail(f"container {text} went away: {output}", 1)
    out["error line"] = capsys.readouterr().err
    return out


class TestTheMeasuredPayload:
    """ESC ]0;TITLE BEL ESC [2J in an exec probe's argv and output, as issue 34 measured it."""

    def test_every_renderer_shows_it_and_none_passes_it(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        outputs = human_outputs(
            TITLE_AND_CLEAR, ["sh", "-c", TITLE_AND_CLEAR], TITLE_AND_CLEAR, capsys
        )
        for renderer, text in outputs.items():
            assert "\x1b" not in text, renderer
            assert "\x07" not in text, renderer
            assert SHOWN in text, renderer

    def test_the_argv_alone_is_shown_visibly(self) -> None:
        """A pod spec's argv reaches inspect with no exec run (no attempt yet)."""
        c = hostile_container("x", ["sh", "-c", TITLE_AND_CLEAR], "")
        c.probes.liveness.ClearField("last_attempt")
        lines = container_summary(c, NOW)
        assert f"Liveness probe: exec [sh -c {SHOWN}], every 2s, timeout 1s" in lines

    def test_a_newline_in_a_name_starts_no_line(self) -> None:
        """A name cannot forge a line or a row: one line per row and per summary key."""
        c = hostile_container("web\nHealthy: true", ["x"], "")
        rows = table(PS_HEADERS, [ps_row(c, NOW, no_trunc=True)], gap=2).split("\n")
        assert len(rows) == 2
        assert "web^JHealthy: true" in rows[1]
        summary = "\n".join(container_summary(c, NOW)).split("\n")
        assert f"Name: {'web^JHealthy: true/' * 2}web^JHealthy: true" in summary
        assert not [line for line in summary if line.startswith("Healthy")]
        health = "\n".join(not_serving_lines([c])).split("\n")
        assert len(health) == 3
        assert all(line.startswith("web^JHealthy: true/") for line in health)

    def test_cut_cells_keep_their_width(self) -> None:
        """Cells are sanitized before they are measured and cut: ps still fits its columns."""
        c = hostile_container("\x1b" * 40, ["x"], "")
        [_, row] = table(PS_HEADERS, [ps_row(c, NOW, no_trunc=False)], gap=2).splitlines()
        pod = row.split()[1]
        assert len(pod) == 26
        assert pod.startswith("^[^[")
        assert "…" in pod

    def test_multi_line_output_keeps_its_lines_in_check(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        _print_record(ProbeRecord("c", NOW, 0.1, "failure", "a\tb\nc\x1bd\n"), 1, 1)
        assert capsys.readouterr().out.splitlines()[1:] == ["a\tb", "c^[d"]


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_machine_output_keeps_the_exact_text(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """-o json|yaml: the exact text comes back when parsed, and no control character is raw."""
    value = TITLE_AND_CLEAR + "\x7f\x85\x9b\u202e\u2066é日"
    _emit({"output": value, "argv": ["sh", value]}, output)
    document = capsys.readouterr().out
    assert raw_controls(document, "\n") == [], document
    parsed = json.loads(document) if output == "json" else yaml.safe_load(document)
    assert parsed == {"output": value, "argv": ["sh", value]}


def test_plain_text_keeps_readable_machine_output(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a control character, yaml stays readable (non-ASCII as written)."""
    _emit({"name": "café"}, "yaml")
    assert capsys.readouterr().out == "name: café\n"


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_serve_log_lines_carry_no_control(log_format: str) -> None:
    """The log as serve writes it (console on a terminal, JSON otherwise), for structlog's own
    lines and for a library's: the payload shown or escaped, never raw."""
    program = (
        "import logging, structlog\n"
        "from cri_prober import logs\n"
        f"logs.configure(log_format={log_format!r})\n"
        f"structlog.get_logger().warning({TITLE_AND_CLEAR!r}, output={TITLE_AND_CLEAR!r})\n"
        f"logging.getLogger('grpc').warning('%s', {TITLE_AND_CLEAR!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
        check=True,
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert raw_controls(result.stderr, "\n") == [], result.stderr
    if log_format == "console":
        assert all(SHOWN in line for line in lines), lines
    else:
        assert json.loads(lines[0])["output"] == TITLE_AND_CLEAR


# Text as the daemon hands it over: any code point a protobuf string can hold, a probe's bytes
# decoded leniently (outcome.truncate_output), and argv strings, which reach the CLI as JSON
# (lone surrogates from a pod spec's JSON escapes included).
PROTO_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
OUTPUT_TEXT = st.one_of(
    PROTO_TEXT, st.binary(max_size=60).map(lambda data: data.decode("utf-8", "replace"))
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(PROTO_TEXT, st.lists(ANY_TEXT, max_size=4), OUTPUT_TEXT)
def test_no_control_character_survives_any_renderer(
    capsys: pytest.CaptureFixture[str], text: str, argv: list[str], output: str
) -> None:
    """Arbitrary tenant text through every table, summary and stderr renderer: no C0 or C1
    control, DEL, bidi override or lone surrogate is left, bar newlines and tabs where a
    renderer keeps them (multi-line text); a table or summary line holds no tab or newline of
    the tenant's either (one line each)."""
    outputs = human_outputs(text, argv, output, capsys)
    for renderer, shown in outputs.items():
        assert raw_controls(shown, "\n\t") == [], renderer
        shown.encode("utf-8")  # writable: no lone surrogate
    for cells in ("ps", "ps --no-trunc", "ps -o wide", "watch", "watch --no-trunc"):
        assert "\t" not in outputs[cells], cells
    for lines, count in (("ps", 2), ("ps -o wide", 2), ("watch", 1), ("health stderr", 3)):
        assert len(outputs[lines].split("\n")) == count, lines
    assert len(outputs["version"].split("\n")) == 6


# -- against a daemon -----------------------------------------------------------------------------

# The payload in the argv (a YAML double-quoted string's escapes: \e is ESC, \a BEL) and in the
# output of a failing exec liveness probe; the pod's name carries it too.
RULES = r"""
probes:
  - match: {container: app}
    livenessProbe:
      exec: {command: [check-live, "\e]0;TITLE\a\e[2J"]}
      periodSeconds: 1
      failureThreshold: 1
"""
POD = "web\x1b]0;POD\x07"
# What the probe prints: the payload, then a bidi override and a C1 CSI, which JSON's and YAML's
# own escaping let through.
OUTPUT = TITLE_AND_CLEAR + "\u202e\x9b"
OUTPUT_SHOWN = SHOWN + "\\u202e\\x9b"


async def _exec(_c: FakeContainer, cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
    return api_pb2.ExecSyncResponse(exit_code=1, stdout=OUTPUT.encode())


@pytest.fixture(name="daemon")
async def _daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    runtime = FakeRuntime(exec_handler=_exec)
    runtime.add_container(runtime.add_sandbox(POD, namespace="shop"), "app")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES, failure_hold="always") as (
        daemon,
        watcher,
    ):
        await watcher.until(
            lambda: any(t.result.value == "failure" for t in watcher.transitions), timeout=20
        )
        yield daemon


def assert_shown(stream: str, what: str) -> None:
    assert "\x1b" not in stream, (what, stream)
    assert "\x07" not in stream, (what, stream)
    assert raw_controls(stream, "\n") == [], (what, stream)


async def test_the_commands_show_the_payload_and_pass_none_of_it(daemon: Daemon) -> None:
    """Issue 34's measurement, as a user runs the commands (subprocesses, output piped): no ESC
    or BEL reaches stdout or stderr of inspect (table, --no-trunc), ps, watch or health."""
    address = ("--address", daemon.config.listen)
    target = f"shop/{POD}/app"
    for args in (["inspect", target], ["inspect", target, "--no-trunc"]):
        result = await run_cli(*args, *address)
        assert result.returncode == 0, result.stderr
        assert_shown(result.stdout, " ".join(args))
        assert f"Liveness probe: exec [check-live {SHOWN}], every 1s" in result.stdout
        assert f"  Output: {OUTPUT_SHOWN}" in result.stdout
        assert "Name: shop/web^[]0;POD^G/app" in result.stdout
    for args in (["ps"], ["ps", "--no-trunc"], ["ps", "-o", "wide"], ["ps", "-q"]):
        result = await run_cli(*args, *address)
        assert result.returncode == 0, result.stderr
        assert_shown(result.stdout, " ".join(args))
    assert "shop/web^[]0;POD^G" in (await run_cli("ps", "--no-trunc", *address)).stdout
    health = await run_cli("health", target, *address)
    assert health.returncode == 4, health.stderr
    assert_shown(health.stderr, "health")
    assert health.stderr.startswith("shop/web^[]0;POD^G/app: liveness failure (exit-code 1/1")
    assert health.stderr.rstrip().endswith(f": {OUTPUT_SHOWN}")
    missing = await run_cli("inspect", f"shop/{POD}/gone", *address)
    assert missing.returncode == 1
    assert_shown(missing.stderr, "an error line quoting the name")


async def test_watch_table_shows_the_payload(daemon: Daemon) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "watch", "--since", "0", "--no-trunc",
        "--address", daemon.config.listen,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(HANG_GUARD):
            header = await proc.stdout.readline()
            line = (await proc.stdout.readline()).decode()
    finally:
        proc.send_signal(signal.SIGINT)
        await proc.wait()
    assert header.startswith(b"TIME")
    assert_shown(line, "watch")
    assert "shop/web^[]0;POD^G" in line


@pytest.mark.parametrize("output", ["json", "yaml"])
async def test_inspect_machine_output_has_the_exact_text(daemon: Daemon, output: str) -> None:
    result = await run_cli(
        "inspect", f"shop/{POD}/app", "-o", output, "--address", daemon.config.listen
    )
    assert result.returncode == 0, result.stderr
    assert_shown(result.stdout, output)
    document = json.loads(result.stdout) if output == "json" else yaml.safe_load(result.stdout)
    assert document["podName"] == POD
    liveness = document["probes"]["liveness"]
    assert liveness["spec"]["exec"]["command"] == ["check-live", TITLE_AND_CLEAR]
    assert liveness["lastAttempt"]["output"] == OUTPUT
