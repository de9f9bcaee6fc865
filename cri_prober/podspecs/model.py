"""A pod's spec as the kubelet holds it, cut down to what its prober uses: probes, named ports,
static env, grace periods, restart policy, phase and deletion; parsed from a core/v1 Pod object.

Probes are validated with the same models as the rules file, and every problem is reported with
its field path inside the pod (``spec.containers[0].livenessProbe.httpGet.port: ...``).
"""

from __future__ import annotations

import datetime
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import BaseModel

from cri_prober.errors import CriProberError
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.mirror import KubeletStatus
from cri_prober.probing.spec import (
    GRPC_MODES,
    HTTP_PROTOCOLS,
    ExecAction,
    GRPCAction,
    HTTPGetAction,
    HTTPHeader,
    Probe,
    SpecError,
    TCPSocketAction,
    Unsupported,
    parse_probe,
)

__all__ = [
    "CONFIG_SEEN_ANNOTATION",
    "CONFIG_SOURCE_ANNOTATION",
    "DEFAULT_NAMESPACE",
    "PodOrigin",
    "PodSpec",
    "PodSpecError",
    "SpecContainer",
    "parse_pod",
    "pod_key",
]

DEFAULT_NAMESPACE: Final = "default"
# On a mirror pod (the API server's copy of a static pod): the static pod's UID (its config hash).
MIRROR_ANNOTATION: Final = "kubernetes.io/config.mirror"
# Set by the kubelet on its own copy of every pod (so in its /pods, and on a mirror pod): when it
# first saw the pod, RFC 3339 with nanoseconds. It admits the pod and starts its probe workers
# (their tickers) right after: the phase of the kubelet's probe grid (D4, D9).
CONFIG_SEEN_ANNOTATION: Final = "kubernetes.io/config.seen"
# Set by the kubelet on its own copy of every pod: the config source it came from, "api" or, for
# a static pod, "file" or "http" (kubetypes.IsStaticPod: any source but the API server's).
CONFIG_SOURCE_ANNOTATION: Final = "kubernetes.io/config.source"
_STATIC_SOURCES: Final = frozenset({"file", "http"})
_RFC3339: Final = re.compile(
    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)", re.ASCII
)
# The API's default for spec.terminationGracePeriodSeconds.
DEFAULT_TERMINATION_GRACE: Final = 30

_PROBE_KEYS: Final = {
    ProbeKind.LIVENESS: "livenessProbe",
    ProbeKind.READINESS: "readinessProbe",
    ProbeKind.STARTUP: "startupProbe",
}


class PodOrigin(enum.StrEnum):
    """Where a pod came from, which decides how it is matched to CRI sandboxes."""

    API = "api"  # the API server, or the kubelet's /pods: UIDs are the ones in CRI
    MANIFEST = "manifest"  # a static pod file read by cri-prober: the UID is the kubelet's hash


class PodSpecError(CriProberError):
    """A pod object cri-prober cannot use: one ``<field path>: <rule>`` line per problem."""

    def __init__(self, pod: str, messages: list[str]) -> None:
        self.pod = pod
        self.messages = messages
        super().__init__("\n".join(f"pod {pod}: {message}" for message in messages))


# The API's bounds on restartPolicyRules (validation of KEP-5307): at most 20 rules, each with
# at most 255 exit codes; a pod spec past them is refused rather than held unbounded.
MAX_RESTART_RULES: Final = 20
MAX_RULE_EXIT_CODES: Final = 255
_RULE_ACTIONS: Final = ("Restart", "RestartAllContainers")


@dataclass(frozen=True, slots=True)
class RestartRule:
    """One of a container's ``restartPolicyRules``: ``action`` when the exit code is ``In`` (or
    ``NotIn``) ``values``."""

    action: str
    operator: str
    values: frozenset[int]

    def matches(self, exit_code: int) -> bool:
        return (exit_code in self.values) is (self.operator == "In")


