"""``KubeletSource`` against a local kubelet stand-in serving the v1.28.7 recordings: token and
client-certificate auth, TLS verification, each failure's one message with the last good view
kept, staleness on an injected clock, and ``changed`` called only on real changes."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import socket
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import trustme
from structlog.testing import capture_logs

from cri_prober.errors import ConfigError
from cri_prober.podspecs.kubelet import KubeletSource
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.probing.kinds import ProbeKind
from tests.support.clock import ManualClock
from tests.support.kubelet_server import FORBIDDEN_BODY, KubeletPki, KubeletServer, make_pki

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
WEB_UID = "f177263d9de7365e9da06d5ff3b3399b"
BATCH_UID = "2a55a2aecce1cdf9b9a4c4197da463d8"
TOKEN = "token-1"


def _document(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return document


RUNNING = _document("pods-running.json")
TERMINATING = _document("pods-terminating.json")


@pytest.fixture(name="pki")
def _pki(tmp_path: Path) -> KubeletPki:
    return make_pki(tmp_path)


@pytest.fixture(name="token_file")
def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(name="kubelet")
async def _kubelet(pki: KubeletPki) -> AsyncIterator[KubeletServer]:
    server = KubeletServer(pki, tokens=frozenset({TOKEN}))
    server.serve(RUNNING)
    await server.start()
    yield server
    await server.close()


@pytest.fixture(name="clock")
def _clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(name="source")
async def _source(
    kubelet: KubeletServer, pki: KubeletPki, token_file: Path, clock: ManualClock
) -> AsyncIterator[KubeletSource]:
    source = KubeletSource(
        kubelet.url,
        token_file=token_file,
        ca_file=pki.ca_file,
        timeout=2.0,
        interval=1.0,
        clock=clock,
    )
    yield source
    await source.close()


def _failures(logs: list[MutableMapping[str, Any]]) -> list[str]:
    return [entry["error"] for entry in logs if entry["event"] == "pod_source_failed"]


# -- good reads -----------------------------------------------------------------------------------


async def test_recorded_pods_then_the_removed_static_pod_vanishes_at_once(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """The running recording gives both pods; the terminating one drops `web` on the next poll."""
    assert await source.poll() is True
    assert set(source.pods) == {WEB_UID, BATCH_UID}
    web = source.pods[WEB_UID]
    assert (web.label, web.source, web.phase) == ("shop/web-kd-node", "kubelet", "Running")
    assert set(web.containers) == {"app", "worker"}
    assert source.pods[BATCH_UID].init_containers == {"setup"}
    assert not source.stale()
    assert kubelet.authorizations == [f"Bearer {TOKEN}"]

    kubelet.serve(TERMINATING)
    assert await source.poll() is True
    assert set(source.pods) == {BATCH_UID}


async def test_the_removed_static_pod_is_deleting_at_once_in_the_registry(
    kubelet: KubeletServer, source: KubeletSource, clock: ManualClock
) -> None:
    """Issue 34 (5): both recorded pods are static (config.source "file"); `web`'s absence from
    the terminating recording is its termination, so the registry has it as deleting at once,
    not after the polled source's missing-pod grace (kept for an API pod's unexplained
    omission)."""
    registry = PodSpecs([source], clock=clock)
    assert await source.poll() is True
    registry.rebuild()
    registry.retain({WEB_UID, BATCH_UID})  # the node still runs both
    web = registry.lookup(WEB_UID, "shop", "web-kd-node")
    assert web is not None
    assert web.static
    assert not web.deleting
    assert source.missing_grace_for(web) == 0.0
    kubelet.serve(TERMINATING)
    assert await source.poll() is True
    registry.rebuild()  # no time passes
    web = registry.lookup(WEB_UID, "shop", "web-kd-node")
    assert web is not None
    assert web.deleting
    batch = registry.lookup(BATCH_UID, "jobs", "batch-kd-node")
    assert batch is not None
    assert not batch.deleting
    # An API pod keeps the grace: only its deletionTimestamp says it is being deleted.
    api_pod = dataclasses.replace(web, static=False, deleting=False)
    assert source.missing_grace_for(api_pod) == source.missing_grace > 0


async def test_an_unchanged_listing_is_no_change(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """The same listing again, or one whose statuses alone moved, changes nothing."""
    assert await source.poll() is True
    assert await source.poll() is False
    moved = copy.deepcopy(RUNNING)
    for pod in moved["items"]:
        for status in pod["status"].get("containerStatuses", []):
            status["restartCount"] = status.get("restartCount", 0) + 1
    kubelet.serve(moved)
    assert await source.poll() is False
    assert source.reads == 3
    assert source.read_errors == 0


async def test_schema_corners_sidecar_deletion_and_named_ports(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """A probed restartable init container, a deleting pod and named ports all come through."""
    document = copy.deepcopy(RUNNING)
    web, batch = _by_name(document, "web-kd-node"), _by_name(document, "batch-kd-node")
    batch["spec"]["initContainers"].append(
        {
            "name": "proxy",
            "image": "docker.io/local/busybox:1",
            "restartPolicy": "Always",
            "ports": [{"name": "admin", "containerPort": 9901}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "admin"}},
        }
    )
    web["metadata"]["deletionTimestamp"] = "2024-03-01T10:00:00Z"
    web["metadata"]["deletionGracePeriodSeconds"] = 20
    web["spec"]["containers"][1]["ports"] = [
        {"name": "metrics", "containerPort": 9100},
        {"name": "metrics", "containerPort": 9200},  # the kubelet takes the first of a name
        {"containerPort": 9300},
    ]
    kubelet.serve(document)
    assert await source.poll() is True

    batch_spec = source.pods[BATCH_UID]
    proxy = batch_spec.containers["proxy"]
    assert proxy.sidecar is True
    readiness = proxy.probe(ProbeKind.READINESS)
    assert readiness is not None
    assert readiness.http_get is not None
    assert readiness.http_get.port == "admin"
    assert proxy.ports == {"admin": 9901}
    assert batch_spec.init_containers == {"setup"}

    web_spec = source.pods[WEB_UID]
    assert web_spec.deleting is True
    assert web_spec.deletion_grace_seconds == 20
    assert web_spec.containers["app"].ports == {"http": 8080}
    assert web_spec.containers["worker"].ports == {"metrics": 9100}


async def test_an_empty_node_answers_null_items(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """Go encodes a node without pods as `"items": null`: an empty, good view."""
    assert await source.poll() is True
    kubelet.serve({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": None})
    with capture_logs() as logs:
        assert await source.poll() is True
    assert logs == []
    assert dict(source.pods) == {}
    assert source.last_error is None


async def test_a_large_listing_is_decoded_and_read_whole(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """A listing far above the inline-decoding size (decoded in a thread) reads like a small one."""
    document = copy.deepcopy(RUNNING)
    template = _by_name(document, "batch-kd-node")
    for index in range(300):
        pod = copy.deepcopy(template)
        pod["metadata"]["uid"] = f"uid-{index}"
        pod["metadata"]["name"] = f"batch-{index}"
        document["items"].append(pod)
    kubelet.serve(document)
    assert len(kubelet.document) > 512 * 1024
    assert await source.poll() is True
    assert len(source.pods) == 302


# -- authentication and TLS -----------------------------------------------------------------------


async def test_the_token_file_is_read_again_on_every_poll(
    kubelet: KubeletServer, source: KubeletSource, token_file: Path
) -> None:
    """A rotated projected token is used on the next poll; a revoked one gives the 401 message."""
    assert await source.poll() is True
    token_file.write_text("token-2")
    kubelet.tokens = frozenset({"token-2"})
    with capture_logs() as logs:
        assert await source.poll() is False
    assert _failures(logs) == []
    assert kubelet.authorizations[-1] == "Bearer token-2"

    kubelet.tokens = frozenset({"token-3"})
    with capture_logs() as logs:
        await source.poll()
    assert _failures(logs) == [
        f"the kubelet at {kubelet.url} refused the credentials (401 Unauthorized): "
        "check --kubelet-token-file / client certificate"
    ]
    assert set(source.pods) == {WEB_UID, BATCH_UID}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read the kubelet token file {path}: No such file or directory"),
        ("  \n", "the kubelet token file {path} is empty"),
        (
            "abc\r\nX-Evil: 1",
            "the kubelet token file {path} does not hold a token (visible ASCII, at most 64 KiB)",
        ),
    ],
    ids=["missing", "empty", "header-injection"],
)
async def test_a_bad_token_file_is_a_failed_read(
    kubelet: KubeletServer,
    source: KubeletSource,
    token_file: Path,
    content: str | None,
    expected: str,
) -> None:
    """A missing, empty or malformed token file fails the read before any request is sent."""
    assert await source.poll() is True
    if content is None:
        token_file.unlink()
    else:
        token_file.write_text(content)
    with capture_logs() as logs:
        assert await source.poll() is False
    assert _failures(logs) == [expected.format(path=token_file)]
    assert kubelet.requests == 1
    assert set(source.pods) == {WEB_UID, BATCH_UID}


async def test_client_certificate_authentication(kubelet: KubeletServer, pki: KubeletPki) -> None:
    """A client certificate alone authenticates; without one the kubelet answers 401."""
    source = KubeletSource(
        kubelet.url, ca_file=pki.ca_file, client_cert=pki.client_cert, client_key=pki.client_key
    )
    anonymous = KubeletSource(kubelet.url, ca_file=pki.ca_file)
    try:
        assert await source.poll() is True
        assert kubelet.peer_names == ["cri-prober"]
        assert kubelet.authorizations == [None]
        with capture_logs() as logs:
            assert await anonymous.poll() is False
        assert [e["error"] for e in logs] == [
            f"the kubelet at {kubelet.url} refused the credentials (401 Unauthorized): "
            "check --kubelet-token-file / client certificate"
        ]
    finally:
        await source.close()
        await anonymous.close()


async def test_a_rotated_client_certificate_is_loaded_again(
    kubelet: KubeletServer, pki: KubeletPki, tmp_path: Path
) -> None:
    """Replacing the certificate files builds a new TLS context on the next poll."""
    cert, key = tmp_path / "rotating.pem", tmp_path / "rotating-key.pem"
    cert.write_bytes(pki.client_cert.read_bytes())
    key.write_bytes(pki.client_key.read_bytes())
    source = KubeletSource(kubelet.url, ca_file=pki.ca_file, client_cert=cert, client_key=key)
    try:
        assert await source.poll() is True
        other = pki.ca.issue_cert("other@example.com", common_name="other")
        other.cert_chain_pems[0].write_to_path(str(cert))
        other.private_key_pem.write_to_path(str(key))
        os.utime(cert, ns=(1, 1))  # the same size is likely: the mtime alone must tell
        with capture_logs() as logs:
            assert await source.poll() is False
        assert kubelet.peer_names == ["cri-prober", "other"]
        assert len(_failures(logs)) == 1  # "other" is not a known identity: 401
    finally:
        await source.close()


async def test_unknown_ca_fails_verification_with_a_hint(
    kubelet: KubeletServer, tmp_path: Path
) -> None:
    """A serving certificate from a CA not trusted fails with the --kubelet-ca hint."""
    stranger = tmp_path / "stranger.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    for ca_file in (stranger, None):
        source = KubeletSource(kubelet.url, ca_file=ca_file)
        try:
            with capture_logs() as logs:
                assert await source.poll() is False
        finally:
            await source.close()
        assert _failures(logs) == [
            f"cannot verify the kubelet's TLS certificate at {kubelet.url}: "
            "self-signed certificate in certificate chain; pass its CA with --kubelet-ca, or "
            "--kubelet-insecure-skip-tls-verify to skip the check"
        ]
    assert kubelet.requests == 0


async def test_insecure_mode_skips_verification(kubelet: KubeletServer, token_file: Path) -> None:
    """--kubelet-insecure-skip-tls-verify reads from a kubelet whose CA is unknown."""
    source = KubeletSource(kubelet.url, token_file=token_file, insecure_skip_tls_verify=True)
    try:
        assert await source.poll() is True
    finally:
        await source.close()
    assert set(source.pods) == {WEB_UID, BATCH_UID}


async def test_a_server_with_its_own_pki_as_a_context_manager(token_file: Path) -> None:
    """`KubeletServer(tls=True)` makes its own certificates and cleans them up on exit."""
    async with KubeletServer(tls=True, tokens=frozenset({TOKEN})) as server:
        server.set_pods(RUNNING)
        assert server.pki is not None
        ca_file = server.pki.ca_file
        source = KubeletSource(server.url, token_file=token_file, ca_file=ca_file)
        try:
            assert await source.poll() is True
        finally:
            await source.close()
    assert set(source.pods) == {WEB_UID, BATCH_UID}
    assert not ca_file.exists()


async def test_a_kubelet_that_insists_on_a_client_certificate(
    pki: KubeletPki, token_file: Path
) -> None:
    """A TLS port that requires a client certificate resets a token-only read: the hint says
    what to pass."""
    async with KubeletServer(pki, tokens=frozenset({TOKEN}), require_client_cert=True) as server:
        source = KubeletSource(server.url, token_file=token_file, ca_file=pki.ca_file)
        try:
            with capture_logs() as logs:
                assert await source.poll() is False
        finally:
            await source.close()
    # The reset surfaces as a reset or (httpx2 swallowing the failed write) as a bare EOF.
    [failure] = _failures(logs)
    reason = failure.removeprefix(f"the connection to the kubelet at {server.url} broke: ")
    assert reason in {
        f"{cause}; if the kubelet requires a client certificate, pass --kubelet-client-cert "
        "and --kubelet-client-key"
        for cause in ("Connection reset by peer", "closed without an answer")
    }


async def test_a_name_the_certificate_lacks_gets_its_own_hint(tmp_path: Path) -> None:
    """The right CA but an address the certificate does not hold: the message says so."""
    pki = make_pki(tmp_path, server_names=("kd-node.example",))
    server = KubeletServer(pki, anonymous=True)
    await server.start()
    source = KubeletSource(server.url, ca_file=pki.ca_file)
    try:
        with capture_logs() as logs:
            assert await source.poll() is False
    finally:
        await source.close()
        await server.close()
    assert _failures(logs) == [
        f"cannot verify the kubelet's TLS certificate at {server.url}: IP address mismatch, "
        "certificate is not valid for '127.0.0.1'.; put a name the certificate holds in the URL, "
        "or --kubelet-insecure-skip-tls-verify to skip the check"
    ]


async def test_missing_tls_files_are_failed_reads(kubelet: KubeletServer, tmp_path: Path) -> None:
    """A CA file or client certificate that cannot be loaded names the file."""
    missing = tmp_path / "nope.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    cases = [
        (
            KubeletSource(kubelet.url, ca_file=missing),
            f"cannot load the kubelet CA file {missing}: No such file or directory",
        ),
        (
            KubeletSource(kubelet.url, insecure_skip_tls_verify=True, client_cert=garbage),
            f"cannot load the client certificate {garbage}: [SSL] PEM lib "
            "(PEM certificate and key expected)",
        ),
    ]
    for source, expected in cases:
        with capture_logs() as logs:
            assert await source.poll() is False
        await source.close()
        assert _failures(logs) == [expected]
    assert kubelet.requests == 0


# -- failures keep the last good view -------------------------------------------------------------


def _refused_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"https://127.0.0.1:{port}/pods"  # nothing listens there once the socket is closed


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        pytest.param(
            lambda s: s.answer(500, "etcd\n  is\tsad"),
            "the kubelet at {url} answered 500 Internal Server Error: etcd is sad",
            id="500",
        ),
        pytest.param(
            lambda s: s.answer(503),
            "the kubelet at {url} answered 503 Service Unavailable: (empty body)",
            id="503-empty",
        ),
        pytest.param(
            lambda s: s.answer(502, "x" * 10_000),
            "the kubelet at {url} answered 502 Bad Gateway: " + "x" * 199 + "…",
            id="502-clipped",
        ),
        pytest.param(
            lambda s: setattr(s, "forbidden", True),
            "the kubelet at {url} forbade the request (403 Forbidden): the identity needs `get` "
            "on `nodes/pods` (`nodes/proxy` before Kubernetes 1.33) "
            f"(it said: {FORBIDDEN_BODY})",
            id="403",
        ),
        pytest.param(
            lambda s: s.serve(b'{"kind": "PodList",\n "items": [}'),
            "the kubelet at {url} answered malformed JSON: invalid character (byte 31)",
            id="malformed-json",
        ),
        pytest.param(
            lambda s: s.serve(b"\xff\xfe\xfa"),
            "the kubelet at {url} answered malformed JSON: invalid character (byte 0)",
            id="not-utf8",
        ),
        pytest.param(
            lambda s: s.serve(b"[" * 100_000 + b"]" * 100_000),
            "the kubelet at {url} answered something that is not a usable PodList: Expected "
            "`object`, got `array`",
            id="deep",
        ),
        pytest.param(
            lambda s: s.serve({"kind": "Status", "status": "Failure"}),
            'the kubelet at {url} answered kind "Status", not a PodList',
            id="status-kind",
        ),
        pytest.param(
            lambda s: s.serve([1, 2]),
            "the kubelet at {url} answered something that is not a usable PodList: Expected "
            "`object`, got `array`",
            id="list",
        ),
        pytest.param(
            lambda s: s.serve({"kind": "PodList", "items": {"a": 1}}),
            "the kubelet at {url} answered something that is not a usable PodList: Expected "
            "`array | null`, got `object` - at `items`",
            id="items-not-list",
        ),
        pytest.param(
            lambda s: s.serve(b"x" * 4097),
            "the kubelet's answer at {url} is larger than 4 KiB: stopped reading",
            id="too-large-declared",
        ),
        pytest.param(
            lambda s: setattr(s, "mode", "endless"),
            "the kubelet's answer at {url} is larger than 4 KiB: stopped reading",
            id="too-large-streamed",
        ),
        pytest.param(
            lambda s: setattr(s, "mode", "hang"),
            "the kubelet at {url} did not answer within 0.5s",
            id="timeout",
        ),
    ],
)
async def test_each_failure_is_one_clear_message_and_keeps_the_view(
    kubelet: KubeletServer,
    token_file: Path,
    pki: KubeletPki,
    clock: ManualClock,
    setup: Any,
    expected: str,
) -> None:
    """Every failure mode gives its own message, logged once, and the last good view stays."""
    source = KubeletSource(
        kubelet.url,
        token_file=token_file,
        ca_file=pki.ca_file,
        # A guard for the good poll (a TLS handshake on a busy machine can take seconds)...
        timeout=120.0,
        max_body_bytes=4096 if "larger" in expected else 64 << 20,
        clock=clock,
    )
    if "larger" in expected:  # the recorded listing is over 4 KiB: start from a small one
        kubelet.serve(_only(RUNNING, "batch-kd-node"))
    try:
        assert await source.poll() is True
        before = dict(source.pods)
        if "did not answer" in expected:
            source.timeout = 0.5  # ...and the deadline a hanging kubelet runs into
        setup(kubelet)
        with capture_logs() as logs:
            assert await source.poll() is False
            assert await source.poll() is False  # the same problem again: not logged again
        assert _failures(logs) == [expected.format(url=kubelet.url)]
        assert source.last_error == expected.format(url=kubelet.url)
        assert dict(source.pods) == before
        assert source.read_errors == 2
        assert [e["kept_pods"] for e in logs if e["event"] == "pod_source_failed"] == [len(before)]
    finally:
        await source.close()


async def test_connection_refused_names_the_url() -> None:
    """Nothing listening at the URL: the message names it and asks whether the kubelet runs."""
    url = _refused_url()
    source = KubeletSource(url, insecure_skip_tls_verify=True)
    try:
        with capture_logs() as logs:
            assert await source.poll() is False
    finally:
        await source.close()
    assert _failures(logs) == [
        f"cannot connect to the kubelet at {url}: connection refused (is the kubelet running, "
        "and is this its port?)"
    ]
    assert source.stale()
    assert "connection refused" in source.staleness()


async def test_wrong_scheme_either_way_says_which_to_use(
    kubelet: KubeletServer, tmp_path: Path
) -> None:
    """https:// to a plain HTTP port, and http:// to a TLS port, each say what to change."""
    plain = KubeletServer(None, anonymous=True)
    await plain.start()
    to_plain = plain.url.replace("http://", "https://")
    to_tls = kubelet.url.replace("https://", "http://")
    try:
        for url, expected in (
            (
                to_plain,
                f"TLS with the kubelet at {to_plain} failed: WRONG_VERSION_NUMBER; the port "
                "speaks plain HTTP (the read-only port?): use an http:// URL",
            ),
            (
                to_tls,
                f"the kubelet at {to_tls} broke the HTTP exchange: Server disconnected without "
                "sending a response.; if the port speaks TLS, use an https:// URL",
            ),
        ):
            source = KubeletSource(url, insecure_skip_tls_verify=True)
            with capture_logs() as logs:
                assert await source.poll() is False
            await source.close()
            assert _failures(logs) == [expected]
    finally:
        await plain.close()


