"""Fuzzing what users feed cri-prober: rules files, override annotations, one-off probe specs.

Whatever the input, the parsers answer with a value or a ``SpecError`` (which the daemon turns into
a message); any other exception would be a crash or a traceback for the user. The tests in
tests/unit/test_spec.py pin exact messages; these throw wide, hostile inputs at the same entry
points: junk YAML structures shaped like the schema, raw and mutated text, huge strings, odd
Unicode, deep nesting, recursive aliases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.daemon import Daemon
from cri_prober.discovery.naming import TargetError
from cri_prober.probing import worker as worker_module
from cri_prober.probing.kinds import KINDS
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.spec import (
    ContainerOverride,
    ProbeKind,
    RulesFile,
    SpecError,
    load_rules,
    parse_annotation,
    parse_probe,
    parse_probe_json,
)
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import TransitionLog
from tests.reliability.support import api_client
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

FUZZ = settings(
    max_examples=200,
    deadline=None,  # the first examples pay for pydantic's lazy setup
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

VALID_RULES = """\
probes:
  - match: {namespace: shop, pod: "web-*", container: app, labels: {tier: front}}
    ports: [{name: http, containerPort: 8080}]
    livenessProbe:
      httpGet: {path: /healthz, port: http, httpHeaders: [{name: X-Probe, value: "1"}]}
      periodSeconds: 5
      failureThreshold: 2
    readinessProbe:
      exec: {command: [cat, /tmp/ready]}
      timeoutSeconds: 2
    startupProbe:
      grpc: {port: 9090, service: ready}
      periodSeconds: 1
      failureThreshold: 30
"""
VALID_ANNOTATION = json.dumps(
    {
        "ports": [{"name": "admin", "containerPort": 9000}],
        "readinessProbe": {"tcpSocket": {"port": "admin"}, "periodSeconds": 2},
        "livenessProbe": {"exec": {"command": ["true"]}, "terminationGracePeriodSeconds": 5},
    }
)

# The schema's own words, so generated structures get past the first "unknown field" often.
SCHEMA_WORDS = [
    "probes", "match", "namespace", "pod", "container", "labels", "ports", "name",
    "containerPort", "protocol", "livenessProbe", "readinessProbe", "startupProbe", "exec",
    "command", "httpGet", "path", "port", "host", "scheme", "httpHeaders", "value", "tcpSocket",
    "grpc", "service", "initialDelaySeconds", "timeoutSeconds", "periodSeconds",
    "successThreshold", "failureThreshold", "terminationGracePeriodSeconds", "HTTP", "HTTPS",
    "TCP", "UDP", "SCTP", "<<",
]  # fmt: skip
YAML_TOKENS = [
    "\n", "  ", ": ", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "!!str ", "!!int ", "!!float ",
    "!!binary ", "!!timestamp ", "!!set ", "!!omap ", "!!python/object ", "? ", "|", ">", "'",
    '"', "#", "---", "...", "%YAML 1.1\n", "~", "null", ".inf", ".nan", "0x1F", "0o17", "1_000",
    "1:20:30", "2001-12-14", "2001-12-14t21:59:43.10-05:00", "yes", "no", "on", "\t", "\\",
    "\x00", "\ufeff", "\u202e", "\ud7ff", "𝔘𝔫𝔦",
]  # fmt: skip


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(),
        st.text(min_size=1, max_size=3).map(lambda s: s * 3000),  # long strings
        st.sampled_from(SCHEMA_WORDS),
    )


def keys() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(SCHEMA_WORDS), st.text(max_size=20), st.integers(), st.none())


def trees(leaves: st.SearchStrategy[Any], key: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.dictionaries(key, children, max_size=6),
        ),
        max_leaves=30,
    )


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"livenessProbe": value}
    return value


def mutated(text: str) -> st.SearchStrategy[str]:
    """``text`` with a few characters deleted, replaced or inserted at random places."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        chars = list(text)
        for _ in range(draw(st.integers(1, 8))):
            position = draw(st.integers(0, len(chars)))
            action = draw(st.sampled_from(["delete", "replace", "insert"]))
            piece = draw(st.one_of(st.sampled_from(YAML_TOKENS), st.characters()))
            if action == "delete" and position < len(chars):
                del chars[position]
            elif action == "replace" and position < len(chars):
                chars[position] = piece
            else:
                chars.insert(position, piece)
        return "".join(chars)

    return build()