@dataclass(frozen=True, slots=True)
class SpecContainer:
    """One container of a pod spec: its probes, named ports and static env."""

    name: str
    probes: Mapping[ProbeKind, Probe]
    # Port numbers by name, the first of each name as the kubelet's findPortByName takes it.
    ports: Mapping[str, int] = field(default_factory=dict)
    # Every env name with its static ``value``; ``valueFrom`` variables map to "", as in the
    # kubelet's ExpandContainerCommandOnlyStatic (its $(VAR) expansion of probe commands).
    env: Mapping[str, str] = field(default_factory=dict)
    # A restartable init container (a sidecar): probed like a regular container.
    sidecar: bool = False
    # KEP-5307: the container's own restartPolicy ("Always", "OnFailure", "Never"; None: the
    # pod's) and its restartPolicyRules, in order.
    restart_policy: str | None = None
    restart_rules: tuple[RestartRule, ...] = ()

    def should_restart(self, pod_policy: str, exit_code: int) -> bool:
        """Whether an exit with ``exit_code`` is restarted, by KEP-5307's rules: kubernetes
        ``pkg/api/v1/pod/util.go`` ``ContainerShouldRestart`` (release-1.35): the first rule
        that matches the exit code (only with a container-level policy) restarts when its action
        is ``Restart``; else the container's policy, else the pod's."""
        if self.restart_policy is not None:
            for rule in self.restart_rules:
                if rule.matches(exit_code):
                    if rule.action == "Restart":
                        return True
                    break  # another action (RestartAllContainers): the policy decides
            policy = self.restart_policy
        else:
            policy = pod_policy
        if policy == "Never":
            return False
        if policy == "OnFailure":
            return exit_code != 0
        return True

    def restarts_all_on(self, exit_code: int) -> bool:
        """KEP-5532: the first rule matching ``exit_code`` says ``RestartAllContainers``."""
        if self.restart_policy is None:
            return False
        for rule in self.restart_rules:
            if rule.matches(exit_code):
                return rule.action == "RestartAllContainers"
        return False

    def probe(self, kind: ProbeKind) -> Probe | None:
        """The probe of type *kind*, if the spec has one."""
        return self.probes.get(kind)

    @property
    def named_ports(self) -> Mapping[str, int]:
        """Port numbers by name (the ``ProbeProvider`` protocol of ``select_probes``)."""
        return self.ports


@dataclass(frozen=True, slots=True)
class PodSpec:
    """What the kubelet's prober knows of a pod beyond CRI."""

    uid: str  # "" for a static pod file without metadata.uid (matched by name instead)
    namespace: str
    name: str
    origin: PodOrigin
    source: str  # the source that reported it, for `ps`/`inspect` and logs
    restart_policy: str = "Always"
    phase: str = ""  # status.phase; "" when the source has no status (a manifest)
    deleting: bool = False  # metadata.deletionTimestamp is set
    deletion_grace_seconds: int | None = None  # metadata.deletionGracePeriodSeconds
    termination_grace_seconds: int = DEFAULT_TERMINATION_GRACE
    # Regular containers and restartable init containers, by name; ordinary init containers
    # are not here: the kubelet never probes them.
    containers: Mapping[str, SpecContainer] = field(default_factory=dict)
    init_containers: frozenset[str] = frozenset()  # names of the ordinary init containers
    # When the kubelet first saw the pod (CONFIG_SEEN_ANNOTATION), wall-clock seconds; None when
    # the source does not say (the API server's pods but mirror pods, manifest files).
    admitted_at: float | None = None
    # The kubelet lists it as a static pod (CONFIG_SOURCE_ANNOTATION "file" or "http"): it
    # leaves the kubelet's /pods only when its manifest is gone, and then the kubelet is
    # terminating it (no deletionTimestamp ever shows), so it gets no missing-pod grace.
    static: bool = False
    # serve --mirror: the kubelet's ready and started of each container (regular and init,
    # by name), from a source that keeps the pod status (KubeletSource(keep_statuses=True)).
    statuses: Mapping[str, KubeletStatus] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``namespace/name``, as logs and messages show a pod."""
        return f"{self.namespace}/{self.name}"

    @property
    def finished(self) -> bool:
        """The pod is over (phase Succeeded or Failed): the kubelet's workers end silently."""
        return self.phase in ("Succeeded", "Failed")


