"""The descriptor limit serve raises at start, and the count the metrics server's reserve uses."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest
import structlog

from cri_prober import fdlimit


@pytest.fixture(name="restore_nofile")
def _restore_nofile() -> Iterator[tuple[int, int]]:
    """The limit before the test, put back after it (lowering the soft limit is reversible)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_raises_the_soft_limit_to_the_hard_one(restore_nofile: tuple[int, int]) -> None:
    """A service's usual 1,024 soft limit goes up to its hard limit, and the start says so."""
    _soft, hard = restore_nofile
    open_now = fdlimit.open_fds()
    assert open_now is not None
    low = max(open_now + 16, min(1024, hard))
    if hard == resource.RLIM_INFINITY or low >= hard:
        pytest.skip(f"needs a finite hard limit above {low}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    with structlog.testing.capture_logs() as logs:
        limit = fdlimit.raise_nofile_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert (limit.before, limit.soft, limit.hard) == (low, hard, hard)
    assert [(e["event"], e["soft"], e["raised_from"]) for e in logs] == [
        ("nofile_limit", hard, low)
    ]
    assert fdlimit.soft_limit() == hard


def test_a_limit_already_at_the_hard_one_is_kept(restore_nofile: tuple[int, int]) -> None:
    _soft, hard = restore_nofile
    if hard == resource.RLIM_INFINITY:
        pytest.skip("needs a finite hard limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with structlog.testing.capture_logs() as logs:
        limit = fdlimit.raise_nofile_limit()
    assert (limit.before, limit.soft) == (hard, hard)
    assert logs[0]["raised_from"] is None


def test_a_refused_raise_is_logged_and_does_not_fail_the_start(
    restore_nofile: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _soft, hard = restore_nofile
    low = (fdlimit.open_fds() or 0) + 16
    if hard != resource.RLIM_INFINITY and low >= hard:
        pytest.skip(f"needs a hard limit above {low}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    def refuse(_which: int, _limits: tuple[int, int]) -> None:
        raise ValueError("not allowed to raise the hard limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    with structlog.testing.capture_logs() as logs:
        limit = fdlimit.raise_nofile_limit()
    assert (limit.before, limit.soft) == (low, low)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low
    assert logs[0]["event"] == "nofile_limit_not_raised"
    assert logs[0]["log_level"] == "warning"


def test_open_fds_counts_this_process() -> None:
    before = fdlimit.open_fds()
    assert before is not None
    read_end, write_end = os.pipe()
    try:
        assert fdlimit.open_fds() == before + 2
    finally:
        os.close(read_end)
        os.close(write_end)
