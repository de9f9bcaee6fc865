"""Per-call log context for the API server: every line logged while a call is served carries
the call's method (``rpc``) and, when the request names a container, what it named (``target``).

A server interceptor binds them through structlog's context variables around each handler, so
neither the servicers nor what they call pass them by hand.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeAlias

import grpc
import structlog

from cri_prober.discovery.naming import clip

# A target is at most 512 characters when it names anything (docs/interface.md); a request may
# carry far more, which no log line repeats.
MAX_TARGET_BYTES: Final = 256

Fields = Callable[[Any], dict[str, str]]
# A string: grpc.RpcMethodHandler is generic in its type stubs only.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class LogContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds ``rpc`` (the full method, ``/criprober.v1.CriProber/RunProbe``) and ``target`` for
    the length of each call, streams included; the binding ends with the call."""

    def __init__(self) -> None:
        # The wrapped handler per method, built once (only methods the server knows get here).
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrap_handler(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def request_fields(method: str, request: object) -> dict[str, str]:
    """What a call's lines carry: its method, and the container its request names, if any."""
    fields = {"rpc": method}
    target = getattr(request, "target", None)
    if isinstance(target, str) and target:
        fields["target"] = clip(target, MAX_TARGET_BYTES)
    return fields


def _wrap_handler(handler: Handler, method: str) -> Handler:
    def unary(request: object) -> dict[str, str]:
        return request_fields(method, request)

    def streamed(_requests: object) -> dict[str, str]:
        return {"rpc": method}

    codecs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_bound(handler.unary_unary, unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_bound(handler.unary_stream, unary), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _bound(handler.stream_unary, streamed), **codecs
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _bound(handler.stream_stream, streamed), **codecs
        )
    return handler  # pragma: no cover - a handler has one of the four


def _bound(behavior: Callable[..., Any], fields: Fields) -> Callable[..., Any]:
    """``behavior`` with ``fields(request)`` bound while it runs, of the same kind as it:
    grpc.aio tells a coroutine handler (which writes through its context) from an async
    generator by the function itself."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            with structlog.contextvars.bound_contextvars(**fields(request)):
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request: Any, context: Any) -> Any:
            with structlog.contextvars.bound_contextvars(**fields(request)):
                return await behavior(request, context)

        return call
    return behavior  # a synchronous handler runs in a thread; the API has none


__all__ = ["MAX_TARGET_BYTES", "LogContextInterceptor", "request_fields"]
