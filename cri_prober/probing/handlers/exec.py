"""The exec handler: run a command in the container through CRI ExecSync, like the kubelet.

Exit 0 is success, any other exit status a failure, a timeout a failure; anything that kept the
command from running (unknown container, unknown executable, runtime down, a reply too big for
the CRI client's 16 MiB limit, a command over ``MAX_COMMAND_BYTES``) is a ``ProbeError``, with
reason ``not-running`` when the container had stopped or gone (the exec raced its stop). An exit
status that arrives after the timeout (the runtime waited for a background child to let go of
the exec's output) is judged like any other, as the kubelet does, and the outcome carries a note
saying so.

Unlike the kubelet's messages, nothing here shows an expanded ``$(VAR)`` value: commands are
quoted as written (``$(NAME)``), and the values that went into the command are masked in the
runtime's error text and in the command's output, because a container's env holds its secrets
and these texts end up in logs and in the API.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cri_prober.errors import CriContainerNotRunning, CriError
from cri_prober.probing.outcome import (
    MAX_OUTPUT_BYTES,
    ProbeError,
    ProbeOutcome,
    ProbeResult,
    Reason,
    shorten,
    truncate_output,
)

# The most an exec probe's argv may take, as written and after ``$(VAR)`` expansion: UTF-8 bytes
# plus one NUL per argument, as execve counts them. Linux takes 2 MiB of argv and env per exec and
# the kubelet sets no limit of its own, but no probe needs this much, and a cap checked while
# expanding is what keeps a short spec with many references to a big variable (1,000 x 100 KB)
# from building, sending and logging hundreds of megabytes per attempt.
MAX_COMMAND_BYTES = 64 * 1024
# How much of a command (as written, never expanded) a message shows.
COMMAND_SHOWN_CHARS = 256


class ExecReply(Protocol):
    """What this handler and the lifecycle hooks read of an ExecSync answer.

    The runtime's ``ExecResult`` has these fields (and more; see it for their meaning): probing
    names only what it reads, so that it imports nothing from the runtime layer. Read-only
    properties, so that a frozen dataclass matches.
    """

    @property
    def exit_code(self) -> int | None: ...  # None when the command timed out
    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...
    @property
    def timed_out(self) -> bool: ...
    @property
    def elapsed(self) -> float: ...
    @property
    def drained_after_timeout(self) -> bool: ...


class ExecRunner(Protocol):
    """The one CRI call this handler needs (``CriClient`` provides it)."""

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecReply:
        """Run argv in the container, bounded by ``timeout`` seconds."""
        ...


@runtime_checkable
class ExecCallMaker(Protocol):
    """A runner that builds one container's exec once for many attempts (``CriClient`` does):
    ``exec_call(...)()`` is ``exec_sync(...)``, without rebuilding the request each time."""

    def exec_call(
        self, container_id: str, cmd: Sequence[str], *, timeout: int
    ) -> Callable[[], Awaitable[ExecReply]]:
        """``exec_sync(container_id, cmd, timeout=timeout)``, built once."""
        ...


class CommandTooLarge(ProbeError):
    """The command, as written or after ``$(VAR)`` expansion, is over ``MAX_COMMAND_BYTES``."""


@dataclass(frozen=True, slots=True)
class Expansion:
    """An expanded argv and the values its ``$(NAME)`` references put into it."""

    argv: list[str]
    # name -> value, for every reference replaced by a non-empty value.
    values: dict[str, str] = field(default_factory=dict)

    def _markers(self) -> dict[str, str]:
        """value -> ``$(NAME)`` of the first name that expanded to it."""
        markers: dict[str, str] = {}
        for name, value in self.values.items():
            markers.setdefault(value, f"$({name})")
        return markers

    def redact(self, text: str) -> str:
        """``text`` with every expanded value shown as its ``$(NAME)`` again."""
        if not self.values or not text:
            return text
        markers = self._markers()
        # One pass, longest value first: a value inside another cannot split it, and a marker
        # put back is never rewritten.
        pattern = re.compile("|".join(re.escape(v) for v in sorted(markers, key=len, reverse=True)))
        return pattern.sub(lambda match: markers[match.group()], text)

    def redact_output(self, data: bytes, *, cut: bool) -> bytes:
        """Command output with every expanded value shown as its ``$(NAME)``.

        Works on bytes, before decoding, so a cut inside a multi-byte character cannot hide a
        value from the match. When the output may have been cut at the size limit, a tail that
        is the start of a value is masked too: the cut would otherwise leave a secret's prefix.
        """
        if not self.values or not data:
            return data
        markers = {value.encode(): marker.encode() for value, marker in self._markers().items()}
        ordered = sorted(markers, key=len, reverse=True)
        pattern = re.compile(b"|".join(re.escape(value) for value in ordered))
        data = pattern.sub(lambda match: markers[match.group()], data)
        if cut:
            for value in ordered:
                start = _tail_overlap(data, value)
                if start is not None:
                    data = data[:start] + markers[value]
        return data


def _tail_overlap(data: bytes, value: bytes) -> int | None:
    """Where the longest suffix of ``data`` that is a proper prefix of ``value`` starts."""
    view = memoryview(data)
    index = data.find(value[:1], max(0, len(data) - len(value) + 1))
    while index != -1:
        if value.startswith(view[index:]):
            return index
        index = data.find(value[:1], index + 1)
    return None


class _Budget:
    """Characters the expanded command may still take; expansion stops before going over."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, size: int) -> bool:
        self.left -= size
        return self.left >= 0


