"""The process's file-descriptor limit: raised at start, and how close to it we are.

Every tcp, http and gRPC probe needs a descriptor while it runs; when none is left it fails with
"too many open files", which says nothing about the container. Two defences live on top of this
module: ``serve`` raises its soft ``RLIMIT_NOFILE`` to the hard limit at start (systemd, Docker
and containerd hand services a soft limit of 1,024 and a much higher hard one, which any process
may raise its soft limit to without privileges), and the metrics server stops taking connections
while the process is within a reserve of its limit (``serving/metrics_http.py``), so a flood of its
port cannot use the descriptors probes need.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

FD_DIR = "/proc/self/fd"
# Where the hard limit is unlimited (not on Linux, whose ceiling is fs.nr_open, but possible
# elsewhere) the soft limit is raised this far; more is never needed by a prober.
UNLIMITED_TARGET = 1 << 20


@dataclass(frozen=True, slots=True)
class NofileLimit:
    """The soft limit before and after ``raise_nofile_limit``, and the hard limit."""

    before: int
    soft: int
    hard: int


def soft_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` now; None when it is unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_fds() -> int | None:
    """Descriptors this process has open now; None where ``/proc/self/fd`` cannot be read."""
    try:
        # The listing opens one descriptor of its own, which it counts too: the same +1 is
        # there every time, so callers compare like with like and err on the safe side.
        return len(os.listdir(FD_DIR))
    except OSError:
        return None


def raise_nofile_limit() -> NofileLimit:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, and log what it is now.

    Never fails the start: a limit that cannot be raised is logged and kept.
    """
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    soft = before
    if before != resource.RLIM_INFINITY and before < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("nofile_limit_not_raised", soft=before, hard=hard, error=str(exc))
            return NofileLimit(before, before, hard)
    log.info("nofile_limit", soft=soft, hard=hard, raised_from=before if soft != before else None)
    return NofileLimit(before, soft, hard)


__all__ = ["NofileLimit", "open_fds", "raise_nofile_limit", "soft_limit"]
