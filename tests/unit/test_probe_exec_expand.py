"""``$(VAR)`` expansion in exec probe commands: the kubelet's rules, a size cap checked while
expanding, and no expanded value in any message or output."""

from __future__ import annotations

import tracemalloc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cri_prober.errors import CriError
from cri_prober.probing.handlers.exec import (
    MAX_COMMAND_BYTES,
    CommandTooLarge,
    expand,
    expand_command,
    probe_exec,
)
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError
from cri_prober.runtime.model import ExecResult

ENV = {"NAME": "world", "EMPTY": "", "PORT": "8080"}


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("$(NAME)", "world"),
        ("hello $(NAME)!", "hello world!"),
        ("$(NAME)$(PORT)", "world8080"),
        ("$(EMPTY)x", "x"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(NAME)", "$(NAME)"),
        ("$$$(NAME)", "$world"),
        ("$$", "$"),
        ("$NAME", "$NAME"),
        ("cost: 5$", "cost: 5$"),
        ("$(NAME", "$(NAME"),
        ("$()", "$()"),
        ("no refs", "no refs"),
        ("", ""),
    ],
)
def test_expansion_rules(arg: str, expanded: str) -> None:
    """Defined names expand, undefined stay verbatim, $$ escapes, malformed stays literal."""
    assert expand_command([arg], ENV) == [expanded]


def test_every_argument_is_expanded_separately() -> None:
    """Each argv element is expanded on its own; no shell splitting happens."""
    assert expand_command(["sh", "-c", "echo $(NAME) > /tmp/$(PORT)"], ENV) == [
        "sh",
        "-c",
        "echo world > /tmp/8080",
    ]


# -- the size cap ---------------------------------------------------------------------------------


def _reference_expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's third_party/forked/golang/expansion.Expand, transcribed byte for byte."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            advance = 1
            if nxt == "$":
                out.append("$")
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                else:
                    name = text[cursor + 2 : close]
                    out.append(env.get(name, f"$({name})"))
                    advance = close - cursor
            else:
                out.append("$" + nxt)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="$()AB x", max_size=40))
def test_expansion_matches_the_kubelet(text: str) -> None:
    """The bounded expander keeps upstream's semantics on every mix of $, (, ) and names."""
    env = {"A": "1", "AB": "", "B": "xyz"}
    assert expand_command([text], env) == [_reference_expand(text, env)]


def test_at_the_cap_expands_and_one_byte_over_does_not() -> None:
    """The cap counts UTF-8 bytes plus one NUL per argument, after expansion."""
    env = {"X": "12345", "E": "é" * 3}  # "é" takes 2 bytes
    assert expand_command(["ab", "$(X)"], env, limit=9) == ["ab", "12345"]
    with pytest.raises(CommandTooLarge, match="expanded command too large: over 8 bytes"):
        expand_command(["ab", "$(X)"], env, limit=8)
    assert expand_command(["$(E)"], env, limit=7) == ["ééé"]
    with pytest.raises(CommandTooLarge):
        expand_command(["$(E)"], env, limit=6)


def test_amplification_stops_at_the_cap_without_building_the_command() -> None:
    """The finding: 1,000 references to a 100 KB variable (a 4 KB spec) would build 100 MB per
    attempt. The expander gives up before it holds more than the cap."""
    command = ["sh", "-c", "$(BIG)" * 1000]
    env = {"BIG": "x" * 100_000}
    tracemalloc.start()
    try:
        with pytest.raises(CommandTooLarge) as raised:
            expand_command(command, env)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_COMMAND_BYTES, peak
    message = str(raised.value)
    assert len(message) < 600
    assert "x" * 100 not in message
    assert "$(BIG)" in message  # the command as written


def test_command_over_the_cap_as_written_is_refused() -> None:
    """A megabyte of literal text is refused before it is scanned, and never quoted whole."""
    with pytest.raises(CommandTooLarge) as raised:
        expand_command(["echo", "y" * (1 << 20)], {})
    assert len(str(raised.value)) < 600