async def test_the_read_only_port_needs_no_credentials() -> None:
    """Plain HTTP, as the read-only port 10255 serves it, reads without token or certificate."""
    plain = KubeletServer(None, anonymous=True)
    plain.serve(RUNNING)
    await plain.start()
    source = KubeletSource(plain.url)
    try:
        assert await source.poll() is True
    finally:
        await source.close()
        await plain.close()
    assert set(source.pods) == {WEB_UID, BATCH_UID}
    assert plain.authorizations == [None]


# -- staleness, recovery and the run loop ---------------------------------------------------------


async def test_stale_after_no_good_read_then_recovery_is_logged(
    kubelet: KubeletServer, source: KubeletSource, clock: ManualClock
) -> None:
    """Without a good read for stale_after the view is stale (but kept); a good read ends it."""
    assert source.stale_after == 10.0  # max(10 s, 5 x 1 s)
    assert source.stale()
    assert source.staleness() == "pod source kubelet: no good read yet"
    assert await source.poll() is True
    clock.now += 10.0
    assert not source.stale()

    kubelet.answer(500, "boom")
    await source.poll()
    clock.now += 0.5
    assert source.stale()
    assert source.staleness() == (
        "pod source kubelet: no good read for 10s: "
        f"the kubelet at {kubelet.url} answered 500 Internal Server Error: boom"
    )
    assert len(source.pods) == 2

    kubelet.serve(RUNNING)
    with capture_logs() as logs:
        assert await source.poll() is False
    assert [(e["event"], e["pods"]) for e in logs] == [("pod_source_recovered", 2)]
    assert not source.stale()
    assert source.staleness() == ""


