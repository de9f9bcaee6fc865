"""The API server source's client plumbing: the lightkube client config, a bounded token-file
auth, bounded reads of a watch stream's lines and of an error answer, and the texts of failed
requests (``apiserver.py`` holds the list/watch protocol itself)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx2
from lightkube import KubeConfig, SingleConfig
from lightkube.config.models import User

from cri_prober.errors import ConfigError
from cri_prober.files import UnsafeFile, describe_size, read_regular_file
from cri_prober.podspecs.decode import PodListError, WatchEvent, decode_watch_event

__all__ = [
    "BODY_CHARS",
    "INITIAL_EVENTS_END",
    "ConfigArg",
    "LineTooLong",
    "ReadFailure",
    "TokenFileAuth",
    "decode_event",
    "describe_status",
    "ends_initial_events",
    "http_failure",
    "load_config",
    "parse_status",
    "read_head",
    "read_lines",
    "status_text",
    "version_unavailable",
]

# How much of an error body a failure message quotes.
BODY_CHARS: Final = 512
# The annotation of the bookmark that ends a streaming list's initial events.
INITIAL_EVENTS_END: Final = "k8s.io/initial-events-end"

ConfigArg = KubeConfig | SingleConfig | None


class ReadFailure(Exception):
    """A list or watch failed; the message is what ``failed`` logs.

    ``status`` is the HTTP status when the server answered one; ``brief`` the message without
    the advice for the operator (a 403 while the API server starts is no RBAC problem yet).
    """

    def __init__(self, message: str, *, status: int | None = None, brief: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.brief = brief or message


class LineTooLong(ReadFailure):
    """A watch line longer than any event can be."""


# -- config -----------------------------------------------------------------------------------


def load_config(kubeconfig: Path | None, config: ConfigArg) -> SingleConfig:
    """The client config: ``config``, else the ``kubeconfig`` file, else lightkube's from_env.

    Raises:
        ConfigError: no usable config, or it selects no context.
    """
    if config is not None:
        where = "the given config"
    elif kubeconfig is not None:
        where = f"kubeconfig {kubeconfig}"
    else:
        env = os.environ.get("KUBECONFIG")
        where = "the in-cluster service account, " + (
            f"or KUBECONFIG={env}" if env else "or KUBECONFIG / ~/.kube/config (both unset)"
        )
    try:
        if config is None:
            if kubeconfig is not None:
                config = KubeConfig.from_file(kubeconfig)
            else:
                config = KubeConfig.from_env()
        single = config.get() if isinstance(config, KubeConfig) else config
    except Exception as exc:  # lightkube's ConfigError, KeyError, YAML and msgspec errors
        detail = str(exc) or type(exc).__name__
        raise ConfigError(
            f"--probes-from apiserver: no usable Kubernetes client config from {where}: {detail}"
        ) from exc
    if single is None:
        raise ConfigError(f"--probes-from apiserver: {where} selects no context")
    if single.user is None:  # a context without a user (kubectl proxy): no credentials
        single = single._replace(user=User())
    return single


class TokenFileAuth(httpx2.Auth):
    """A bearer token read from a file, and read again after a 401 (a rotated service-account
    token), as lightkube's own does, but only from a regular file of at most 64 KiB, and (for the
    async client) in a worker thread, so that a slow file never holds up the event loop."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._bearer: str | None = None

    def _read(self) -> str:
        try:
            data = read_regular_file(self._path, max_bytes=64 * 1024, what="token file")
        except UnsafeFile as exc:
            raise ReadFailure(f"cannot read the token file {self._path}: {exc.reason}") from None
        except OSError as exc:
            raise ReadFailure(
                f"cannot read the token file {self._path}: {exc.strerror or exc}"
            ) from None
        return f"Bearer {data.decode('utf-8', 'replace').strip()}"

    def auth_flow(
        self, request: httpx2.Request
    ) -> Generator[httpx2.Request, httpx2.Response, None]:
        if self._bearer is None:
            self._bearer = self._read()
        request.headers["Authorization"] = self._bearer
        response = yield request
        if response.status_code == 401:
            self._bearer = self._read()
            request.headers["Authorization"] = self._bearer
            yield request

    async def async_auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        """``auth_flow`` with the reads in a worker thread (httpx2's default runs the sync flow,
        and so the file read, on the event loop)."""
        if self._bearer is None:
            self._bearer = await asyncio.to_thread(self._read)
        request.headers["Authorization"] = self._bearer
        response = yield request
        if response.status_code == 401:
            self._bearer = await asyncio.to_thread(self._read)
            request.headers["Authorization"] = self._bearer
            yield request