def pod_key(obj: object) -> str | None:
    """The key a source files a raw pod object under: its UID, else ``namespace/name``.

    Needs no valid spec, so a pod that fails validation can still keep its last good view.
    """
    if not isinstance(obj, Mapping):
        return None
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    uid = metadata.get("uid")
    if isinstance(uid, str) and uid:
        return uid
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = metadata.get("namespace")
    return f"{namespace if isinstance(namespace, str) and namespace else DEFAULT_NAMESPACE}/{name}"


def parse_pod(
    obj: object,
    *,
    source: str,
    origin: PodOrigin = PodOrigin.API,
    node_name: str = "",
) -> PodSpec:
    """Read a core/v1 Pod object (decoded JSON or YAML) into a ``PodSpec``.

    With ``origin=MANIFEST`` the pod is named as the kubelet names a static pod,
    ``<metadata.name>-<node_name>``, in namespace ``default`` unless it sets one.

    Unknown fields are ignored, as a newer API's pods may carry them, except in a probe's
    handler: there they mark the probe unsupported (``Probe.unsupported``), and it is not run.
    Probes are validated as in the rules file.

    Raises:
        PodSpecError: the object is not a pod cri-prober can use, or a probe breaks a rule.
    """
    parser = _PodParser(source, origin, node_name)
    return parser.parse(obj)


