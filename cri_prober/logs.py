"""structlog configuration: JSON lines for machines, a console renderer for people.

Called once by the CLI. Records from the standard library (grpc, asyncio) go through the same
processors, so every line cri-prober writes has one format, and all of them get what is bound in
structlog's context variables (a pod source's ``source``, an API call's ``rpc`` and ``target``).
"""

from __future__ import annotations

import logging
import sys
from typing import Final, Literal

import structlog

from cri_prober.text import sanitize

LogFormat = Literal["json", "console"]

# Libraries that log every request at INFO (httpx2: "HTTP Request: GET .../pods 200 OK", one line
# per poll, 43,000 a day): their own lines start at WARNING unless serve runs at DEBUG. What
# cri-prober has to say about a source it says itself (pod_source_failed, rate-limited).
CHATTY_LIBRARIES = ("httpx", "httpx2", "httpcore", "httpcore2")
# Libraries whose DEBUG lines say nothing about cri-prober's work: kept at WARNING even when serve
# runs at DEBUG. grpc.aio's Cython core logs "[_cygrpc] Loaded running loop: id(loop)=..." on
# every call it starts (issue 23: 90 % of the lines at --log-level debug); its warnings and
# errors still show.
DEBUG_NOISE_LIBRARIES = ("grpc._cython.cygrpc",)


# The same problem (a source's read error, one pod's validation error, a probe that cannot run)
# is logged again at most this often while it lasts; a change of text is logged at once.
REPEAT_LOG_SECONDS: Final = 300.0

# A problem's text as last logged, and when (any monotonic clock).
Logged = tuple[str, float]


def is_repeat(last: Logged | None, text: str, now: float) -> bool:
    """Whether ``text`` at ``now`` repeats ``last`` within REPEAT_LOG_SECONDS: then it is not
    logged again (the rate limit of every repeating problem cri-prober reports)."""
    return last is not None and last[0] == text and now - last[1] < REPEAT_LOG_SECONDS


def shown_for_console(
    _logger: object, _name: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """The console renderer's input with every string sanitized (`cri_prober.text`): it prints
    strings as they are, and a log line may quote a pod's name or a probe's output. Other values
    it shows with repr, which escapes control characters itself; the JSON renderer escapes
    them too."""
    return {
        sanitize(str(key)): sanitize(value) if isinstance(value, str) else value
        for key, value in event_dict.items()
    }


def default_format() -> LogFormat:
    """JSON when stderr is not a terminal (a service, a pipe), console otherwise."""
    return "console" if sys.stderr.isatty() else "json"


def configure(*, log_format: LogFormat | None = None, level: str = "info") -> None:
    """Send structlog and stdlib logging to stderr in one format at one level."""
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}")
    fmt = log_format or default_format()
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    rendering: list[structlog.typing.Processor] = (
        [structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [shown_for_console, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            *rendering,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric_level)
    quiet_chatty_libraries(numeric_level)
    # asyncio warns about slow callbacks at DEBUG; grpc's Python logger is quiet unless asked.
    logging.captureWarnings(True)


def quiet_chatty_libraries(level: int) -> None:
    """Set CHATTY_LIBRARIES' loggers to WARNING, or to ``level`` when that is DEBUG or above
    WARNING; DEBUG_NOISE_LIBRARIES' to WARNING or ``level`` when above it, even at DEBUG."""
    library_level = level if level <= logging.DEBUG else max(level, logging.WARNING)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(library_level)
    for name in DEBUG_NOISE_LIBRARIES:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