def expand_command(
    command: Sequence[str], env: Mapping[str, str], *, limit: int = MAX_COMMAND_BYTES
) -> list[str]:
    """Expand ``$(VAR)`` references in each argument with the kubelet's rules.

    ``$(NAME)`` becomes the variable's value when ``NAME`` is in ``env`` and stays verbatim
    otherwise; ``$$`` is an escaped ``$``; a ``$`` before anything else, or an unclosed ``$(``,
    is kept as written. No shell is involved.

    Raises:
        CommandTooLarge: the command, as written or expanded, takes over ``limit`` bytes.
        ProbeError: an argument is not valid Unicode (a lone surrogate from a JSON escape).
    """
    return expand(command, env, limit=limit).argv


def expand(
    command: Sequence[str], env: Mapping[str, str], *, limit: int = MAX_COMMAND_BYTES
) -> Expansion:
    """``expand_command``, also saying which values went in (see ``Expansion.redact``)."""
    # The command as written must fit too: scanning a megabyte of text on every attempt costs
    # as much as expanding it. A character is at least one UTF-8 byte, so this count is a floor.
    if sum(len(arg) + 1 for arg in command) > limit:
        raise CommandTooLarge(_too_large(command, limit))
    budget = _Budget(limit)
    values: dict[str, str] = {}
    argv: list[str] = []
    size = 0
    for index, arg in enumerate(command):
        expanded = _expand(arg, env, budget, values)
        if expanded is None:
            raise CommandTooLarge(_too_large(command, limit))
        try:
            size += len(expanded.encode()) + 1
        except UnicodeEncodeError:
            raise ProbeError(
                f"exec {show_command(command)}: argument {index} is not valid Unicode"
            ) from None
        # The budget counted characters; a character can take up to 4 bytes.
        if size > limit:
            raise CommandTooLarge(_too_large(command, limit))
        argv.append(expanded)
    return Expansion(argv, values)


def _expand(
    text: str, env: Mapping[str, str], budget: _Budget, values: dict[str, str]
) -> str | None:
    """Expand one argument, or None as soon as it would go over ``budget``."""
    out: list[str] = []
    checkpoint = 0
    # With no ")" after a "$(", no later "$(" can close either: knowing where the last ")" is
    # spares the rescans that would make many unclosed "$(" quadratic.
    last_close = text.rfind(")")
    cursor = text.find("$")
    while cursor != -1 and cursor + 1 < len(text):
        nxt = text[cursor + 1]
        end = cursor + 2
        if nxt == "$":
            piece = "$"
        elif nxt == "(":
            close = text.find(")", end) if end <= last_close else -1
            if close == -1:
                piece = "$("
            else:
                name = text[end:close]
                end = close + 1
                value = env.get(name)
                if value is None:
                    piece = text[cursor:end]
                else:
                    piece = value
                    if value:
                        values[name] = value
        else:
            piece = "$" + nxt
        literal = text[checkpoint:cursor]
        if not budget.take(len(literal) + len(piece)):
            return None
        out.append(literal)
        out.append(piece)
        checkpoint = end
        cursor = text.find("$", checkpoint)
    rest = text[checkpoint:]
    if not budget.take(len(rest)):
        return None
    out.append(rest)
    return "".join(out)


def _head(command: Sequence[str]) -> list[str]:
    # Only the head is rendered: a command can be megabytes long and is shown on every attempt.
    return [arg[: COMMAND_SHOWN_CHARS + 1] for arg in command[: COMMAND_SHOWN_CHARS + 1]]


def _shown_joined(command: Sequence[str]) -> str:
    return shorten(" ".join(_head(command)), COMMAND_SHOWN_CHARS)