class _PodParser:
    def __init__(self, source: str, origin: PodOrigin, node_name: str) -> None:
        self.source = source
        self.origin = origin
        self.node_name = node_name
        self.errors: list[str] = []
        self.label = "?"

    def parse(self, obj: object) -> PodSpec:
        if not isinstance(obj, Mapping):
            raise PodSpecError(self.label, ["must be an object"])
        kind = obj.get("kind")
        if kind is not None and kind != "Pod":
            raise PodSpecError(self.label, [f"kind: must be Pod, not {_show(kind)}"])
        metadata = self._mapping(obj, "metadata", "metadata", required=True)
        spec = self._mapping(obj, "spec", "spec", required=True)
        status = self._mapping(obj, "status", "status")

        name = self._string(metadata, "name", "metadata.name", required=True)
        namespace = self._string(metadata, "namespace", "metadata.namespace") or DEFAULT_NAMESPACE
        if self.origin == PodOrigin.MANIFEST and name:
            if not self.node_name:
                raise PodSpecError(
                    f"{namespace}/{name}",
                    ["a static pod needs the node's name (serve --node-name or NODE_NAME)"],
                )
            name = f"{name}-{self.node_name}"
        self.label = f"{namespace}/{name or '?'}"
        uid = self._string(metadata, "uid", "metadata.uid")
        annotations = self._mapping(metadata, "annotations", "metadata.annotations")
        mirror_of = annotations.get(MIRROR_ANNOTATION)
        if isinstance(mirror_of, str) and mirror_of:
            # The API server shows a static pod as its mirror pod, whose UID is its own; the
            # kubelet runs (and CRI shows) the static pod, whose UID the mirror annotation holds.
            uid = mirror_of
        seen = annotations.get(CONFIG_SEEN_ANNOTATION)
        # Informative only: a value that does not parse leaves the anchor to the sandbox.
        admitted_at = _timestamp(seen) if isinstance(seen, str) else None
        deleting = metadata.get("deletionTimestamp") is not None
        # A manifest read by cri-prober (origin MANIFEST) carries no kubelet annotation that
        # counts: only the kubelet's copy of the pod says where the kubelet got it.
        static = (
            self.origin != PodOrigin.MANIFEST
            and annotations.get(CONFIG_SOURCE_ANNOTATION) in _STATIC_SOURCES
        )
        deletion_grace = self._integer(
            metadata, "deletionGracePeriodSeconds", "metadata.deletionGracePeriodSeconds"
        )
        grace = self._integer(
            spec, "terminationGracePeriodSeconds", "spec.terminationGracePeriodSeconds"
        )
        restart_policy = self._string(spec, "restartPolicy", "spec.restartPolicy") or "Always"
        if restart_policy not in ("Always", "OnFailure", "Never"):
            self.errors.append(
                "spec.restartPolicy: must be Always, OnFailure or Never, "
                f"not {_show(restart_policy)}"
            )
        phase = self._string(status, "phase", "status.phase")

        containers: dict[str, SpecContainer] = {}
        for index, raw in enumerate(self._list(spec, "containers", "spec.containers")):
            container = self._container(raw, f"spec.containers[{index}]", sidecar=False)
            if container is not None:
                self._add(containers, container, f"spec.containers[{index}].name")
        plain_inits: set[str] = set()
        for index, raw in enumerate(self._list(spec, "initContainers", "spec.initContainers")):
            path = f"spec.initContainers[{index}]"
            restartable = isinstance(raw, Mapping) and raw.get("restartPolicy") == "Always"
            if restartable:
                container = self._container(raw, path, sidecar=True)
                if container is not None:
                    self._add(containers, container, f"{path}.name")
            elif isinstance(raw, Mapping):
                # The API refuses probes on an ordinary init container, and the kubelet never
                # runs any: a manifest that has them gets them reported, not run.
                for key in _PROBE_KEYS.values():
                    if raw.get(key) is not None:
                        self.errors.append(
                            f"{path}.{key}: may not be set for init containers without "
                            "restartPolicy=Always"
                        )
                init_name = raw.get("name")
                if isinstance(init_name, str):
                    plain_inits.add(init_name)
        statuses = self._statuses(status)
        if self.errors:
            raise PodSpecError(self.label, self.errors)
        return PodSpec(
            uid=uid,
            namespace=namespace,
            name=name,
            origin=self.origin,
            source=self.source,
            restart_policy=restart_policy,
            phase=phase,
            deleting=deleting,
            deletion_grace_seconds=deletion_grace,
            termination_grace_seconds=DEFAULT_TERMINATION_GRACE if grace is None else grace,
            containers=containers,
            init_containers=frozenset(plain_inits),
            admitted_at=admitted_at,
            static=static,
            statuses=statuses,
        )

    def _statuses(self, status: Mapping[str, Any]) -> dict[str, KubeletStatus]:
        """Ready and started of each container with a container ID (informative: an entry of
        the wrong shape is left out, never an error, as the kubelet's status is not a spec)."""
        found: dict[str, KubeletStatus] = {}
        for key in ("initContainerStatuses", "containerStatuses"):
            entries = status.get(key)
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if not isinstance(entry, Mapping):
                    continue
                name, container_id = entry.get("name"), entry.get("containerID")
                ready, started = entry.get("ready"), entry.get("started")
                if not isinstance(name, str) or not isinstance(container_id, str):
                    continue
                found[name] = KubeletStatus(
                    container_id=container_id.partition("://")[2] or container_id,
                    ready=ready is True,
                    started=started if isinstance(started, bool) else None,
                )
        return found

    def _add(
        self, containers: dict[str, SpecContainer], container: SpecContainer, path: str
    ) -> None:
        if container.name in containers:
            self.errors.append(f"{path}: duplicate value {_show(container.name)}")
        containers[container.name] = container

    def _container(self, raw: object, path: str, *, sidecar: bool) -> SpecContainer | None:
        if not isinstance(raw, Mapping):
            self.errors.append(f"{path}: must be an object")
            return None
        name = self._string(raw, "name", f"{path}.name", required=True)
        probes: dict[ProbeKind, Probe] = {}
        for kind, key in _PROBE_KEYS.items():
            data = raw.get(key)
            if data is None:
                continue
            known, unsupported = _known_fields(data)
            try:
                probe = parse_probe(known, kind=kind, path=f"{path}.{key}")
            except SpecError as exc:
                self.errors.extend(exc.messages)
            else:
                probes[kind] = probe.with_unsupported(_bounded(unsupported))
        ports: dict[str, int] = {}
        for index, port in enumerate(self._list(raw, "ports", f"{path}.ports")):
            if not isinstance(port, Mapping):
                self.errors.append(f"{path}.ports[{index}]: must be an object")
                continue
            port_name = port.get("name")
            number = port.get("containerPort")
            if not isinstance(number, int) or isinstance(number, bool):
                self.errors.append(f"{path}.ports[{index}].containerPort: must be an integer")
                continue
            if isinstance(port_name, str) and port_name:
                ports.setdefault(port_name, number)
        env: dict[str, str] = {}
        for index, var in enumerate(self._list(raw, "env", f"{path}.env")):
            if not isinstance(var, Mapping) or not isinstance(var.get("name"), str):
                self.errors.append(f"{path}.env[{index}].name: required")
                continue
            value = var.get("value")
            # Later entries win, and a valueFrom variable counts as "" (the kubelet's
            # EnvVarsToMap reads only .value).
            env[var["name"]] = value if isinstance(value, str) else ""
        restart_policy: str | None = None
        rules: tuple[RestartRule, ...] = ()
        if not sidecar:
            # A sidecar's restartPolicy is Always by definition (and rules are refused there).
            restart_policy = self._string(raw, "restartPolicy", f"{path}.restartPolicy") or None
            if restart_policy not in (None, "Always", "OnFailure", "Never"):
                self.errors.append(
                    f"{path}.restartPolicy: must be Always, OnFailure or Never, "
                    f"not {_show(restart_policy)}"
                )
            rules = self._restart_rules(raw, f"{path}.restartPolicyRules")
        return SpecContainer(
            name=name,
            probes=probes,
            ports=ports,
            env=env,
            sidecar=sidecar,
            restart_policy=restart_policy,
            restart_rules=rules,
        )

    def _restart_rules(self, raw: Mapping[str, Any], path: str) -> tuple[RestartRule, ...]:
        items = self._list(raw, "restartPolicyRules", path)
        if len(items) > MAX_RESTART_RULES:
            self.errors.append(f"{path}: at most {MAX_RESTART_RULES} rules, not {len(items)}")
            return ()
        rules: list[RestartRule] = []
        for index, item in enumerate(items):
            where = f"{path}[{index}]"
            if not isinstance(item, Mapping):
                self.errors.append(f"{where}: must be an object")
                continue
            action = item.get("action")
            if not isinstance(action, str):
                self.errors.append(f"{where}.action: must be a string")
                continue
            # An action of a later release counts as neither: as the kubelet's default case,
            # the matched rule then leaves the decision to the restart policy.
            action = action if action in _RULE_ACTIONS else ""
            codes = item.get("exitCodes")
            operator = codes.get("operator") if isinstance(codes, Mapping) else None
            values = codes.get("values") if isinstance(codes, Mapping) else None
            if operator not in ("In", "NotIn"):
                self.errors.append(
                    f"{where}.exitCodes.operator: must be In or NotIn, not {_show(operator)}"
                )
                continue
            if values is None:
                values = []
            if (
                not isinstance(values, list)
                or len(values) > MAX_RULE_EXIT_CODES
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
            ):
                self.errors.append(
                    f"{where}.exitCodes.values: must be a list of at most "
                    f"{MAX_RULE_EXIT_CODES} integers"
                )
                continue
            rules.append(RestartRule(action=action, operator=operator, values=frozenset(values)))
        return tuple(rules)

    # -- small readers that report with field paths ------------------------------------------

    def _mapping(
        self, obj: Mapping[str, Any], key: str, path: str, *, required: bool = False
    ) -> Mapping[str, Any]:
        value = obj.get(key)
        if value is None:
            if required:
                self.errors.append(f"{path}: required")
            return {}
        if not isinstance(value, Mapping):
            self.errors.append(f"{path}: must be an object")
            return {}
        return value

    def _list(self, obj: Mapping[str, Any], key: str, path: str) -> list[Any]:
        value = obj.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            self.errors.append(f"{path}: must be a list")
            return []
        return value

    def _string(
        self, obj: Mapping[str, Any], key: str, path: str, *, required: bool = False
    ) -> str:
        value = obj.get(key)
        if value is None or value == "":
            if required:
                self.errors.append(f"{path}: required")
            return ""
        if not isinstance(value, str):
            self.errors.append(f"{path}: must be a string")
            return ""
        return value

    def _integer(self, obj: Mapping[str, Any], key: str, path: str) -> int | None:
        value = obj.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.errors.append(f"{path}: must be a non-negative integer")
            return None
        return value