def only_spec_errors(parse: Any, text: str) -> None:
    """Parse ``text``; succeed, or raise SpecError with at least one message. Nothing else."""
    error: SpecError | None = None
    try:
        parse(text)
    except SpecError as exc:
        error = exc
    if error is not None:
        assert error.messages
        assert all(isinstance(m, str) and m for m in error.messages)
        str(error)  # the message the daemon logs and the CLI prints must render


def rules_ok(text: str) -> None:
    only_spec_errors(rules, text)


def json_ok(text: str) -> None:
    only_spec_errors(annotation, text)
    only_spec_errors(probe_json, text)


def rules(text: str) -> RulesFile:
    return load_rules(text, source="rules.yaml")


def annotation(text: str) -> ContainerOverride:
    return parse_annotation(text, source="pod default/p annotation probes.cri-prober.io/app")


def probe_json(text: str) -> object:
    return parse_probe_json(text, ProbeKind.READINESS, source="probe_json")


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, allow_unicode=True, width=10_000)


# -- rules files ----------------------------------------------------------------------------------


class TestRulesFile:
    @FUZZ
    @given(trees(scalars(), keys()))
    def test_schema_shaped_junk(self, data: Any) -> None:
        """YAML documents built from the schema's words and random values: SpecError at worst."""
        rules_ok(dump_yaml({"probes": data}))
        rules_ok(dump_yaml(data))

    @FUZZ
    @given(st.lists(st.one_of(st.sampled_from(YAML_TOKENS + SCHEMA_WORDS), st.text()), max_size=40))
    def test_token_soup(self, pieces: list[str]) -> None:
        """Raw text stitched from YAML syntax, tags, anchors and schema words."""
        rules_ok("".join(pieces))

    @FUZZ
    @given(mutated(VALID_RULES))
    def test_mutated_valid_file(self, text: str) -> None:
        """A valid rules file with a few characters deleted, replaced or inserted."""
        rules_ok(text)

    @FUZZ
    @given(st.text())
    @example("probes: " + "[" * 50_000)  # deeper than the parser's recursion
    @example("probes: &a [*a]")  # a list that contains itself
    @example("probes:\n- &m {match: *m, livenessProbe: *m}")  # a mapping that contains itself
    @example("a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nprobes: *b")
    @example("probes:\n- match: {labels: {2001-01-01: x, ~: y, 1.5: z}}")
    @example("\ufeffprobes: []\n")
    @example("probes: [" + "a" * 2_000_000 + "]")
    @example("probes: !!python/object/apply:os.system [true]")
    def test_any_text(self, text: str) -> None:
        """Any Unicode text at all, plus hand-picked nasties (huge, deep, self-referential)."""
        rules_ok(text)

    @FUZZ
    @given(st.integers(1, 150), scalars())
    def test_deep_nesting(self, depth: int, leaf: Any) -> None:
        """Deeply nested probe specs (JSON-flavoured YAML); deeper still is an explicit example."""
        data = {"probes": [nested(depth, leaf)]}
        rules_ok(json.dumps(data, default=str))


@pytest.mark.parametrize(
    "text",
    [
        # Dates are plain strings now (YAML 1.2 core); only an explicit tag asks for one.
        "probes:\n- match: {pod: !!timestamp 2024-02-30}\n  livenessProbe: {exec: {command: [a]}}",
        "probes: [2001-12-14t21:59:43.10-99:99]",
        "probes: [" + "9" * 4301 + "]",
        "probes: !!float not-a-number",
        'probes: ["\\U00110000"]',
        "probes: !!int ",
        "probes: !!bool maybe",
        "probes: !!timestamp yesterday",
    ],
    ids=[
        "impossible-date",
        "bad-offset",
        "huge-int",
        "bad-float-tag",
        "escape-past-unicode",
        "empty-int-tag",
        "bad-bool-tag",
        "bad-timestamp-tag",
    ],
)
def test_yaml_scalars_pyyaml_cannot_construct_are_spec_errors(text: str) -> None:
    """Scalars PyYAML's SafeLoader accepts syntactically but cannot build are reported as such."""
    with pytest.raises(SpecError):
        rules(text)