def show_command(command: Sequence[str]) -> str:
    """The command as written (never expanded), as a list, cut to ``COMMAND_SHOWN_CHARS``."""
    return shorten(repr(_head(command)), COMMAND_SHOWN_CHARS)


def _too_large(command: Sequence[str], limit: int) -> str:
    return (
        f"expanded command too large: over {limit} bytes as written or after $(VAR) expansion: "
        f"exec {show_command(command)}"
    )


async def probe_exec(
    runner: ExecRunner,
    container_id: str,
    command: Sequence[str],
    *,
    timeout: int,
    env: Mapping[str, str] | None = None,
) -> ProbeOutcome:
    """Run ``command`` (after ``$(VAR)`` expansion with ``env``) and judge its exit status.

    Raises:
        ProbeError: the command could not run, or is too large (``CommandTooLarge``).
    """
    return await PreparedExec(runner, container_id, command, timeout=timeout, env=env).send()


class PreparedExec:
    """``probe_exec`` with what every attempt sends resolved once (issue 36): the ``$(VAR)``
    expansion and, from a runner that can (``ExecCallMaker``), the exec itself (its request
    message, deadline and slot holds). Each ``send`` is one attempt. It stays right while the
    container, command, timeout and env do; ``Prober.prepare`` builds a new one when they
    change.

    Raises (building it): ``ProbeError`` when the command cannot be expanded; the caller then
    expands at each attempt, which raises the same error each time.
    """

    __slots__ = ("_call", "_expansion", "_runner", "command", "container_id", "timeout")

    def __init__(
        self,
        runner: ExecRunner,
        container_id: str,
        command: Sequence[str],
        *,
        timeout: int,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._runner = runner
        self.container_id = container_id
        self.command = command
        self.timeout = timeout
        self._expansion = expansion = expand(command, env or {})
        self._call: Callable[[], Awaitable[ExecReply]] | None = (
            runner.exec_call(container_id, expansion.argv, timeout=timeout)
            if isinstance(runner, ExecCallMaker)
            else None
        )

    async def send(self) -> ProbeOutcome:
        """One attempt: run the command and judge its exit status (see ``probe_exec``)."""
        expansion = self._expansion
        command = self.command
        timeout = self.timeout
        try:
            if self._call is not None:
                result = await self._call()
            else:
                result = await self._runner.exec_sync(
                    self.container_id, expansion.argv, timeout=timeout
                )
        except CriError as exc:
            # The runtime's text may quote the argv it got (containerd: exec: "...": executable
            # file not found): mask the values in it, and keep the unmasked error out of the
            # chain. An exec that raced its container's stop or removal is as errored as the
            # kubelet's, but says nothing about the runtime: reason not-running (the worker logs
            # it at debug).
            raise ProbeError(
                f"exec {show_command(command)} could not run: {expansion.redact(str(exc))}",
                reason=(
                    Reason.NOT_RUNNING
                    if isinstance(exc, CriContainerNotRunning)
                    else Reason.RUNTIME_ERROR
                ),
            ) from (None if expansion.values else exc)
        note = _late_answer_note(result, timeout) if result.drained_after_timeout else ""
        if result.timed_out:
            return ProbeOutcome(
                ProbeResult.FAILURE,
                # The kubelet's CRI client wraps its "command timed out" error with the command
                # (the expanded one; we quote it as written) and the timeout as a Go duration.
                f'command timed out: "{_shown_joined(command)}" timed out after '
                f"{go_duration(timeout)}",
                timed_out=True,
                note=note,
            )
        stdout, stderr = result.stdout, result.stderr
        if stdout or stderr:
            raw = stdout + stderr
            output = truncate_output(expansion.redact_output(raw, cut=len(raw) >= MAX_OUTPUT_BYTES))
        else:
            output = ""  # what decoding no output gives, without the calls (most probes)
        verdict = ProbeResult.SUCCESS if result.exit_code == 0 else ProbeResult.FAILURE
        return ProbeOutcome(verdict, output, exit_code=result.exit_code, note=note)


def go_duration(seconds: int) -> str:
    """Whole seconds the way Go prints a ``time.Duration``: ``1s``, ``1m30s``, ``1h0m0s``."""
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s"


def _late_answer_note(result: ExecReply, timeout: int) -> str:
    """Explain an answer that only came after the timeout, or "" for an ordinary one."""
    if not result.drained_after_timeout:
        return ""
    what = "the timeout error" if result.timed_out else f"exit status {result.exit_code}"
    return (
        f"{what} came after {result.elapsed:.1f}s, past the {timeout}s timeout: the runtime "
        "waited for the command's output to close (a background process kept it open)"
    )
