"""What every testbed module shares: the user-facing error, progress logging and `run`.

Standard library only, like everything `install` needs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


class TestbedError(Exception):
    """A failure the user should read; printed without a traceback."""


def log(message: str) -> None:
    """Progress for humans on stderr; stdout is reserved for JSON."""
    print(f"testbed: {message}", file=sys.stderr, flush=True)


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing its output; on failure with check=True, raise with that output."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise TestbedError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}".rstrip()
        )
    return proc