def test_probe_json_with_a_huge_integer_is_a_spec_error() -> None:
    """A one-off probe spec with a 5000-digit number is an invalid spec, like in annotations."""
    text = '{"exec": {"command": ["true"]}, "periodSeconds": ' + "9" * 5000 + "}"
    with pytest.raises(SpecError):
        annotation(text)  # the annotation parser already gets this right
    with pytest.raises(SpecError):
        probe_json(text)


# -- annotations and one-off probe specs (JSON) ---------------------------------------------------


class TestJsonSpecs:
    @FUZZ
    @given(trees(scalars(), keys()))
    def test_schema_shaped_junk(self, data: Any) -> None:
        """JSON objects built from the schema's words and random values: SpecError at worst."""
        text = json.dumps(data, default=str)
        json_ok(text)

    @FUZZ
    @given(mutated(VALID_ANNOTATION))
    def test_mutated_valid_annotation(self, text: str) -> None:
        """A valid annotation with a few characters deleted, replaced or inserted."""
        json_ok(text)

    @FUZZ
    @given(st.text())
    @example("[" * 100_000)
    @example('{"a": 1, "a": 2}')
    @example('{"livenessProbe": {"exec": {"command": ["x"]}, "periodSeconds": ' + "9" * 5000 + "}}")
    @example('{"livenessProbe": {"exec": {"command": ["\\ud800"]}}}')
    @example('{"livenessProbe": {"tcpSocket": {"port": 1e400}}}')
    @example("NaN")
    def test_any_text(self, text: str) -> None:
        """Any Unicode text at all, plus hand-picked nasties (huge numbers, lone surrogates)."""
        json_ok(text)

    @FUZZ
    @given(st.integers(1, 900), scalars())
    def test_deep_nesting(self, depth: int, leaf: Any) -> None:
        """Deeply nested JSON within what the decoder accepts."""
        text = json.dumps(nested(depth, leaf), default=str)
        json_ok(text)


# -- valid specs meet the handlers ----------------------------------------------------------------


async def _probe_local(spec: dict[str, Any]) -> ProbeOutcome:
    """Run ``spec`` (its port filled in) against a local server that answers every GET at once."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
            # A TLS ClientHello is no GET: hang up at once and the handshake fails fast.
            if await reader.readexactly(3) == b"GET":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        spec["httpGet"]["port"] = server.sockets[0].getsockname()[1]
        probe = parse_probe(spec, kind=ProbeKind.READINESS, path="readinessProbe")
        return await Prober(exec_runner=None).run(  # type: ignore[arg-type]  # no exec here
            probe, ProbeTarget(container_id="c", host_network=True)
        )
    finally:
        server.close()
        await server.wait_closed()


class TestValidSpecsMeetTheHandlers:
    @FUZZ
    @given(
        path=st.text(max_size=300),
        headers=st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.from_regex(r"[-A-Za-z0-9]{1,40}", fullmatch=True),
                    "value": st.text(max_size=200),
                }
            ),
            max_size=6,
        ),
        scheme=st.sampled_from(["HTTP", "HTTPS"]),
    )
    def test_http_paths_and_headers(
        self, path: str, headers: list[dict[str, str]], scheme: str
    ) -> None:
        """Any path and headers that pass validation end in a verdict or ProbeError, in time."""
        spec = {"httpGet": {"path": path, "httpHeaders": headers, "scheme": scheme, "port": 1}}
        try:
            outcome = asyncio.run(asyncio.wait_for(_probe_local(spec), HANG_GUARD))
        except ProbeError:
            return
        assert isinstance(outcome, ProbeOutcome)
        if scheme == "HTTPS":  # the server speaks no TLS
            assert outcome.result is ProbeResult.FAILURE


# -- the local gRPC API ---------------------------------------------------------------------------

API_RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check-ready]}, periodSeconds: 3600}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 3600}
"""
# Clean answers to a bad or unlucky request. UNKNOWN and INTERNAL mean an unhandled exception.
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
API_FUZZ = settings(
    FUZZ,
    # One daemon serves all of a test's examples on purpose: its state must survive them all.
    suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture],
)
STREAM_FUZZ = settings(API_FUZZ, max_examples=40)  # each idle stream costs its read timeout


