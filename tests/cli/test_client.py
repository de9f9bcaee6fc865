"""Client commands: errors, exit statuses and formatting where no daemon or runtime is needed,
then ``watch --since`` and hostile ``ps`` filters against an in-process daemon on the fake
runtime (the commands run as subprocesses, as a user runs them).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cri_prober.cli.tables import human_duration
from cri_prober.daemon import Daemon
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime
from tests.support.serve import cli_env, run_cli
from tests.support.waiting import HANG_GUARD


class TestWithoutDaemon:
    @pytest.mark.parametrize("command", [["ps"], ["inspect", "x"], ["watch"]])
    async def test_clear_error(self, tmp_path: Path, command: list[str]) -> None:
        """A client command with no daemon at --address says so and exits 1, no traceback."""
        result = await run_cli(*command, "--address", f"unix://{tmp_path}/absent.sock")
        assert result.returncode == 1
        assert "cannot connect to cri-prober" in result.stderr
        assert "Traceback" not in result.stderr

    async def test_health_cannot_connect_exits_2(self, tmp_path: Path) -> None:
        """health exits 2 when nothing listens at --address (grpc-health-probe's code)."""
        result = await run_cli("health", "--address", f"unix://{tmp_path}/absent.sock")
        assert result.returncode == 2
        assert "cannot connect to cri-prober" in result.stderr

    @pytest.mark.parametrize("command", [["ps"], ["health"]])
    async def test_bad_address_is_a_usage_error(self, command: list[str]) -> None:
        """An --address in an unsupported form exits 2 naming the flag."""
        result = await run_cli(*command, "--address", "http://example")
        assert result.returncode == 2
        assert "--address" in result.stderr
        assert "Traceback" not in result.stderr

    @pytest.mark.parametrize(
        ("since", "expected"),
        [
            ("5", "needs the incarnation it came from, as INCARNATION:5"),
            ("abc", "is not INCARNATION:SEQ"),
            (":3", "is not INCARNATION:SEQ"),
            ("abc:", "is not INCARNATION:SEQ"),
            ("abc:-1", "is not INCARNATION:SEQ"),
            ("abc:" + "9" * 30, "is not INCARNATION:SEQ"),
        ],
    )
    async def test_watch_since_needs_an_incarnation(
        self, tmp_path: Path, since: str, expected: str
    ) -> None:
        """A bare sequence above 0 could name another process's transition: a usage error."""
        address = f"unix://{tmp_path}/absent.sock"
        result = await run_cli("watch", "--since", since, "--address", address)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr

    @pytest.mark.parametrize("since", ["0", "3f2a9c1d0b8e7a65:12", "3f2a9c1d0b8e7a65:0"])
    async def test_watch_since_forms_that_parse(self, tmp_path: Path, since: str) -> None:
        """0 alone and INCARNATION:SEQ are accepted (then there is no daemon to ask: exit 1)."""
        address = f"unix://{tmp_path}/absent.sock"
        result = await run_cli("watch", "--since", since, "--address", address)
        assert result.returncode == 1
        assert "cannot connect to cri-prober" in result.stderr

    async def test_check_bad_spec_needs_no_runtime(self) -> None:
        """check validates the spec before it looks for the runtime: exit 2 with the field."""
        result = await run_cli(
            "check", "x", "--probe", '{"httpGet": {"port": 0}}', "-r", "unix:///absent.sock"
        )
        assert result.returncode == 2
        assert "httpGet.port" in result.stderr


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.5, "Less than a second"),
        (1, "1 second"),
        (59, "59 seconds"),
        (60, "About a minute"),
        (119, "About a minute"),
        (120, "2 minutes"),
        (3599, "59 minutes"),
        (3600, "About an hour"),
        (5400, "2 hours"),  # rounded, as Go's math.Round
        (47 * 3600, "47 hours"),
        (48 * 3600, "2 days"),
        (14 * 86400, "2 weeks"),
        (60 * 86400, "2 months"),
        (730 * 86400, "2 years"),
    ],
)
def test_human_duration_matches_crictl(seconds: float, text: str) -> None:
    """Ages read like crictl's (Go's units.HumanDuration)."""
    assert human_duration(seconds) == text


