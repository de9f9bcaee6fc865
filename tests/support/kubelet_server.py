"""A local stand-in for the kubelet's ``/pods`` endpoint: HTTPS (or plain HTTP, like the read-only
port) with a swappable document, bearer-token or client-certificate authentication, scripted
failures, and a request count a test can await instead of sleeping."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import trustme
from aiohttp import web

# What the kubelet's authorizer says when the identity lacks `get` on `nodes/proxy`.
FORBIDDEN_BODY = (
    "Forbidden (user=system:serviceaccount:kube-system:cri-prober, verb=get, resource=nodes, "
    "subresource(s)=[proxy])"
)
CLIENT_COMMON_NAME = "cri-prober"

# ok: the document; status: `status` with `body`; hang: never answer; endless: a 200 whose body
# never ends.
Mode = Literal["ok", "status", "hang", "endless"]


@dataclass(frozen=True, slots=True)
class KubeletPki:
    """A test CA with a server certificate (127.0.0.1 and localhost by default) and a client one."""

    ca: trustme.CA
    server: trustme.LeafCert
    ca_file: Path
    client_cert: Path
    client_key: Path


def make_pki(
    directory: Path,
    *,
    server_names: tuple[str, ...] = ("127.0.0.1", "localhost"),
    client_common_name: str = CLIENT_COMMON_NAME,
) -> KubeletPki:
    """Make a CA, a server certificate and a client certificate; PEM files go in *directory*."""
    ca = trustme.CA()
    server = ca.issue_cert(*server_names)
    client = ca.issue_cert(f"{client_common_name}@example.com", common_name=client_common_name)
    ca_file = directory / "ca.pem"
    client_cert = directory / "client.pem"
    client_key = directory / "client-key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    client.cert_chain_pems[0].write_to_path(str(client_cert))
    client.private_key_pem.write_to_path(str(client_key))
    return KubeletPki(ca, server, ca_file, client_cert, client_key)


class KubeletServer:
    """Serves ``GET /pods`` on 127.0.0.1 at a free port, as a kubelet would.

    HTTPS with *pki* (or ``tls=True``: a PKI of its own), else plain HTTP like the read-only
    port. A request is authenticated by a client certificate whose CN is in ``client_names``, or
    by a bearer token in ``tokens``, or (``anonymous``, the default for plain HTTP) not at all;
    otherwise it gets 401. An
    authenticated request gets 403 while ``forbidden`` is set. Then ``mode`` decides the answer.
    """

    def __init__(
        self,
        pki: KubeletPki | None = None,
        *,
        tls: bool | None = None,
        tokens: frozenset[str] = frozenset(),
        client_names: frozenset[str] = frozenset({CLIENT_COMMON_NAME}),
        anonymous: bool | None = None,
        require_client_cert: bool = False,
    ) -> None:
        # tls defaults to whether a PKI is given; TLS without one gets its own, in a temp dir.
        self._own_pki: Path | None = None
        if tls and pki is None:
            self._own_pki = Path(tempfile.mkdtemp(prefix="kubelet-pki-"))
            pki = make_pki(self._own_pki)
        elif tls is False:
            pki = None
        self.pki = pki
        self.tokens = tokens
        self.client_names = client_names
        self.require_client_cert = require_client_cert
        # Plain HTTP is the read-only port, which asks for no credentials.
        self.anonymous = pki is None if anonymous is None else anonymous
        self.forbidden = False
        self.mode: Mode = "ok"
        self.status = 200
        self.body = b""
        self.content_type = "application/json"
        self.document = b'{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[]}'
        # What GET /metrics/probes answers (serve --mirror), and how many times it was asked.
        self.metrics = b""
        self.metrics_requests = 0
        self.requests = 0
        self.authorizations: list[str | None] = []
        self.peer_names: list[str | None] = []
        self._counted = asyncio.Condition()
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The ``/pods`` URL the server answers on."""
        scheme = "https" if self.pki is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/pods"

    @property
    def metrics_url(self) -> str:
        """The ``/metrics/probes`` URL the server answers on."""
        return self.url.removesuffix("/pods") + "/metrics/probes"

    def serve(self, document: object) -> None:
        """Answer 200 with *document* (bytes as they are, anything else as JSON) from now on."""
        self.mode = "ok"
        self.document = document if isinstance(document, bytes) else json.dumps(document).encode()

    set_pods = serve

    def answer(
        self, status: int, body: bytes | str = b"", *, content_type: str = "text/plain"
    ) -> None:
        """Answer every request with *status* and *body* from now on."""
        self.mode = "status"
        self.status = status
        self.body = body.encode() if isinstance(body, str) else body
        self.content_type = content_type

    async def wait_metrics_requests(self, count: int) -> None:
        """Return once ``/metrics/probes`` has been asked at least *count* times."""
        async with self._counted:
            await self._counted.wait_for(lambda: self.metrics_requests >= count)

    async def wait_for_requests(self, count: int) -> None:
        """Return once the server has received at least *count* requests."""
        async with self._counted:
            await self._counted.wait_for(lambda: self.requests >= count)

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1."""
        app = web.Application()
        app.router.add_get("/pods", self._pods)
        app.router.add_get("/metrics/probes", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._tls())
        await site.start()
        address: Any = self._runner.addresses[0]
        self.port = int(address[1])

    async def close(self) -> None:
        """Stop listening and end every handler still running."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_pki is not None:
            shutil.rmtree(self._own_pki, ignore_errors=True)
            self._own_pki = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _tls(self) -> ssl.SSLContext | None:
        if self.pki is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.pki.server.configure_cert(context)
        self.pki.ca.configure_trust(context)
        # The kubelet asks for a client certificate but does not insist: a token will do too.
        context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        return context

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        peer = self._peer_name(request)
        authorization = request.headers.get("Authorization")
        async with self._counted:
            self.requests += 1
            self.authorizations.append(authorization)
            self.peer_names.append(peer)
            self._counted.notify_all()
        authenticated = (
            (peer is not None and peer in self.client_names)
            or (authorization is not None and authorization.removeprefix("Bearer ") in self.tokens)
            or self.anonymous
        )
        if not authenticated:
            return web.Response(status=401, text="Unauthorized")
        if self.forbidden:
            return web.Response(status=403, text=FORBIDDEN_BODY)
        if self.mode == "status":
            return web.Response(status=self.status, body=self.body, content_type=self.content_type)
        if self.mode == "hang":
            await self._release.wait()
            return web.Response(status=503)
        if self.mode == "endless":
            return await self._endless(request)
        return web.Response(body=self.document, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        """``/metrics/probes``: the same authentication and scripted answers as ``/pods``
        (counted in ``requests`` too); the counters are the ones set when the request came."""
        metrics = self.metrics
        async with self._counted:
            self.metrics_requests += 1
            self._counted.notify_all()
        if self.mode != "ok" or self.forbidden:
            return await self._pods(request)
        answer = await self._pods(request)
        if answer.status != 200:
            return answer
        return web.Response(
            body=metrics, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b" " * 65536  # JSON whitespace: only a size limit can end the read
        try:
            while not self._release.is_set():
                await response.write(chunk)
        except ConnectionError:
            pass  # the client stopped reading, which is what the test wants to see
        return response

    @staticmethod
    def _peer_name(request: web.Request) -> str | None:
        transport = request.transport
        certificate = transport.get_extra_info("peercert") if transport is not None else None
        if not certificate:
            return None
        for rdn in certificate.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return None