@dataclass
class ApiWorld:
    """The API of an in-process daemon (its own ``--listen`` server) over the fake runtime."""

    daemon: Daemon
    transitions: TransitionLog
    query: query_pb2_grpc.CriProberAsyncStub
    health: Any  # grpc_health ships no type information
    watcher: ManagerWatcher
    ids: list[str]
    baseline: dict[str, Any]

    def state(self) -> dict[str, Any]:
        """Everything a request must not change: workers, their counters, results, transitions.

        A replaced worker would show as a stop (``WorkerStopped``) and a new worker's counters,
        which start at 0 (the manager hands out no worker objects to compare).
        """
        manager = self.daemon.manager
        workers = {
            (probed.label, state.kind.value): (
                state.attempts,
                state.result_run,
                state.last_result,
                state.on_hold,
                state.active,
                len(state.history),
                manager.results.get(probed.container.id, state.kind),
            )
            for probed in manager.probed()
            for state in probed.probes
            if state.has_worker
        }
        return {
            "workers": workers,
            "worker_count": manager.worker_count(),
            "workers_stopped": len(self.watcher.stopped),
            "results": len(manager.results),
            "transitions": self.transitions.sequence,
        }

    def resolves(self, target: str, kind: str) -> bool:
        """Whether TriggerProbe(target, kind) names a configured probe (and so may change state)."""
        if kind not in KINDS:
            return False
        view = NodeView(self.daemon.discovery, self.daemon.manager)
        try:
            info = view.find(target)
        except TargetError:
            return False
        probed = self.daemon.manager.probed_container(info.id)
        state = probed.probe(KINDS[kind]) if probed is not None else None
        return state is not None and state.has_worker

    def check(self, code: grpc.StatusCode, details: str | None) -> None:
        assert code in CLEAN, (code, (details or "")[:500])
        assert self.state() == self.baseline


async def _status(call: Any) -> tuple[grpc.StatusCode, str | None]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, None


async def _first_of_stream(call: Any) -> tuple[grpc.StatusCode, str | None]:
    """Read a stream until its first message or a short deadline; idle is fine."""
    try:
        async for _ in call:
            break
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.OK, None  # nothing to say yet: the stream is healthy
        return exc.code(), exc.details()
    finally:
        call.cancel()
    return grpc.StatusCode.OK, None


@pytest.fixture(name="api")
async def _api(tmp_path: Path) -> AsyncIterator[ApiWorld]:
    runtime = FakeRuntime()
    ids = []
    for pod in ("web-0", "web-1"):
        sandbox = runtime.add_sandbox(pod, namespace="default", ip="127.0.0.1")
        ids.append(runtime.add_container(sandbox, "app").id)
        ids.append(runtime.add_container(sandbox, "sidecar").id)
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(API_RULES)
    # Every draw is its upper bound: each worker's first tick on its drawn phase comes an hour
    # after the daemon started, never while the fuzzing runs (a request must change nothing;
    # a tick drawn anywhere in the hour would, now and then).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_module, "_SHARED_RNG", _LatestDraws())
        async with _api_world(tmp_path, runtime, ids, rules_file) as world:
            yield world


class _LatestDraws(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return b


@contextlib.asynccontextmanager
async def _api_world(
    tmp_path: Path, runtime: FakeRuntime, ids: list[str], rules_file: Path
) -> AsyncIterator[ApiWorld]:
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as cri_server,
        running_daemon(
            cri_server.target,
            rules_file,
            ready_timeout=10,
            stop_timeout=10,
            pleg="relist",
            relist_period=0.2,
        ) as (daemon, watcher),
    ):
        # Workers appear once the first relist is reconciled, which ready does not wait for.
        await watcher.until(lambda: daemon.manager.worker_count() >= 4, timeout=HANG_GUARD)
        workers = [(p.container.id, s.kind) for p in daemon.manager.probed() for s in p.probes]
        assert len(workers) == 4
        # Probe once each, so results and counters are non-trivial: their period is an hour,
        # and so is their start-up jitter (the daemon just started), so ask for it.
        for container_id, kind in workers:
            daemon.manager.probe_now(container_id, kind)
        # A readiness worker also runs the trigger its pod's sync left pending (§3.8) right
        # after that first step, as the kubelet's buffered trigger does: wait for both.
        await watcher.until(
            lambda: all(
                s.attempts >= (2 if s.kind is ProbeKind.READINESS else 1)
                for p in daemon.manager.probed()
                for s in p.probes
            ),
            timeout=HANG_GUARD,
        )
        assert len(daemon.manager.results) == 4
        async with api_client(daemon) as client:
            world = ApiWorld(
                daemon, client.transitions, client.query, client.health, watcher, ids, {}
            )
            world.baseline = world.state()
            yield world