# -- against a daemon -----------------------------------------------------------------------------

RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""
# Backtracks 2^n steps in Python's re on an n-character name that does not end in ".svc": ~18 s
# for 29 characters, over 200 days for the 49 of VICTIM_POD.
CATASTROPHIC = r"^([a-z0-9-]+)+\.svc$"
VICTIM_POD = "checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q"


@pytest.fixture(name="daemon")
async def _daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    runtime = FakeRuntime()
    for pod in (VICTIM_POD, "cache.svc"):  # 49 characters, and a match
        runtime.add_container(runtime.add_sandbox(pod), "app")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES) as (daemon, watcher):
        # Each container's readiness publishes its first result (success): two transitions.
        assert daemon.api is not None
        log = daemon.api.transitions
        await watcher.until(lambda: log.sequence >= 2, timeout=HANG_GUARD)
        yield daemon


def address_of(daemon: Daemon) -> str:
    return daemon.config.listen


async def watch_json(daemon: Daemon, *args: str, lines: int) -> list[dict[str, Any]]:
    """Run ``watch -o json ARGS`` until it printed ``lines`` transitions, then Ctrl-C it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "watch", "-o", "json", *args,
        "--address", address_of(daemon),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(HANG_GUARD):
            while len(seen) < lines:
                line = await proc.stdout.readline()
                assert line, "watch ended early"
                seen.append(json.loads(line))
    finally:
        proc.send_signal(signal.SIGINT)
        await proc.wait()
    return seen


class TestWatchIncarnation:
    async def test_json_lines_carry_the_incarnation(self, daemon: Daemon) -> None:
        """watch -o json prints each transition's incarnation; INCARNATION:SEQ resumes after SEQ."""
        assert daemon.api is not None
        incarnation = daemon.api.transitions.incarnation
        everything = await watch_json(daemon, "--since", "0", lines=2)
        assert [(t["sequence"], t["incarnation"]) for t in everything] == [
            (1, incarnation),
            (2, incarnation),
        ]
        assert list(everything[0])[:3] == ["sequence", "incarnation", "time"]
        resumed = await watch_json(daemon, "--since", f"{incarnation}:1", lines=1)
        assert resumed == everything[1:]

    async def test_another_incarnation_is_out_of_range_exit_1(self, daemon: Daemon) -> None:
        """Resuming from another process's sequence fails loudly (exit 1), never replays."""
        assert daemon.api is not None
        this = daemon.api.transitions.incarnation
        result = await run_cli(
            "watch", "--since", "0ld0ld0ld0ld0ld0:1", "--address", address_of(daemon)
        )
        assert result.returncode == 1
        assert result.stderr.startswith(
            "cri-prober: OUT_OF_RANGE: sequence 1 belongs to incarnation 0ld0ld0ld0ld0ld0; "
            f"this cri-prober is {this}, started at "
        ), result.stderr
        # The header row only: no transition of this process was passed off as the old one's.
        lines = result.stdout.splitlines()
        assert len(lines) == 1, result.stdout
        assert lines[0].startswith("TIME")


class TestPsFilters:
    async def test_a_backtracking_filter_answers_at_once(self, daemon: Daemon) -> None:
        """The finding's filter against a 49-character pod name: answered at once, which is
        shown without a clock. A backtracking engine would take months on that name, so an
        answer at all (within the call's own 20 s deadline, a guard) means linear time."""
        assert len(VICTIM_POD) == 49
        result = await run_cli(
            "ps", "--pod", CATASTROPHIC, "-o", "json", "-t", "20", "--address", address_of(daemon)
        )
        assert result.returncode == 0, result.stderr
        pods = [c["podName"] for c in json.loads(result.stdout)["containers"]]
        assert pods == ["cache.svc"]

    async def test_syntax_re2_lacks_is_reported(self, daemon: Daemon) -> None:
        """A backreference is INVALID_ARGUMENT (exit 1), saying filters are RE2 like crictl's."""
        result = await run_cli("ps", "--pod", r"(web)-\1", "--address", address_of(daemon))
        assert result.returncode == 1
        assert "INVALID_ARGUMENT: filter.pod: invalid regular expression" in result.stderr
        assert "RE2 syntax, like crictl" in result.stderr