async def test_run_calls_changed_only_on_real_changes(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """The loop polls on; `changed` fires for the first view and the removal, not for repeats
    or failed reads."""
    source.interval = 0.01
    changes: list[frozenset[str]] = []
    changed = asyncio.Event()

    def on_change() -> None:
        changes.append(frozenset(source.pods))
        changed.set()

    task = asyncio.create_task(source.run(on_change))
    try:
        await kubelet.wait_for_requests(4)
        assert changes == [frozenset({WEB_UID, BATCH_UID})]
        kubelet.answer(500, "down")
        await kubelet.wait_for_requests(kubelet.requests + 3)
        assert len(changes) == 1
        assert source.last_error is not None
        changed.clear()
        kubelet.serve(TERMINATING)
        await changed.wait()
        assert changes == [frozenset({WEB_UID, BATCH_UID}), frozenset({BATCH_UID})]
        await kubelet.wait_for_requests(kubelet.requests + 3)
        assert len(changes) == 2
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_survives_a_listener_that_raises(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    """A `changed` callback that raises is logged; polling goes on."""
    source.interval = 0.01

    def broken() -> None:
        raise RuntimeError("listener bug")

    with capture_logs() as logs:
        task = asyncio.create_task(source.run(broken))
        try:
            await kubelet.wait_for_requests(1)
            kubelet.serve(TERMINATING)
            await kubelet.wait_for_requests(kubelet.requests + 3)
            assert not task.done()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert [e["event"] for e in logs].count("pod_source_listener_failed") == 2
    assert set(source.pods) == {BATCH_UID}


def test_constructor_rejects_bad_settings() -> None:
    """A URL that is not HTTP(S), a key without certificate and a zero interval are refused."""
    with pytest.raises(ConfigError, match="must start with https:// or http://"):
        KubeletSource("127.0.0.1:10250/pods")
    with pytest.raises(ConfigError, match="client key needs its client certificate"):
        KubeletSource(client_key=Path("key.pem"))
    with pytest.raises(ConfigError, match="must be positive"):
        KubeletSource(interval=0)
    source = KubeletSource(interval=4.0)
    assert (source.url, source.stale_after, source.timeout) == (
        "https://127.0.0.1:10250/pods",
        20.0,
        5.0,
    )


# -- helpers --------------------------------------------------------------------------------------


def _by_name(document: dict[str, Any], name: str) -> dict[str, Any]:
    pod: dict[str, Any] = next(p for p in document["items"] if p["metadata"]["name"] == name)
    return pod


def _only(document: dict[str, Any], name: str) -> dict[str, Any]:
    small = copy.deepcopy(document)
    small["items"] = [_by_name(small, name)]
    for pod in small["items"]:
        pod.pop("status", None)
        pod["metadata"].pop("managedFields", None)
    return small
