"""`cri-prober serve` as a subprocess: bad input exits 2 with the field path; SIGTERM exits 0."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

BAD_RULES = """probes:
  - match: {container: app}
    livenessProbe:
      exec: {command: [true]}
  - match: {container: web}
    livenessProbe:
      tcpSocket: {port: 80}
      periodSeconds: -5
"""


async def _serve(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "serve", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def test_bad_rules_file_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    """A rules file breaking a rule: exit 2, one message with file, field path and rule."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(BAD_RULES)
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "-c", str(rules))
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    message = err.decode()
    assert f"{rules}: probes[1].livenessProbe.periodSeconds: must be >= 0" in message
    assert "Traceback" not in message


async def test_missing_rules_file_exits_2(tmp_path: Path) -> None:
    """A rules file that does not exist is a usage error naming it."""
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "-c", str(tmp_path / "nope.yaml"))
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "nope.yaml" in err.decode()


async def test_bad_flag_exits_2(tmp_path: Path) -> None:
    """An invalid flag value is a usage error."""
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "--pleg", "sometimes")
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "--pleg" in err.decode()


async def test_sigterm_exits_0_even_without_a_runtime(tmp_path: Path) -> None:
    """With the runtime absent serve keeps retrying; SIGTERM still ends it cleanly with 0."""
    proc = await _serve(
        "-r", f"unix://{tmp_path}/none.sock", "--listen", f"unix://{tmp_path}/api.sock",
        "--log-format", "json",
    )  # fmt: skip
    assert proc.stderr is not None
    # Wait until it is really running (its first log line), then stop it.
    first_line = await asyncio.wait_for(proc.stderr.readline(), 30)
    assert b"serve_starting" in first_line
    proc.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert b"serve_stopped" in err


async def test_missing_https_ca_file_exits_2(tmp_path: Path) -> None:
    """--https-ca-file must name an existing file: usage error otherwise."""
    proc = await _serve(
        "-r", f"unix://{tmp_path}/none.sock", "--https-ca-file", str(tmp_path / "ca.pem")
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "--https-ca-file" in err.decode()
