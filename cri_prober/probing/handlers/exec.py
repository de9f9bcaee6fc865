"""The exec handler: run a command in the container through CRI ExecSync, like the kubelet.

Exit 0 is success, any other exit status a failure, a timeout a failure; anything that kept the
command from running (unknown container, unknown executable, runtime down, a reply too big for
the CRI client's 16 MiB limit) is a ``ProbeError``. An exit status that arrives after the timeout
(the runtime waited for a background child to let go of the exec's output) is judged like any
other, as the kubelet does, and the outcome carries a note saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from cri_prober.errors import CriError
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult, truncate_output
from cri_prober.runtime.client import ExecResult


class ExecRunner(Protocol):
    """The one CRI call this handler needs (``CriClient`` provides it)."""

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        """Run argv in the container, bounded by ``timeout`` seconds."""
        ...


def expand_command(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Expand ``$(VAR)`` references in each argument with the kubelet's rules.

    ``$(NAME)`` becomes the variable's value when ``NAME`` is in ``env`` and stays verbatim
    otherwise; ``$$`` is an escaped ``$``; a ``$`` before anything else, or an unclosed ``$(``,
    is kept as written. No shell is involved.
    """
    return [_expand(arg, env) for arg in command]


def _expand(text: str, env: Mapping[str, str]) -> str:
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


async def probe_exec(
    runner: ExecRunner,
    container_id: str,
    command: Sequence[str],
    *,
    timeout: int,
    env: Mapping[str, str] | None = None,
) -> ProbeOutcome:
    """Run ``command`` (after ``$(VAR)`` expansion with ``env``) and judge its exit status."""
    argv = expand_command(command, env or {})
    try:
        result = await runner.exec_sync(container_id, argv, timeout=timeout)
    except CriError as exc:
        raise ProbeError(f"exec {argv!r} could not run: {exc}") from exc
    note = _late_answer_note(result, timeout)
    if result.timed_out:
        return ProbeOutcome(
            ProbeResult.FAILURE,
            # The kubelet's CRI client wraps its "command timed out" error with the command
            # and the timeout as a Go duration.
            f'command timed out: "{" ".join(argv)}" timed out after {go_duration(timeout)}',
            timed_out=True,
            note=note,
        )
    output = truncate_output(result.stdout + result.stderr)
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


def _late_answer_note(result: ExecResult, timeout: int) -> str:
    """Explain an answer that only came after the timeout, or "" for an ordinary one."""
    if not result.drained_after_timeout:
        return ""
    what = "the timeout error" if result.timed_out else f"exit status {result.exit_code}"
    return (
        f"{what} came after {result.elapsed:.1f}s, past the {timeout}s timeout: the runtime "
        "waited for the command's output to close (a background process kept it open)"
    )