# The handler models below a Probe: their unknown keys are kept (by name) as Unsupported.
_NESTED: Final[dict[str, type[BaseModel]]] = {
    "exec": ExecAction,
    "httpGet": HTTPGetAction,
    "tcpSocket": TCPSocketAction,
    "grpc": GRPCAction,
}
# The 1.37 fields whose value decides how a probe is sent, with their values cri-prober knows
# and the kubelet gate that honours them (a kubelet without it ignores the field).
_GATED_VALUES: Final[dict[tuple[str, str], tuple[tuple[str, ...], str]]] = {
    ("httpGet", "protocol"): (HTTP_PROTOCOLS, "H2CContainerProbe"),
    ("grpc", "mode"): (GRPC_MODES, "GRPCContainerProbeTLS"),
}
# A probe names at most this many unsupported fields, each cut to this many characters: the
# keys are the pod author's text, and a worker keeps them for the pod's life.
MAX_UNSUPPORTED_NAMED: Final = 4
MAX_FIELD_NAME_CHARS: Final = 64
_KEY: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _known_fields(data: object) -> tuple[object, list[Unsupported]]:
    """A probe's ``data`` cut to the fields cri-prober knows, and what it cut from the handler.

    A pod from a newer API server may carry probe fields this version does not know. Outside
    the handler (a probe's own keys) they are left out: none changes what is sent. Inside it
    (the exec/httpGet/tcpSocket/grpc object and its httpHeaders entries) an unknown key, or a
    known 1.37 field with a value cri-prober does not know, may change how the kubelet probes:
    it is returned as Unsupported, and the probe is not run rather than run differently.
    """
    if not isinstance(data, Mapping):
        return data, []
    found: list[Unsupported] = []
    kept: dict[str, object] = {}
    known = {f.alias or name for name, f in Probe.model_fields.items()}
    for key, value in data.items():
        if key not in known:
            continue
        nested = _NESTED.get(key)
        if nested is not None and isinstance(value, Mapping):
            value = _handler_fields(key, value, nested, found)
        kept[key] = value
    return kept, found


