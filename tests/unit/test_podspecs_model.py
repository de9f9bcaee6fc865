"""Reading core/v1 Pod objects into pod specs: the kubelet v1.28.7 recordings, static pod naming,
the schema's corners (sidecars, deletion, named ports, valueFrom env) and errors with field paths;
and the registry that matches them to CRI sandboxes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from cri_prober.podspecs.model import PodOrigin, PodSpecError, parse_pod, pod_key
from cri_prober.podspecs.options import parse_source
from cri_prober.podspecs.registry import DEPARTED_KEEP_SECONDS, PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec import Unsupported, load_yaml
from tests.support.clock import ManualClock

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"


def _pods(name: str) -> dict[str, Any]:
    document = json.loads((FIXTURES / name).read_text())
    return {item["metadata"]["name"]: item for item in document["items"]}


def test_recorded_web_pod_gives_the_kubelets_probes() -> None:
    web = parse_pod(_pods("pods-running.json")["web-kd-node"], source="kubelet")
    assert (web.uid, web.namespace, web.name) == (
        "f177263d9de7365e9da06d5ff3b3399b",
        "shop",
        "web-kd-node",
    )
    assert web.termination_grace_seconds == 20
    assert web.restart_policy == "Always"
    assert web.phase == "Running"
    assert not web.deleting
    app = web.containers["app"]
    liveness = app.probe(ProbeKind.LIVENESS)
    assert liveness is not None
    assert liveness.http_get is not None
    # $(VAR) stays as written in an httpGet path: the kubelet expands only exec commands.
    assert liveness.http_get.path == "$(HEALTH_PATH)"
    assert liveness.http_get.port == "http"
    assert liveness.termination_grace_period_seconds == 7
    assert app.ports == {"http": 8080}
    assert app.env == {"MODE": "prod", "HEALTH_PATH": "/healthz"}
    startup = app.probe(ProbeKind.STARTUP)
    assert startup is not None
    assert startup.failure_threshold == 30
    worker = web.containers["worker"].probe(ProbeKind.LIVENESS)
    assert worker is not None
    assert worker.exec is not None
    assert worker.exec.command == ("cat", "/tmp/alive")


def test_recorded_batch_pod_keeps_its_init_container_out() -> None:
    batch = parse_pod(_pods("pods-running.json")["batch-kd-node"], source="kubelet")
    assert batch.restart_policy == "Never"
    assert set(batch.containers) == {"main"}
    assert batch.init_containers == {"setup"}
    readiness = batch.containers["main"].probe(ProbeKind.READINESS)
    assert readiness is not None
    assert readiness.success_threshold == 2


def test_static_manifest_is_named_like_the_kubelet_names_it() -> None:
    manifest = load_yaml((FIXTURES / "web.yaml").read_text(), source="web.yaml")
    spec = parse_pod(manifest, source="manifests", origin=PodOrigin.MANIFEST, node_name="kd-node")
    assert spec.label == "shop/web-kd-node"
    assert spec.uid == ""  # the kubelet's UID is a hash of the object; matched by name
    assert pod_key(manifest) == "shop/web"
    batch = load_yaml((FIXTURES / "batch.yaml").read_text(), source="batch.yaml")
    assert parse_pod(batch, source="m", origin=PodOrigin.MANIFEST, node_name="n").label == (
        "jobs/batch-n"
    )
    with pytest.raises(PodSpecError, match="node's name"):
        parse_pod(manifest, source="m", origin=PodOrigin.MANIFEST, node_name="")


def _web() -> dict[str, Any]:
    return copy.deepcopy(_pods("pods-running.json")["web-kd-node"])


def test_sidecar_deletion_and_value_from_env() -> None:
    pod = _web()
    pod["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = 5
    pod["spec"]["initContainers"] = [
        {
            "name": "proxy",
            "image": "busybox",
            "restartPolicy": "Always",
            "ports": [{"name": "admin", "containerPort": 15000}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "admin"}},
        },
        {"name": "migrate", "image": "busybox"},
    ]
    pod["spec"]["containers"][1]["env"] = [
        {"name": "A", "value": "1"},
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "A", "value": "2"},
    ]
    spec = parse_pod(pod, source="apiserver")
    assert spec.deleting
    assert spec.deletion_grace_seconds == 5
    assert spec.containers["proxy"].sidecar
    assert spec.containers["proxy"].ports == {"admin": 15000}
    assert spec.init_containers == {"migrate"}
    # The kubelet's EnvVarsToMap: later entries win; valueFrom counts as "".
    assert spec.containers["worker"].env == {"A": "2", "SECRET": ""}


def test_unknown_fields_are_ignored_outside_the_handler() -> None:
    pod = _web()
    pod["spec"]["containers"][0]["livenessProbe"]["futureField"] = True
    spec = parse_pod(pod, source="apiserver")
    probe = spec.containers["app"].probe(ProbeKind.LIVENESS)
    assert probe is not None
    assert probe.unsupported == ()


def _unsupported_of(handler: dict[str, Any]) -> tuple[Unsupported, ...]:
    pod = _web()
    pod["spec"]["containers"][0]["readinessProbe"] = handler
    probe = parse_pod(pod, source="apiserver").containers["app"].probe(ProbeKind.READINESS)
    assert probe is not None
    return probe.unsupported


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        # Invented fields in each handler, and in an httpHeaders entry.
        ({"grpc": {"port": 9000, "foo": 1}}, [Unsupported("grpc.foo")]),
        ({"httpGet": {"port": 80, "futureToo": 1}}, [Unsupported("httpGet.futureToo")]),
        ({"tcpSocket": {"port": 80, "x": None}}, [Unsupported("tcpSocket.x")]),
        ({"exec": {"command": ["true"], "user": 0}}, [Unsupported("exec.user")]),
        (
            {"httpGet": {"port": 80, "httpHeaders": [{"name": "A", "value": "", "enc": "b"}]}},
            [Unsupported("httpGet.httpHeaders[0].enc")],
        ),
        # A key that is no identifier is quoted, escaped.
        ({"grpc": {"port": 9000, "a b\n": 1}}, [Unsupported('grpc["a b\\n"]')]),
        # The 1.37 fields with values cri-prober does not know: gated, by their gate.
        (
            {"httpGet": {"port": 80, "protocol": "HTTP3"}},
            [Unsupported('httpGet.protocol "HTTP3"', gate="H2CContainerProbe")],
        ),
        (
            {"grpc": {"port": 9000, "mode": "mTLS"}},
            [Unsupported('grpc.mode "mTLS"', gate="GRPCContainerProbeTLS")],
        ),
        # Known values are no problem: they are fields of the model.
        ({"httpGet": {"port": 80, "protocol": "HTTP2"}}, []),
        ({"grpc": {"port": 9000, "mode": "TLS"}}, []),
        ({"grpc": {"port": 9000, "mode": "Plaintext"}}, []),
    ],
)
def test_unknown_handler_fields_mark_the_probe_unsupported(
    handler: dict[str, Any], expected: list[Unsupported]
) -> None:
    assert list(_unsupported_of(handler)) == expected


def test_known_probe_fields_of_1_37_are_read() -> None:
    pod = _web()
    pod["spec"]["containers"][0]["readinessProbe"] = {"grpc": {"port": 9000, "mode": "TLS"}}
    pod["spec"]["containers"][0]["startupProbe"] = {"httpGet": {"port": 80, "protocol": "HTTP2"}}
    app = parse_pod(pod, source="apiserver").containers["app"]
    readiness, startup = app.probe(ProbeKind.READINESS), app.probe(ProbeKind.STARTUP)
    assert readiness is not None
    assert readiness.grpc is not None
    assert readiness.grpc.mode == "TLS"
    assert startup is not None
    assert startup.http_get is not None
    assert startup.http_get.protocol == "HTTP2"


def test_unsupported_fields_are_bounded_and_change_the_spec() -> None:
    many = {"grpc": {"port": 9000, **{f"f{i}": i for i in range(50)}, "z" * 500: 1}}
    found = _unsupported_of(many)
    assert len(found) == 4
    assert found[-1] == Unsupported("48 more unknown fields")
    assert all(len(item.field) <= 80 for item in found)
    # A spec that gains an unknown field is a different spec (its workers are replaced).
    plain = parse_pod(_web(), source="apiserver").containers["app"].probe(ProbeKind.LIVENESS)
    pod = _web()
    pod["spec"]["containers"][0]["livenessProbe"]["httpGet"]["futureToo"] = 1
    marked = parse_pod(pod, source="apiserver").containers["app"].probe(ProbeKind.LIVENESS)
    assert marked is not None
    assert plain is not None
    assert marked != plain
    assert marked.unsupported == (Unsupported("httpGet.futureToo"),)


def test_errors_name_the_pod_and_the_field_path() -> None:
    pod = _web()
    pod["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = 70000
    pod["spec"]["containers"][1]["readinessProbe"] = {"exec": {"command": ["x"]}, "tcpSocket": {}}
    pod["spec"]["initContainers"] = [
        {"name": "setup", "startupProbe": {"exec": {"command": ["true"]}}}
    ]
    with pytest.raises(PodSpecError) as caught:
        parse_pod(pod, source="kubelet")
    text = str(caught.value)
    assert "pod shop/web-kd-node: spec.containers[0].livenessProbe.httpGet.port" in text
    assert "spec.containers[1].readinessProbe.tcpSocket: may not specify more than 1" in text
    assert "spec.initContainers[0].startupProbe: may not be set for init containers" in text
    with pytest.raises(PodSpecError, match=r"metadata.name: required"):
        parse_pod({"metadata": {}, "spec": {}}, source="x")
    with pytest.raises(PodSpecError, match="kind: must be Pod"):
        parse_pod({"kind": "Service", "metadata": {"name": "a"}, "spec": {}}, source="x")


@pytest.mark.parametrize(
    ("text", "kind", "target"),
    [
        ("kubelet", "kubelet", "https://127.0.0.1:10250/pods"),
        ("kubelet:http://127.0.0.1:10255/pods", "kubelet", "http://127.0.0.1:10255/pods"),
        ("apiserver", "apiserver", ""),
        ("manifests:/etc/kubernetes/manifests", "manifests", "/etc/kubernetes/manifests"),
    ],
)
def test_probes_from_values(text: str, kind: str, target: str) -> None:
    spec = parse_source(text)
    assert (spec.kind, spec.target) == (kind, target)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kubelet:127.0.0.1:10250", "must start with http"),
        ("apiserver:x", "takes no argument"),
        ("manifests", "needs a directory"),
        ("docker", "unknown source"),
    ],
)
def test_bad_probes_from_values(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_source(text)


class _ListedSource(PodSource):
    """A source whose listings the test hands in directly."""

    def __init__(self, name: str, origin: PodOrigin = PodOrigin.API, **kwargs: Any) -> None:
        self.origin = origin
        super().__init__(name, stale_after=10, **kwargs)

    async def run(self, changed: Changed) -> None:
        raise NotImplementedError


def test_registry_matches_by_uid_then_static_name_and_remembers_departures() -> None:
    clock = ManualClock()
    api = _ListedSource("kubelet", clock=clock)
    files = _ListedSource("manifests", PodOrigin.MANIFEST, node_name="kd-node", clock=clock)
    registry = PodSpecs([api, files], clock=clock)
    pods = _pods("pods-running.json")
    api.replace_all([pods["batch-kd-node"]])
    files.replace_all([load_yaml((FIXTURES / "web.yaml").read_text(), source="web.yaml")])
    registry.rebuild()
    batch = registry.lookup("2a55a2aecce1cdf9b9a4c4197da463d8", "jobs", "whatever")
    assert batch is not None
    assert batch.name == "batch-kd-node"
    # A static pod file has no UID: the sandbox's namespace/name finds it.
    web = registry.lookup("f177263d9de7365e9da06d5ff3b3399b", "shop", "web-kd-node")
    assert web is not None
    assert web.source == "manifests"
    assert not web.deleting
    assert registry.lookup("nope", "shop", "other") is None

    # The file is removed: the pod left its source, and is being torn down.
    files.replace_all([])
    registry.rebuild()
    gone = registry.lookup("f177263d9de7365e9da06d5ff3b3399b", "shop", "web-kd-node")
    assert gone is not None
    assert gone.deleting
    # Kept while the node shows the pod, then forgotten once it is gone for long enough.
    clock.now += DEPARTED_KEEP_SECONDS + 1
    registry.retain({"shop/web-kd-node"})
    assert registry.lookup("", "shop", "web-kd-node") is not None
    registry.retain(set())
    assert registry.lookup("", "shop", "web-kd-node") is None


def test_registry_reports_stale_sources() -> None:
    clock = ManualClock()
    api = _ListedSource("kubelet", clock=clock)
    registry = PodSpecs([api], clock=clock)
    seen: list[tuple[str, ...]] = []
    registry.freshness.subscribe(seen.append)
    assert registry.stale_sources == ("kubelet",)  # no good read yet
    api.succeeded()
    registry.check_staleness()
    assert not registry.stale_sources
    assert seen == [()]
    api.failed("connection refused")
    clock.now += 11
    registry.check_staleness()
    assert registry.stale_sources == ("kubelet",)
    assert "connection refused" in registry.staleness()[0]
    assert seen == [(), ("kubelet",)]


def test_invalid_pod_keeps_its_last_good_spec() -> None:
    api = _ListedSource("kubelet")
    web = _web()
    assert api.replace_all([web])
    broken = copy.deepcopy(web)
    broken["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = -1
    assert not api.replace_all([broken])
    kept = api.pods["f177263d9de7365e9da06d5ff3b3399b"]
    liveness = kept.containers["app"].probe(ProbeKind.LIVENESS)
    assert liveness is not None
    assert liveness.period_seconds == 5
    assert api.invalid_pods == 0  # it has a good spec
    fresh = _ListedSource("kubelet")
    fresh.replace_all([broken])
    assert fresh.pods == {}
    assert fresh.invalid_pods == 1


def test_mirror_pod_is_matched_by_the_static_pods_uid() -> None:
    """The API server shows a static pod as a mirror pod with a UID of its own; CRI runs the
    static pod, whose UID (the config hash) the mirror annotation carries."""
    pod = _web()
    pod["metadata"]["uid"] = "0b0e5f1c-mirror-own-uid"
    pod["metadata"]["annotations"]["kubernetes.io/config.mirror"] = (
        "f177263d9de7365e9da06d5ff3b3399b"
    )
    assert parse_pod(pod, source="apiserver").uid == "f177263d9de7365e9da06d5ff3b3399b"


def test_container_restart_policy_and_rules_are_read_and_bounded() -> None:
    """KEP-5307's container-level restartPolicy and restartPolicyRules, as
    podutil.ContainerShouldRestart (pkg/api/v1/pod/util.go, release-1.35) reads them; a rule
    list past the API's bounds is refused with its field path."""
    pod = _web()
    worker = pod["spec"]["containers"][1]
    worker["restartPolicy"] = "OnFailure"
    worker["restartPolicyRules"] = [
        {"action": "Restart", "exitCodes": {"operator": "In", "values": [0]}},
        {"action": "SomeLaterAction", "exitCodes": {"operator": "NotIn", "values": [0]}},
        {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": []}},
    ]
    spec = parse_pod(pod, source="apiserver")
    container = spec.containers["worker"]
    assert container.restart_policy == "OnFailure"
    assert container.should_restart("Never", 0)  # the first rule, though OnFailure says no
    # A failed exit matches the unknown action first: the container's policy decides.
    assert container.should_restart("Never", 3)
    assert not container.restarts_all_on(3)
    # Without a container policy, the rules are not read and the pod's policy decides.
    assert spec.containers["app"].restart_policy is None
    assert not spec.containers["app"].should_restart("OnFailure", 0)
    assert spec.containers["app"].should_restart("OnFailure", 1)

    worker["restartPolicy"] = "Sometimes"
    worker["restartPolicyRules"] = [
        {"action": "Restart", "exitCodes": {"operator": "In", "values": list(range(300))}},
        {"action": "Restart", "exitCodes": {"operator": "Maybe", "values": [1]}},
    ]
    with pytest.raises(PodSpecError) as caught:
        parse_pod(pod, source="apiserver")
    text = str(caught.value)
    assert "spec.containers[1].restartPolicy: must be Always, OnFailure or Never" in text
    assert "spec.containers[1].restartPolicyRules[0].exitCodes.values: must be a list" in text
    assert "spec.containers[1].restartPolicyRules[1].exitCodes.operator: must be In or" in text
    worker["restartPolicy"] = "Never"
    worker["restartPolicyRules"] = [{"action": "Restart", "exitCodes": {"operator": "In"}}] * 21
    with pytest.raises(PodSpecError, match=r"restartPolicyRules: at most 20 rules, not 21"):
        parse_pod(pod, source="apiserver")
