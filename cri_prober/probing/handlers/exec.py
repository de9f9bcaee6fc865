"""The exec handler: run a command in the container through CRI ExecSync, like the kubelet.

Exit 0 is success, any other exit status a failure, a timeout a failure; anything that kept the
command from running (unknown container, unknown executable, runtime down) is a ``ProbeError``.
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
    if result.timed_out:
        return ProbeOutcome(
            ProbeResult.FAILURE, f'command "{" ".join(argv)}" timed out', timed_out=True
        )
    output = truncate_output(result.stdout + result.stderr)
    verdict = ProbeResult.SUCCESS if result.exit_code == 0 else ProbeResult.FAILURE
    return ProbeOutcome(verdict, output, exit_code=result.exit_code)
