"""Client fixtures for the modules that run a real `serve` (each module defines ``serve``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2_grpc
from tests.support.serve import Serve


@pytest.fixture(name="channel")
async def _channel(serve: Serve) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(serve.target) as channel:
        yield channel


@pytest.fixture(name="health")
def _health(channel: grpc.aio.Channel) -> Any:
    return health_pb2_grpc.HealthStub(channel)


@pytest.fixture(name="api")
def _api(channel: grpc.aio.Channel) -> query_pb2_grpc.CriProberAsyncStub:
    return query_pb2_grpc.CriProberStub(channel)
