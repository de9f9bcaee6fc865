"""An in-memory stand-in for the gRPC channel `CriClient` speaks over, serving a `FakeRuntime`
in-process: unit tests whose runtime is only a backdrop run the real client (retries, deadlines,
exec slots, conversion) without a socket or a gRPC server.

It implements just the part of ``grpc.aio.Channel`` the client and the generated stub use:
``unary_unary``, ``unary_stream`` and ``close``. Every call still goes through bytes (the
client's serializer, then the servicer's own request deserializer, and back), runs the servicer
method in a task of its own as a server would, and ends the way grpc.aio ends it: aborts,
deadlines and unexpected servicer errors as ``grpc.aio.AioRpcError`` with a real server's code
and details, a call cut by ``close()`` as ``asyncio.CancelledError``, a call on a closed channel
as ``grpc.aio.UsageError``. Wire tests (framing, the socket, connection loss) keep
``fake_runtime.FakeRuntimeServer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any, NoReturn, cast

import grpc

from cri_prober._gen.runtime.v1 import api_pb2_grpc
from cri_prober.runtime.client import MAX_RECEIVE_MESSAGE_BYTES, CriClient

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]

# A stream's end of messages, as the server task hands them to the reader.
_END = object()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error grpc.aio raises for a call that ended with ``code`` (as measured against
    FakeRuntimeServer: empty metadata, debug string ``CODE:details``)."""
    return grpc.aio.AioRpcError(
        code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=details,
        debug_error_string=f"{code.name}:{details}",
    )


