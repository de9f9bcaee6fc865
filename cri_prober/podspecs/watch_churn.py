"""Watches that the API server ends right after opening them: paced, and reported in one
rate-limited line.

client-go's reflector reopens a watch that ended without an error at once, however short it
was (it backs off only after one that delivered nothing within a second). A server, or a proxy
in between, that ends every stream right after its first event would then get a new watch from
every node about 120 times a second, with nothing said at info. Here, from the third such watch
in a row, the next one opens no sooner than ``CHURN_PACE`` after the last one did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import structlog

from cri_prober.logs import Logged, is_repeat

# A watch the server ended sooner than this after it opened is a short one (the reflector's
# bound for a "very short watch").
SHORT_WATCH: Final = 1.0
# Short watches in a row that make churn: one or two are a server's ordinary timeouts.
CHURN_AFTER: Final = 3
# While watches churn, one opens at most this often (seconds).
CHURN_PACE: Final = 1.0

_CHURN: Final = "churn"


class WatchChurn:
    """Follows how long each watch lasted; says how long to wait before the next one, and logs
    ``pod_watch_churn`` (warning) when watches churn, then at most every 5 minutes while it
    lasts (``REPEAT_LOG_SECONDS``)."""

    def __init__(
        self,
        clock: Callable[[], float],
        logger: structlog.typing.FilteringBoundLogger,
        *,
        pace: float = CHURN_PACE,
    ) -> None:
        self._clock = clock
        self._logger = logger
        self._pace = pace
        self._short = 0  # short watches in a row
        self._paced = 0  # reopens delayed since the last line
        self._logged: Logged | None = None

    def ended(self, opened_at: float) -> float:
        """A watch opened at ``opened_at`` (on the clock) ended, without an error or with a
        broken stream: the seconds to wait before the next one opens (0: at once)."""
        now = self._clock()
        lasted = max(0.0, now - opened_at)
        if lasted >= SHORT_WATCH:
            self._short = 0
            return 0.0
        self._short += 1
        if self._short < CHURN_AFTER:
            return 0.0
        self._paced += 1
        if not is_repeat(self._logged, _CHURN, now):
            self._logger.warning(
                "pod_watch_churn",
                watches=self._short,
                paced=self._paced,
                pace=self._pace,
                detail=f"the API server ended {self._short} watches in a row within "
                f"{SHORT_WATCH:g}s of opening them: opening one at most every {self._pace:g}s",
            )
            self._logged = (_CHURN, now)
            self._paced = 0
        return max(0.0, self._pace - lasted)

    def reset(self) -> None:
        """The watch ended otherwise (410 Gone, a refused streaming list): no churn."""
        self._short = 0


__all__ = ["CHURN_AFTER", "CHURN_PACE", "SHORT_WATCH", "WatchChurn"]