def _handler_fields(
    name: str, data: Mapping[str, Any], model: type[BaseModel], found: list[Unsupported]
) -> dict[str, object]:
    kept: dict[str, object] = {}
    known = {f.alias or field_name for field_name, f in model.model_fields.items()}
    for key, value in data.items():
        if key not in known:
            found.append(Unsupported(_field_name(name, key)))
            continue
        gated = _GATED_VALUES.get((name, key))
        if gated is not None and isinstance(value, str) and value and value not in gated[0]:
            shown = _show(value[:MAX_FIELD_NAME_CHARS])
            found.append(Unsupported(f"{name}.{key} {shown}", gate=gated[1]))
            continue
        if key == "httpHeaders" and isinstance(value, list):
            headers = []
            for index, header in enumerate(value):
                if isinstance(header, Mapping):
                    header_known = {f.alias or n for n, f in HTTPHeader.model_fields.items()}
                    for extra in header.keys() - header_known:
                        found.append(
                            Unsupported(_field_name(f"{name}.httpHeaders[{index}]", extra))
                        )
                    header = {k: v for k, v in header.items() if k in header_known}
                headers.append(header)
            value = headers
        kept[key] = value
    return kept


def _field_name(parent: str, key: object) -> str:
    """``parent.key`` for a person to read: a key that is no identifier is quoted (escaped)."""
    text = str(key)[:MAX_FIELD_NAME_CHARS]
    if _KEY.fullmatch(text):
        return f"{parent}.{text}"
    return f"{parent}[{json.dumps(text)}]"


def _bounded(found: list[Unsupported]) -> list[Unsupported]:
    """At most MAX_UNSUPPORTED_NAMED entries, in order: fields the kubelet's gates decide on
    first (they are few), then unknown ones, the last saying how many more were left out."""
    ordered = sorted(found, key=lambda item: item.gate is None)
    if len(ordered) <= MAX_UNSUPPORTED_NAMED:
        return ordered
    kept = ordered[: MAX_UNSUPPORTED_NAMED - 1]
    rest = len(ordered) - len(kept)
    return [*kept, Unsupported(f"{rest} more unknown fields")]


def _timestamp(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time with up to nanoseconds (Go's RFC3339Nano,
    which drops trailing zeros); None when it is not one."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    whole, fraction, zone = match.groups()
    try:
        moment = datetime.datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    except ValueError:
        return None
    return moment.timestamp() + (int(fraction.ljust(9, "0")) / 1e9 if fraction else 0.0)


def _show(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:64]
