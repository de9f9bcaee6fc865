"""``KubeletSource``: the node's pod specs polled from the kubelet's own ``GET /pods`` (a core/v1
PodList), over its authenticated HTTPS port or the read-only HTTP port. Every way a read can fail
becomes one clear ``failed()`` message, and the last good view is kept meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import httpx2
import structlog

from cri_prober.errors import ConfigError
from cri_prober.files import UnsafeFile, describe_size, read_regular_file
from cri_prober.podspecs.decode import MAX_PODS, DecodedPod, PodListError, decode_pod_list
from cri_prober.podspecs.model import PodOrigin
from cri_prober.podspecs.source import PolledSource

__all__ = ["DEFAULT_URL", "MAX_BODY_BYTES", "READ_ONLY_URL", "KubeletSource"]

DEFAULT_URL: Final = "https://127.0.0.1:10250/pods"
READ_ONLY_URL: Final = "http://127.0.0.1:10255/pods"
# A full node (110 pods with big specs and statuses) answers a few MiB; far more is not a kubelet.
# While a poll reads, the body is held whole (decoding keeps only the used fields, a few KB a
# pod), so this is also the most a poll adds to serve's memory.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# The largest token, and the largest certificate, key or CA bundle file, read.
_TOKEN_BYTES: Final = 64 * 1024
_TLS_FILE_BYTES: Final = 1024 * 1024
# How much of an error answer's body a message quotes.
_SNIPPET_CHARS: Final = 200
_ERROR_BODY_BYTES: Final = 4096

# The files a TLS context is built from, by (size, mtime_ns, inode), or None where a stat failed:
# when any of them changes (a rotated client certificate), the client is built anew.
_FileKeys = tuple[tuple[int, int, int] | None, ...]


class _ReadFailed(Exception):
    """One poll failed for a reason the message explains to the operator."""


class KubeletSource(PolledSource):
    """Pod specs from the kubelet's ``/pods``, polled every ``interval`` seconds.

    Parameters:
        url: the kubelet's ``/pods``; ``READ_ONLY_URL`` for the unauthenticated port.
        name: the source's name in logs, ``ps`` and health.
        interval: seconds between the end of one poll and the start of the next.
        timeout: seconds one whole poll (connect, request, and the full body) may take.
        token_file: a bearer token, read again on every poll (projected tokens rotate).
        client_cert, client_key: a client certificate (the key may be inside ``client_cert``).
        ca_file: the CA that signed the kubelet's serving certificate, instead of the system's.
        insecure_skip_tls_verify: accept any serving certificate.
        stale_after: seconds without a good read before the view is stale; default
            ``max(10, 5 * interval)``.
        max_body_bytes: the largest answer read; a longer one fails the poll.
        max_pods: the most pods a listing may hold; more fails the poll.
        keep_statuses: keep each container's ready and started from the pod status
            (``PodSpec.statuses``, for serve --mirror).
    """

    origin = PodOrigin.API

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        name: str = "kubelet",
        interval: float = 2.0,
        timeout: float = 5.0,
        token_file: Path | None = None,
        client_cert: Path | None = None,
        client_key: Path | None = None,
        ca_file: Path | None = None,
        insecure_skip_tls_verify: bool = False,
        stale_after: float | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_pods: int = MAX_PODS,
        keep_statuses: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not url.startswith(("https://", "http://")):
            raise ConfigError(f"kubelet URL {url!r}: must start with https:// or http://")
        if interval <= 0 or timeout <= 0:
            raise ConfigError("kubelet source: interval and timeout must be positive")
        if client_key is not None and client_cert is None:
            raise ConfigError("kubelet source: a client key needs its client certificate")
        super().__init__(name, interval=interval, stale_after=stale_after, clock=clock)
        # This module's lines, with the source's name bound (the base class's: ``self.logger``).
        self.own_logger = structlog.get_logger(__name__, source=self.name)
        self.url = url
        self.timeout = timeout
        self.token_file = token_file
        self.client_cert = client_cert
        self.client_key = client_key
        self.ca_file = ca_file
        self.insecure_skip_tls_verify = insecure_skip_tls_verify
        self.max_body_bytes = max_body_bytes
        self.max_pods = max_pods
        # serve --mirror: keep each container's ready/started (PodSpec.statuses).
        self.keep_statuses = keep_statuses
        self._read_bytes = 0  # the size of the body the current poll read
        self._https = url.startswith("https://")
        self._client: httpx2.AsyncClient | None = None
        self._client_files: _FileKeys = ()

    async def poll(self) -> bool:
        """Read ``/pods`` once and take it as the new view; returns whether the view changed.

        A failed read is reported through ``failed()`` and leaves the view as it was. Only
        cancellation propagates.
        """
        self._read_bytes = 0
        try:
            pods = await self._fetch()
            # Parsing the changed pods and building the new view run in a worker thread too:
            # the loop only swaps the view in (bench/podsources.py, bench/tenant_sources.py).
            changed = await self.apply_listing(pods)
        except _ReadFailed as exc:
            self.failed(str(exc))
            return False
        except Exception as exc:  # a bug here must not stop the polling: report it and go on
            self.own_logger.exception("pod_source_bug")
            self.failed(f"unexpected error reading the kubelet at {self.url}: {exc!r}")
            return False
        finally:
            await self.give_back(self._read_bytes)
        self.succeeded()
        return changed

    async def close(self) -> None:
        """Close the HTTP connection."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- one poll -------------------------------------------------------------------------------

    async def _fetch(self) -> list[DecodedPod]:
        return await self._decode(await self._request("application/json"))

    async def _request(self, accept: str) -> bytearray:
        """One GET of the kubelet's URL with the current token and client: its body, or
        ``_ReadFailed`` with one clear line."""
        token, files = await asyncio.to_thread(self._read_local_files)
        client = await self._current_client(files)
        headers = {"Accept": accept}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            # One deadline for the whole exchange: httpx2's timeouts are per operation, so a
            # kubelet trickling its answer would otherwise hold the poll forever.
            async with asyncio.timeout(self.timeout):
                body = await self._get(client, headers)
        except (TimeoutError, httpx2.TimeoutException):
            raise _ReadFailed(
                f"the kubelet at {self.url} did not answer within {self.timeout:g}s"
            ) from None
        except httpx2.HTTPError as exc:
            raise _ReadFailed(self._describe(exc)) from None
        return body

    def _read_local_files(self) -> tuple[str | None, _FileKeys]:
        """The bearer token, and the state of the TLS files (in a worker thread: disk I/O)."""
        token = None
        if self.token_file is not None:
            token = _read_token(self.token_file)
        files: _FileKeys = ()
        if self._https:
            files = tuple(
                _file_key(path) for path in (self.ca_file, self.client_cert, self.client_key)
            )
        return token, files

    async def _current_client(self, files: _FileKeys) -> httpx2.AsyncClient:
        if self._client is not None and files == self._client_files:
            return self._client
        verify: ssl.SSLContext | bool = False  # plain HTTP never uses it: skip loading roots
        if self._https:
            verify = await asyncio.to_thread(self._tls_context)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._client = httpx2.AsyncClient(
            verify=verify,
            timeout=self.timeout,
            # HTTP(S)_PROXY is for the outside world: the kubelet is on this node.
            trust_env=False,
            follow_redirects=False,
            limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self._client_files = files
        return self._client

    def _tls_context(self) -> ssl.SSLContext:
        # Every file is read through files.read_regular_file: a FIFO or device put where one
        # was expected is a failed read at once, not a worker thread blocked for ever.
        if self.ca_file is None:
            context = ssl.create_default_context()  # the system's roots
        else:
            try:  # the CA file alone is trusted
                pem = read_regular_file(self.ca_file, max_bytes=_TLS_FILE_BYTES, what="CA file")
                context = ssl.create_default_context(cadata=pem.decode("latin-1"))
            except (OSError, ssl.SSLError) as exc:
                raise _ReadFailed(
                    f"cannot load the kubelet CA file {self.ca_file}: {_os_reason(exc)}"
                ) from None
        if self.insecure_skip_tls_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert is not None:
            try:
                _load_client_certificate(context, self.client_cert, self.client_key)
            except (OSError, ssl.SSLError) as exc:
                files = str(self.client_cert)
                if self.client_key is not None:
                    files += f" and key {self.client_key}"
                raise _ReadFailed(
                    f"cannot load the client certificate {files}: {_os_reason(exc)} "
                    "(PEM certificate and key expected)"
                ) from None
        return context

    async def _get(self, client: httpx2.AsyncClient, headers: Mapping[str, str]) -> bytearray:
        async with client.stream("GET", self.url, headers=headers) as response:
            if response.status_code != 200:
                raise _ReadFailed(self._status_message(response, await _head(response)))
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                raise _ReadFailed(self._too_large())
            body = bytearray()
            # Decoded bytes are counted, so a compressed answer cannot inflate past the cap.
            async for chunk in response.aiter_bytes():
                body += chunk
                self._read_bytes = len(body)
                if len(body) > self.max_body_bytes:
                    raise _ReadFailed(self._too_large())
            return body  # not copied into bytes: the decoder reads the buffer as it is

    async def _decode(self, body: bytearray) -> list[DecodedPod]:
        """The listing's pods, decoded in a worker thread (only the used fields; the body is
        freed as soon as it is read)."""
        try:
            listing = await asyncio.to_thread(
                decode_pod_list, body, max_pods=self.max_pods, statuses=self.keep_statuses
            )
        except PodListError as exc:
            if exc.malformed:
                raise _ReadFailed(
                    f"the kubelet at {self.url} answered malformed JSON: {_clip(str(exc))}"
                ) from None
            raise _ReadFailed(
                f"the kubelet at {self.url} answered something that is not a usable PodList: "
                f"{_clip(str(exc))}"
            ) from None
        finally:
            # The buffer goes back now, not when the poll's frames are gone (unless a decoder
            # cancelled mid-way still reads it: then it goes with the thread).
            with contextlib.suppress(BufferError):
                del body[:]
        if listing.kind != "PodList":
            raise _ReadFailed(
                f"the kubelet at {self.url} answered kind {json.dumps(listing.kind)[:64]}, "
                "not a PodList"
            )
        return listing.pods

    # -- messages -------------------------------------------------------------------------------

    def _status_message(self, response: httpx2.Response, head: str) -> str:
        status = response.status_code
        if status == 401:
            return (
                f"the kubelet at {self.url} refused the credentials (401 Unauthorized): "
                "check --kubelet-token-file / client certificate"
            )
        if status == 403:
            said = f" (it said: {head})" if head else ""
            return (
                f"the kubelet at {self.url} forbade the request (403 Forbidden): "
                "the identity needs `get` on `nodes/pods` (`nodes/proxy` before Kubernetes "
                f"1.33){said}"
            )
        return (
            f"the kubelet at {self.url} answered {status} {response.reason_phrase}: "
            f"{head or '(empty body)'}"
        )

    def _too_large(self) -> str:
        return (
            f"the kubelet's answer at {self.url} is larger than "
            f"{describe_size(self.max_body_bytes)}: stopped reading"
        )

    def _describe(self, exc: httpx2.HTTPError) -> str:
        """One line for an HTTP failure, from the most telling error in its cause chain."""
        causes = _chain(exc)
        for cause in causes:
            if isinstance(cause, ssl.SSLCertVerificationError):
                problem = cause.verify_message or str(cause)
                if "mismatch" in problem:
                    hint = "put a name the certificate holds in the URL"
                else:
                    hint = "pass its CA with --kubelet-ca"
                return (
                    f"cannot verify the kubelet's TLS certificate at {self.url}: {problem}; "
                    f"{hint}, or --kubelet-insecure-skip-tls-verify to skip the check"
                )
        for cause in causes:
            if isinstance(cause, ssl.SSLError):
                reason = cause.reason or str(cause)
                hint = ""
                if cause.reason == "WRONG_VERSION_NUMBER":
                    hint = "; the port speaks plain HTTP (the read-only port?): use an http:// URL"
                elif cause.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
                    hint = (
                        "; the kubelet wants a client certificate "
                        "(--kubelet-client-cert and --kubelet-client-key)"
                    )
                return f"TLS with the kubelet at {self.url} failed: {reason}{hint}"
        oserror = next((c for c in causes if isinstance(c, OSError) and c.errno), None)
        if isinstance(exc, httpx2.ConnectError):
            if isinstance(oserror, ConnectionRefusedError):
                return (
                    f"cannot connect to the kubelet at {self.url}: connection refused "
                    "(is the kubelet running, and is this its port?)"
                )
            reason = _os_reason(oserror) if oserror is not None else str(exc)
            return f"cannot connect to the kubelet at {self.url}: {reason}"
        # httpx2 takes a write that failed for a reset as sent and then reads an EOF: the
        # socket error is gone from the chain and it says the server "disconnected".
        hung_up = (
            self._https
            and isinstance(exc, httpx2.RemoteProtocolError)
            and "disconnected" in str(exc)
        )
        if oserror is not None or hung_up:
            hint = ""
            if self._https and self.client_cert is None:
                # A kubelet that insists on a client certificate resets the connection once TLS
                # 1.3 has (from the client's side) already completed the handshake.
                hint = (
                    "; if the kubelet requires a client certificate, pass --kubelet-client-cert "
                    "and --kubelet-client-key"
                )
            reason = _os_reason(oserror) if oserror is not None else "closed without an answer"
            return f"the connection to the kubelet at {self.url} broke: {reason}{hint}"
        if isinstance(exc, httpx2.RemoteProtocolError) and not self._https:
            return (
                f"the kubelet at {self.url} broke the HTTP exchange: {exc}; if the port speaks "
                "TLS, use an https:// URL"
            )
        return f"the kubelet at {self.url} broke the HTTP exchange: {_clip(str(exc))}"


def _read_token(path: Path) -> str:
    try:
        raw = read_regular_file(path, max_bytes=_TOKEN_BYTES, what="token file")
    except UnsafeFile as exc:
        raise _ReadFailed(f"cannot read the kubelet token file {path}: {exc.reason}") from None
    except OSError as exc:
        raise _ReadFailed(f"cannot read the kubelet token file {path}: {_os_reason(exc)}") from None
    token = raw.strip()
    if not token:
        raise _ReadFailed(f"the kubelet token file {path} is empty")
    # A token is visible ASCII; anything else would break (or smuggle into) the header.
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise _ReadFailed(
            f"the kubelet token file {path} does not hold a token (visible ASCII, at most 64 KiB)"
        )
    return token.decode("ascii")


def _load_client_certificate(context: ssl.SSLContext, cert: Path, key: Path | None) -> None:
    """``load_cert_chain`` from the bytes read (and checked) here, not from the paths.

    ssl reads only from paths: the checked bytes go to anonymous in-memory files (memfd) that
    it reads through /proc/self/fd, so nothing can be swapped in between the check and the load.
    """
    descriptors: list[int] = []

    def memory_file(path: Path, what: str) -> str:
        data = read_regular_file(path, max_bytes=_TLS_FILE_BYTES, what=what)
        if not hasattr(os, "memfd_create"):  # not Linux: the checked path itself
            return str(path)
        fd = os.memfd_create("cri-prober-tls", os.MFD_CLOEXEC)
        descriptors.append(fd)
        os.write(fd, data)
        return f"/proc/self/fd/{fd}"

    try:
        certfile = memory_file(cert, "client certificate")
        keyfile = memory_file(key, "client key") if key is not None else None
        context.load_cert_chain(certfile, keyfile)
    finally:
        for fd in descriptors:
            os.close(fd)


def _file_key(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None  # building the context reports it
    return (status.st_size, status.st_mtime_ns, status.st_ino)


async def _head(response: httpx2.Response) -> str:
    """The start of an error answer's body, on one line, for a message."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= _ERROR_BODY_BYTES:
            break
    return _clip(data[:_ERROR_BODY_BYTES].decode("utf-8", "replace"))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, UnsafeFile):
        return exc.reason
    if isinstance(exc, ssl.SSLError):
        # "[SSL] PEM lib (_ssl.c:3905)": the source line helps no operator.
        return exc.reason or re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _clip(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _SNIPPET_CHARS else flat[: _SNIPPET_CHARS - 1] + "…"