def names(api_ids: list[str]) -> st.SearchStrategy[str]:
    """Container names: real ones, near misses, prefixes, junk, huge and odd Unicode."""
    real = [
        "default/web-0/app",
        "default/web-1/sidecar",
        "default/web-0",
        "default/",
        "/web-0/app",
        "default/web-0/app/",
        "default//app",
        "/",
        "",
    ]
    return st.one_of(
        st.sampled_from(real + api_ids + [i[:n] for i in api_ids for n in (1, 12, 63)]),
        st.text(),
        st.text(st.sampled_from("/0aé\x00\n"), max_size=30),
        st.text(min_size=1, max_size=3).map(lambda s: s * 100_000),  # up to ~1 MB
    )


def regexes() -> st.SearchStrategy[str]:
    junk = ["(", ")", "[", "a{2,1}", "(?P<", "\\", "*", "a**", "(?<=a+)b", "(?i)ü", "\\N{X}"]
    return st.one_of(
        st.just(""),
        st.sampled_from([*junk, "app", "^web-\\d$", "(a|b)*c", ".*"]),
        st.text(max_size=40),
        st.text(st.sampled_from("()[]{}*+?|\\^$.a1,:<=!P"), max_size=40),
    )


def filters(api: ApiWorld) -> st.SearchStrategy[query_pb2.ContainerFilter]:
    return st.builds(
        query_pb2.ContainerFilter,
        id=st.one_of(st.text(max_size=70), st.sampled_from([i[:5] for i in api.ids])),
        name=regexes(),
        namespace=regexes(),
        pod=regexes(),
    )


def probe_specs() -> st.SearchStrategy[str]:
    """probe_json: junk text, junk JSON, and valid specs that run at once against nothing."""
    valid = st.one_of(
        st.builds(
            lambda cmd: {"exec": {"command": cmd}},
            st.lists(st.text(max_size=20), min_size=1, max_size=4),
        ),
        st.builds(
            lambda port: {"tcpSocket": {"port": port, "host": "127.0.0.1"}},
            st.integers(1, 65535),
        ),
        st.builds(
            lambda path: {"httpGet": {"port": 1, "host": "127.0.0.1", "path": path}},
            st.text(max_size=50),
        ),
        st.builds(lambda port: {"grpc": {"port": port}}, st.integers(-5, 70000)),
    )
    return st.one_of(
        st.text(),
        trees(scalars(), keys()).map(lambda d: json.dumps(d, default=str)),
        valid.map(json.dumps),
        st.just('{"exec": {"command": ["x"]}, "periodSeconds": ' + "9" * 4000 + "}"),
    )


kinds = st.one_of(st.sampled_from(["liveness", "readiness", "startup", "", "LIVENESS"]), st.text())


