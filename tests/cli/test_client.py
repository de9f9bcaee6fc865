"""Client commands where no daemon or runtime is needed: errors, exit statuses, formatting."""

from __future__ import annotations

from pathlib import Path

import pytest

from cri_prober.cli.client import human_duration
from tests.serving import run_cli


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