def test_lone_surrogate_is_an_error_not_a_crash() -> None:
    """JSON's "\\ud800" gives a string that cannot be sent over gRPC: a ProbeError, not a crash."""
    with pytest.raises(ProbeError, match="argument 1 is not valid Unicode"):
        expand_command(["echo", "\ud800"], {})


def test_expansion_reports_the_values_it_used() -> None:
    """Only references that were replaced by a non-empty value are remembered, for redaction."""
    expansion = expand(["$(A) $(EMPTY) $(MISSING) $$(B)"], {"A": "1", "B": "2", "EMPTY": ""})
    assert expansion.argv == ["1  $(MISSING) $(B)"]
    assert expansion.values == {"A": "1"}


# -- redaction ------------------------------------------------------------------------------------

SECRET = "s3cr3t-Pa55w0rd"
SECRET_ENV = {"DB_PASSWORD": SECRET, "USER": "app"}
COMMAND = ["check", "--user=$(USER)", "--password=$(DB_PASSWORD)"]


@dataclass
class Runner:
    """An ExecRunner that answers with one fixed result or error and records the argv it got."""

    result: ExecResult | None = None
    error: CriError | None = None
    argvs: list[list[str]] = field(default_factory=list)

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        self.argvs.append(list(cmd))
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


async def test_the_runtime_gets_the_values_but_a_timeout_message_shows_names() -> None:
    """The finding: a timed-out probe's output quoted the expanded command, secret and all."""
    runner = Runner(ExecResult(None, b"", b"", timed_out=True))
    outcome = await probe_exec(runner, "c", COMMAND, timeout=1, env=SECRET_ENV)
    assert runner.argvs == [["check", "--user=app", f"--password={SECRET}"]]
    assert outcome.output == (
        'command timed out: "check --user=$(USER) --password=$(DB_PASSWORD)" timed out after 1s'
    )


async def test_runtime_error_text_is_masked_and_not_chained() -> None:
    """containerd quotes the argv it could not run; the values in it are masked, and the
    unmasked error is not kept as the ProbeError's cause (a traceback would print it)."""
    runner = Runner(
        error=CriError(
            "ExecSync", grpc.StatusCode.UNKNOWN, f'exec: "--password={SECRET}": not found'
        )
    )
    with pytest.raises(ProbeError) as raised:
        await probe_exec(runner, "c", COMMAND, timeout=1, env=SECRET_ENV)
    message = str(raised.value)
    assert SECRET not in message
    assert '"--password=$(DB_PASSWORD)": not found' in message
    assert "exec ['check', '--user=$(USER)', '--password=$(DB_PASSWORD)'] could not run" in message
    assert raised.value.__cause__ is None


async def test_output_is_masked_even_when_cut_inside_a_value() -> None:
    """Values the command prints come back as $(NAME); a value cut by the 10 KiB limit leaves
    no prefix behind."""
    runner = Runner(ExecResult(1, f"user app, password {SECRET}\n".encode(), b""))
    outcome = await probe_exec(runner, "c", COMMAND, timeout=1, env=SECRET_ENV)
    assert outcome.output == "user $(USER), password $(DB_PASSWORD)\n"

    padding = b"." * (MAX_OUTPUT_BYTES - 6)
    runner.result = ExecResult(1, padding + SECRET.encode()[:6], b"")  # cut after "s3cr3t"
    outcome = await probe_exec(runner, "c", COMMAND, timeout=1, env=SECRET_ENV)
    # The marker itself is cut at the limit like any output; no part of the value is left.
    assert outcome.output == "." * (MAX_OUTPUT_BYTES - 6) + "$(DB_P"


async def test_amplified_command_never_reaches_the_runtime() -> None:
    """An attempt whose command is over the cap is an error; nothing is sent."""
    runner = Runner(ExecResult(0, b"", b""))
    with pytest.raises(CommandTooLarge):
        await probe_exec(runner, "c", ["$(BIG)"] * 1000, timeout=1, env={"BIG": "x" * 100_000})
    assert runner.argvs == []