class TestApi:
    @API_FUZZ
    @given(data=st.data())
    async def test_list_containers(self, api: ApiWorld, data: st.DataObject) -> None:
        """ListContainers with random filters and states: a clean status, no state change."""
        request = query_pb2.ListContainersRequest(
            filter=data.draw(filters(api)), all=data.draw(st.booleans())
        )
        if data.draw(st.booleans()):
            # Any number: proto3 enums are open, so values outside the enum reach the server.
            request.state = query_pb2.ContainerState.ValueType(data.draw(st.integers(-1, 9)))
        api.check(*await _status(api.query.ListContainers(request, timeout=HANG_GUARD)))

    @API_FUZZ
    @given(data=st.data())
    async def test_get_container(self, api: ApiWorld, data: st.DataObject) -> None:
        """GetContainer with random names: a clean status, no state change."""
        request = query_pb2.GetContainerRequest(target=data.draw(names(api.ids)))
        api.check(*await _status(api.query.GetContainer(request, timeout=HANG_GUARD)))

    @API_FUZZ
    @given(data=st.data())
    async def test_run_probe(self, api: ApiWorld, data: st.DataObject) -> None:
        """RunProbe with random targets, kinds and specs: a clean status; it changes nothing."""
        request = query_pb2.RunProbeRequest(
            target=data.draw(names(api.ids)),
            kind=data.draw(kinds),
            probe_json=data.draw(probe_specs()),
        )
        api.check(*await _status(api.query.RunProbe(request, timeout=HANG_GUARD)))

    @API_FUZZ
    @given(data=st.data())
    async def test_trigger_probe(self, api: ApiWorld, data: st.DataObject) -> None:
        """TriggerProbe with anything but a real (container, kind) pair: refused cleanly."""
        target, kind = data.draw(names(api.ids)), data.draw(kinds)
        assume(not api.resolves(target, kind))  # a real trigger may change state, as it should
        request = query_pb2.TriggerProbeRequest(target=target, kind=kind)
        code, details = await _status(api.query.TriggerProbe(request, timeout=HANG_GUARD))
        assert code != grpc.StatusCode.OK
        api.check(code, details)

    @STREAM_FUZZ
    @given(data=st.data())
    async def test_watch_transitions(self, api: ApiWorld, data: st.DataObject) -> None:
        """WatchTransitions with random filters and resume points: clean, and no state change."""
        request = query_pb2.WatchTransitionsRequest(filter=data.draw(filters(api)))
        if data.draw(st.booleans()):
            request.since_sequence = data.draw(st.integers(0, 2**64 - 1))
        if data.draw(st.booleans()):
            request.incarnation = data.draw(
                st.one_of(st.just(api.transitions.incarnation), st.text(max_size=80))
            )
        api.check(*await _first_of_stream(api.query.WatchTransitions(request, timeout=0.2)))

    @API_FUZZ
    @given(data=st.data())
    async def test_health_check(self, api: ApiWorld, data: st.DataObject) -> None:
        """Health/Check with random service names: SERVING, NOT_SERVING or NOT_FOUND."""
        request = health_pb2.HealthCheckRequest(service=data.draw(names(api.ids)))
        api.check(*await _status(api.health.Check(request, timeout=HANG_GUARD)))

    @STREAM_FUZZ
    @given(data=st.data())
    async def test_health_watch(self, api: ApiWorld, data: st.DataObject) -> None:
        """Health/Watch with random service names: answers at once (SERVICE_UNKNOWN if unknown)."""
        request = health_pb2.HealthCheckRequest(service=data.draw(names(api.ids)))
        call = api.health.Watch(request, timeout=HANG_GUARD)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            api.check(exc.code(), exc.details())
            return
        finally:
            call.cancel()
        assert first is not grpc.aio.EOF
        api.check(grpc.StatusCode.OK, None)

    async def test_the_server_survived(self, api: ApiWorld) -> None:
        """After all that, a plain request still works (a crashed servicer would not answer)."""
        response = await api.health.Check(
            health_pb2.HealthCheckRequest(service="default/web-0/app"), timeout=HANG_GUARD
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "pattern",
    ["a{1001}", "(" * 1000 + ")" * 1000, r"[\p{L}\p{N}]{1000}", r"(a)\1"],
    ids=["huge-repeat", "deep", "too-large-for-re2", "backreference"],
)
async def test_api_filter_regex_edge_cases_are_invalid_argument(
    api: ApiWorld, pattern: str
) -> None:
    """A filter RE2 refuses (or over the length cap) is INVALID_ARGUMENT, like any bad regex."""
    request = query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(name=pattern))
    code, details = await _status(api.query.ListContainers(request, timeout=HANG_GUARD))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)


async def test_api_unknown_container_state_is_invalid_argument(api: ApiWorld) -> None:
    """An unknown state value in ListContainers is INVALID_ARGUMENT (or simply matches nothing)."""
    request = query_pb2.ListContainersRequest(state=query_pb2.ContainerState.ValueType(99))
    code, details = await _status(api.query.ListContainers(request, timeout=HANG_GUARD))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK), (code, details)


async def test_api_run_probe_with_an_unresolvable_host_reports_an_attempt(api: ApiWorld) -> None:
    """RunProbe on a host name that cannot be encoded returns an attempt, not UNKNOWN."""
    request = query_pb2.RunProbeRequest(
        target="default/web-0/app",
        probe_json=json.dumps({"tcpSocket": {"host": "a..b", "port": 80}}),
    )
    code, details = await _status(api.query.RunProbe(request, timeout=HANG_GUARD))
    assert code == grpc.StatusCode.OK, (code, details)