class _Aborted(grpc.aio.AbortError):
    """Raised by `ServicerContext.abort`, as grpc.aio raises its ``AbortError`` there."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ServicerContext:
    """The servicer's side of one call: what ``grpc.aio.ServicerContext`` offers a handler that
    FakeRuntime and its test subclasses use."""

    def __init__(self, deadline: float | None, metadata: Iterable[tuple[str, str]]) -> None:
        self._deadline = deadline
        self._metadata = tuple(metadata)
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._cancelled = False

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()
    ) -> NoReturn:
        """End the call with ``code`` and ``details`` (raises, as grpc.aio's does)."""
        raise _Aborted(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status the call ends with once the handler returns."""
        self._code = code

    def set_details(self, details: str) -> None:
        """The details the call ends with once the handler returns."""
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline, None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def cancelled(self) -> bool:
        """Whether the client cancelled the call or its deadline passed."""
        return self._cancelled


class _HandlerSink:
    """Collects what the generated ``add_*Servicer_to_server`` registers, in place of a server."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come again, by method name, below

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler


class _Call:
    """One call: the servicer runs in a task of its own from the moment the call is made (as a
    server's handler would), the caller reads its outcome."""

    def __init__(
        self,
        channel: MemoryChannel,
        method: str,
        handler: grpc.RpcMethodHandler[Any, Any],
        request: bytes,
        timeout: float | None,
        metadata: Iterable[tuple[str, str]],
        deserializer: Deserializer | None,
    ) -> None:
        self._channel = channel
        self._deserialize = deserializer or (lambda data: data)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._context = ServicerContext(deadline, metadata or ())
        # Messages (response bytes) and, last, _END; a unary call puts one message.
        self._messages: asyncio.Queue[object] = asyncio.Queue()
        self._status: tuple[grpc.StatusCode, str] | None = None
        self._locally_cancelled = False
        self._task = loop.create_task(
            self._serve(handler, request, timeout), name=f"memory-cri {method}"
        )
        channel._calls.add(self)
        self._task.add_done_callback(lambda _: channel._calls.discard(self))

    async def _serve(
        self, handler: grpc.RpcMethodHandler[Any, Any], request: bytes, timeout: float | None
    ) -> None:
        code, details = grpc.StatusCode.OK, ""
        if timeout is not None and timeout <= 0:
            # grpc.aio fails a call whose deadline already passed without sending it.
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return
        try:
            async with asyncio.timeout(timeout) as deadline:
                try:
                    await self._run(handler, request)
                except _Aborted as exc:
                    code, details = exc.code, exc.details
                except Exception as exc:  # what grpc.aio's server answers for a handler's bug
                    code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}"
                else:
                    if self._context.code() not in (None, grpc.StatusCode.OK):
                        code = cast(grpc.StatusCode, self._context.code())
                        details = self._context.details()
        except TimeoutError:
            if not deadline.expired():
                raise  # pragma: no cover - the handler's own TimeoutErrors are caught above
            self._context._cancelled = True
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except asyncio.CancelledError:
            self._context._cancelled = True
            raise
        self._finish(code, details)

    async def _run(self, handler: grpc.RpcMethodHandler[Any, Any], request: bytes) -> None:
        # Typed as sync handlers taking grpc's context; grpc.aio's are coroutines and async
        # generators, and they get this module's context.
        unary: Any = handler.unary_unary
        stream: Any = handler.unary_stream
        assert handler.request_deserializer is not None
        serialize = handler.response_serializer
        assert serialize is not None
        message = handler.request_deserializer(request)
        if unary is not None:
            response = serialize(await unary(message, self._context))
            # A status set on the context turns the answer into that error.
            if self._context.code() in (None, grpc.StatusCode.OK):
                self._send(response)
        else:
            assert stream is not None
            async for response in stream(message, self._context):
                self._send(serialize(response))

    def _send(self, data: bytes) -> None:
        limit = self._channel.max_receive_message_length
        if len(data) > limit:
            # The client refuses it; the call ends there (grpc's own words for it).
            raise _Aborted(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Stream removed (CLIENT: Received message larger than max ({len(data)} vs. "
                f"{limit}))",
            )
        self._messages.put_nowait(data)

    def _finish(self, code: grpc.StatusCode, details: str) -> None:
        self._status = (code, details)
        self._messages.put_nowait(_END)

    def cancel(self) -> bool:
        """Cancel the call (the servicer's task with it); False if it had already ended."""
        if self._status is not None or self._locally_cancelled:
            return False
        self._locally_cancelled = True
        self._task.cancel()
        self._messages.put_nowait(_END)
        return True

    def cancelled(self) -> bool:
        return self._locally_cancelled

    def done(self) -> bool:
        return self._task.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(call)`` once the call has ended (answered, failed or cancelled), as
        grpc.aio's calls do."""
        self._task.add_done_callback(lambda _: callback(self))

    async def _next(self) -> Any:
        """The next message, or the call's end: StopAsyncIteration for OK, else its error."""
        try:
            item = await self._messages.get()
        except asyncio.CancelledError:
            # The caller was cancelled: so is the call, and its servicer ends before we do.
            self.cancel()
            await asyncio.wait([self._task])
            raise
        if item is not _END:
            return self._deserialize(cast(bytes, item))
        if self._locally_cancelled:
            await asyncio.wait([self._task])
            raise asyncio.CancelledError()
        assert self._status is not None
        code, details = self._status
        if code is not grpc.StatusCode.OK:
            raise _rpc_error(code, details)
        raise StopAsyncIteration


class UnaryUnaryCall(_Call):
    """A unary call: await it for the response."""

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        try:
            return await self._next()
        except StopAsyncIteration:  # pragma: no cover - a servicer always answers or fails
            raise _rpc_error(grpc.StatusCode.INTERNAL, "no response") from None


class UnaryStreamCall(_Call):
    """A server-streaming call: iterate it for the responses."""

    # An iterator of its own rather than an async generator: one left unfinished by a reader
    # that stopped would be closed later by a task of the loop's.
    def __aiter__(self) -> UnaryStreamCall:
        return self

    async def __anext__(self) -> Any:
        return await self._next()


class _MultiCallable:
    """What ``channel.unary_unary(...)``/``unary_stream(...)`` return: makes calls of a method."""

    def __init__(
        self,
        channel: MemoryChannel,
        method: str,
        call_type: type[_Call],
        serializer: Serializer | None,
        deserializer: Deserializer | None,
    ) -> None:
        self._channel = channel
        self._method = method
        self._call_type = call_type
        self._serialize = serializer or (lambda message: cast(bytes, message))
        self._deserializer = deserializer

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Iterable[tuple[str, str]] | None = None,
        **_ignored: Any,  # credentials, wait_for_ready, compression: nothing to do in memory
    ) -> Any:
        channel = self._channel
        if channel.closed:
            raise grpc.aio.UsageError("Channel is closed.")
        handler = channel.handlers.get(self._method)
        if handler is None:
            raise AssertionError(f"{self._method}: no such method on the servicer")
        return self._call_type(
            channel,
            self._method,
            handler,
            self._serialize(request),
            timeout,
            metadata or (),
            self._deserializer,
        )


class MemoryChannel:
    """The in-memory channel to one servicer (``FakeRuntime``); see the module docstring."""

    def __init__(
        self,
        servicer: api_pb2_grpc.RuntimeServiceServicer,
        *,
        max_receive_message_length: int = MAX_RECEIVE_MESSAGE_BYTES,
    ) -> None:
        sink = _HandlerSink()
        # The generated code registers its handlers on a server; the sink takes them instead.
        api_pb2_grpc.add_RuntimeServiceServicer_to_server(servicer, cast(grpc.aio.Server, sink))
        self.handlers = sink.handlers
        # CriClient.connect's limit, so an oversized reply fails here as it does on the wire.
        self.max_receive_message_length = max_receive_message_length
        self.closed = False
        self._calls: set[_Call] = set()

    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> Callable[..., UnaryUnaryCall]:
        return _MultiCallable(
            self, method, UnaryUnaryCall, request_serializer, response_deserializer
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer | None = None,
        response_deserializer: Deserializer | None = None,
        _registered_method: bool | None = False,
    ) -> Callable[..., UnaryStreamCall]:
        return _MultiCallable(
            self, method, UnaryStreamCall, request_serializer, response_deserializer
        )

    @property
    def calls_in_flight(self) -> int:
        """Calls whose servicer has not ended yet."""
        return sum(not call.done() for call in self._calls)

    async def close(self, grace: float | None = None) -> None:
        """Refuse new calls and cancel those in flight, waiting until their servicers ended."""
        if self.closed:
            return
        self.closed = True
        calls = list(self._calls)
        if grace and calls:
            await asyncio.wait([call._task for call in calls], timeout=grace)
        for call in calls:
            call.cancel()
        if calls:
            await asyncio.wait([call._task for call in calls])

    async def __aenter__(self) -> MemoryChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def memory_channel(
    servicer: api_pb2_grpc.RuntimeServiceServicer, **kwargs: Any
) -> grpc.aio.Channel:
    """A `MemoryChannel`, typed as what `CriClient` (or a subclass of it) takes."""
    # It implements only the part of grpc.aio.Channel that CriClient uses: hence the cast.
    return cast(grpc.aio.Channel, MemoryChannel(servicer, **kwargs))


def memory_client(servicer: api_pb2_grpc.RuntimeServiceServicer, **client_kwargs: Any) -> CriClient:
    """A `CriClient` on a `MemoryChannel` to ``servicer``; use it with ``async with``."""
    return CriClient(memory_channel(servicer), **client_kwargs)


__all__ = [
    "MemoryChannel",
    "ServicerContext",
    "UnaryStreamCall",
    "UnaryUnaryCall",
    "memory_channel",
    "memory_client",
]
