"""`cri-prober serve` as a subprocess: bad input exits 2 with the field path; SIGTERM exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.waiting import HANG_GUARD

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
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 2
    message = err.decode()
    assert f"{rules}: probes[1].livenessProbe.periodSeconds: must be >= 0" in message
    assert "Traceback" not in message


def _merge_bomb(levels: int) -> str:
    """Chained merge keys, each level four copies of the one before: 419 bytes at 11 levels."""
    lines = ["a0: &a0 {k: v}"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * 4)
        lines.append(f"a{level}: &a{level} {{<<: [{refs}]}}")
    return "\n".join([*lines, "probes: []", ""])


def _invalid_utf8(path: Path) -> None:
    path.write_bytes(b"probes:\n  - livenessProbe: {exec: {command: [caf\xe9]}}\n")


def _oversized(path: Path) -> None:
    rule = "  - match: {pod: web}\n    livenessProbe: {exec: {command: [cat, /tmp/x]}}\n"
    path.write_text("probes:\n" + rule * (5_000_000 // len(rule)))


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _bomb(path: Path) -> None:
    path.write_text(_merge_bomb(11))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        pytest.param(
            _invalid_utf8, "not valid UTF-8: byte 48 (line 2): invalid continuation byte", id="utf8"
        ),
        pytest.param(_oversized, "too large: ", id="5-MB"),
        pytest.param(_fifo, "not a regular file (a FIFO)", id="fifo"),
        pytest.param(_bomb, "aliases expand to more than 10000 nodes", id="merge-key-bomb"),
    ],
)
async def test_hostile_rules_file_exits_2_with_one_line(
    tmp_path: Path, make: Callable[[Path], None], reason: str
) -> None:
    """A rules file that is no text, too large, a FIFO or a YAML bomb: exit 2 at once, with the
    usual header and one line naming the file and the problem; never a traceback or a hang."""
    rules = tmp_path / "rules.yaml"
    make(rules)
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "-c", str(rules))
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    lines = err.decode().splitlines()
    assert proc.returncode == 2, lines
    assert lines[0] == "cri-prober: invalid probe rules:"
    assert len(lines) == 2, lines
    assert lines[1].startswith(f"{rules}: "), lines
    assert reason in lines[1], lines


async def test_missing_rules_file_exits_2(tmp_path: Path) -> None:
    """A rules file that does not exist is a usage error naming it."""
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "-c", str(tmp_path / "nope.yaml"))
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 2
    assert "nope.yaml" in err.decode()


async def test_bad_flag_exits_2(tmp_path: Path) -> None:
    """An invalid flag value is a usage error."""
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", "--pleg", "sometimes")
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
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
    first_line = await asyncio.wait_for(proc.stderr.readline(), HANG_GUARD)
    assert b"serve_starting" in first_line
    proc.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 0, err.decode()
    assert b"serve_stopped" in err


@pytest.mark.parametrize(
    ("flags", "expected"), [((), "uvloop"), (("--event-loop", "asyncio"), "asyncio")]
)
async def test_event_loop_is_uvloop_unless_asked_otherwise(
    tmp_path: Path, flags: tuple[str, ...], expected: str
) -> None:
    """serve runs on uvloop by default (`auto`, uvloop being installed) and on asyncio's own
    loop with --event-loop asyncio; its first log line says which."""
    proc = await _serve(
        "-r", f"unix://{tmp_path}/none.sock", "--listen", f"unix://{tmp_path}/api.sock",
        "--log-format", "json", *flags,
    )  # fmt: skip
    assert proc.stderr is not None
    first_line = json.loads(await asyncio.wait_for(proc.stderr.readline(), HANG_GUARD))
    proc.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 0, err.decode()
    assert first_line["event"] == "serve_starting"
    assert first_line["event_loop"] == expected


async def test_missing_https_ca_file_exits_2(tmp_path: Path) -> None:
    """--https-ca-file must name an existing file: usage error otherwise."""
    proc = await _serve(
        "-r", f"unix://{tmp_path}/none.sock", "--https-ca-file", str(tmp_path / "ca.pem")
    )
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 2
    assert "--https-ca-file" in err.decode()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--probes-from", "docker"), "unknown source; expected kubelet[:URL], apiserver or"),
        (("--probes-from", "manifests"), "manifests needs a directory"),
        (("--probes-from", "kubelet:127.0.0.1:10250"), "must start with http:// or https://"),
        (("--probes-from", "apiserver", "--probes-from", "apiserver"), "is given twice"),
        (
            ("--probes-from", "kubelet", "--kubelet-client-cert", "/c.pem"),
            "--kubelet-client-cert and --kubelet-client-key go together",
        ),
    ],
)
async def test_bad_probes_from_exits_2_with_one_line(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    """A bad --probes-from value or kubelet credential pair is a usage error, no traceback."""
    proc = await _serve("-r", f"unix://{tmp_path}/none.sock", *args)
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 2
    assert message in err.decode()
    assert "Traceback" not in err.decode()


async def test_apiserver_source_without_a_cluster_exits_2(tmp_path: Path) -> None:
    """--probes-from apiserver with no usable configuration (no kubeconfig, not in a cluster)
    fails the start with one line, before anything runs."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "absent"), "HOME": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "serve", "-r", f"unix://{tmp_path}/none.sock",
        "--listen", f"unix://{tmp_path}/api.sock", "--probes-from", "apiserver",
        "--node-name", "node-1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 2, err.decode()
    assert "Traceback" not in err.decode()
    assert "--probes-from apiserver: no usable Kubernetes client config" in err.decode()
    assert str(tmp_path / "absent") in err.decode()