# -- reading ----------------------------------------------------------------------------------


async def read_lines(response: httpx2.Response, limit: int) -> AsyncIterator[bytes]:
    """The response's lines (without the newline), none longer than ``limit`` bytes.

    httpx2's ``aiter_lines`` keeps a line growing for as long as the server sends no newline;
    here the line is refused as soon as it passes the limit, and the connection is dropped.
    """
    pending = bytearray()
    async for chunk in response.aiter_bytes():
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if len(pending) + end - start > limit:
                raise LineTooLong(_too_long(limit))
            if pending:
                pending += chunk[start:end]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        pending += chunk[start:]
        if len(pending) > limit:
            raise LineTooLong(_too_long(limit))
    if pending:
        yield bytes(pending)


def _too_long(limit: int) -> str:
    return (
        f"watch pods: a line of the stream is longer than {describe_size(limit)}, which no event "
        "can be: dropped the connection"
    )


async def read_head(response: httpx2.Response) -> bytes:
    """The start of an error answer's body (the rest is not read)."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= BODY_CHARS * 8:
            break
    return bytes(data[: BODY_CHARS * 8])


# -- error messages ---------------------------------------------------------------------------


def parse_status(body: bytes) -> Mapping[str, Any]:
    """A meta/v1 Status from an error body, or {} if it is none."""
    try:
        status = json.loads(body)
    except ValueError:
        return {}
    return status if isinstance(status, Mapping) else {}


def describe_status(code: int, status: Mapping[str, Any]) -> str:
    reason = status.get("reason")
    message = status.get("message")
    text = f"{code}" + (f" {reason}" if isinstance(reason, str) and reason else "")
    if isinstance(message, str) and message:
        text += f": {message}"
    return text


def status_text(code: int, body: bytes) -> str:
    status = parse_status(body)
    if status:
        return describe_status(code, status)
    text = body[:BODY_CHARS].decode("utf-8", "replace").strip()
    return f"{code}: {text}" if text else f"{code}"


def http_failure(verb: str, code: int, body: bytes) -> ReadFailure:
    """A failed list or watch, with what the operator should do about it where that is clear."""
    detail = status_text(code, body)
    if code == 401:
        return ReadFailure(
            f"{verb} pods: 401 Unauthorized: the API server rejected the credentials "
            f"(an expired or revoked token, or the wrong cluster?): {detail}",
            status=code,
        )
    if code == 403 and 'User "system:anonymous"' in detail:
        # With anonymous auth on (the default), a request without credentials is a 403.
        return ReadFailure(
            f"{verb} pods: 403 Forbidden: the API server took the request as anonymous: no "
            f"credentials reached it (no token or client certificate in the config?): {detail}",
            status=code,
            brief=f"{verb} pods: {detail}",
        )
    if code == 403:
        return ReadFailure(
            f"{verb} pods: 403 Forbidden: the service account needs get/list/watch on pods "
            f"(a ClusterRole bound to it): {detail}",
            status=code,
            brief=f"{verb} pods: {detail}",
        )
    return ReadFailure(f"{verb} pods: HTTP {detail}", status=code)


# -- watch lines and list answers -----------------------------------------------------------


def decode_event(line: bytes, *, statuses: bool = False) -> WatchEvent:
    """One watch line, or the failure that says what is wrong with it (``statuses``: keep the
    containers' ready and started, for serve --mirror)."""
    try:
        return decode_watch_event(line, statuses=statuses)
    except PodListError as exc:
        what = "not JSON" if exc.malformed else "not a watch event of pods"
        raise ReadFailure(f"watch pods: a line is {what}: {exc}: {bytes(line[:200])!r}") from None


def ends_initial_events(line: bytes) -> bool:
    """A bookmark annotated k8s.io/initial-events-end: "true" (a bookmark line is small)."""
    try:
        obj = json.loads(line).get("object") or {}
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(annotations, dict) and annotations.get(INITIAL_EVENTS_END) == "true"


def version_unavailable(code: int, body: bytes) -> bool:
    """A list's resourceVersion the cache cannot serve: 410 Expired/Gone, or 504 with the
    cause ResourceVersionTooLarge (the cache did not reach it within 3 s)."""
    if code == 410:
        return True
    status = parse_status(body)
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, Mapping) else None
    if isinstance(causes, list) and any(
        isinstance(cause, Mapping) and cause.get("reason") == "ResourceVersionTooLarge"
        for cause in causes
    ):
        return True
    message = status.get("message")
    return code == 504 and isinstance(message, str) and "Too large resource version" in message
