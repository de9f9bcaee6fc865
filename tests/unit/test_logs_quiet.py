"""serve's logging setup keeps libraries' noise out: grpc.aio's per-call debug line (issue 23)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

import grpc
import pytest

from cri_prober import logs as logs_config

GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name} {record.getMessage()}")


@pytest.fixture(name="kept")
def _kept() -> Iterator[_Keep]:
    """Every stdlib record at DEBUG, the loggers' levels put back afterwards."""
    names = ["", GRPC_CORE_LOGGER, *logs_config.CHATTY_LIBRARIES]
    saved = {name: logging.getLogger(name).level for name in names}
    handler = _Keep()
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def _grpc_call_on_a_new_loop() -> None:
    """One grpc.aio call on a loop of its own (grpc logs loading each loop it meets)."""

    async def call() -> None:
        async with grpc.aio.insecure_channel("unix:///nonexistent/cri-prober-test.sock") as ch:
            with contextlib.suppress(grpc.aio.AioRpcError):
                call = ch.unary_unary(
                    "/x.Y/Z", request_serializer=bytes, response_deserializer=bytes
                )
                await call(b"", timeout=0.01)

    thread = threading.Thread(target=asyncio.run, args=(call(),))
    thread.start()
    thread.join(30)


def test_grpc_core_debug_line_is_quiet_even_at_debug(kept: _Keep) -> None:
    """At --log-level debug, grpc's "[_cygrpc] Loaded running loop" was 90 % of the lines."""
    logging.getLogger(GRPC_CORE_LOGGER).setLevel(logging.NOTSET)
    _grpc_call_on_a_new_loop()
    # Control: the line comes from this logger, so quieting it is what counts.
    assert any(m.startswith(GRPC_CORE_LOGGER) and "Loaded running loop" in m for m in kept.messages)
    kept.messages.clear()
    logs_config.quiet_chatty_libraries(logging.DEBUG)
    _grpc_call_on_a_new_loop()
    assert [m for m in kept.messages if m.startswith(GRPC_CORE_LOGGER)] == []
    assert not logging.getLogger(GRPC_CORE_LOGGER).isEnabledFor(logging.INFO)
    assert logging.getLogger(GRPC_CORE_LOGGER).isEnabledFor(logging.WARNING)
    # The HTTP libraries still follow serve's level at DEBUG.
    assert logging.getLogger("httpx2").isEnabledFor(logging.DEBUG)


def test_grpc_core_follows_a_level_above_warning(kept: _Keep) -> None:
    logs_config.quiet_chatty_libraries(logging.ERROR)
    assert logging.getLogger(GRPC_CORE_LOGGER).getEffectiveLevel() == logging.ERROR
