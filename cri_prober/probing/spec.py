"""Probe specs as users write them: the Kubernetes core/v1 Probe with the API server's defaults and
validation, the ``--config`` rules file and the per-pod annotation override, plus the pure
functions that pick a container's probes and resolve named ports.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Protocol, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainValidator,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from cri_prober.errors import CriProberError
from cri_prober.files import UnsafeFile, read_regular_file
from cri_prober.probing import outcome
from cri_prober.probing.kinds import ProbeKind

__all__ = [
    "ANNOTATION_MAX_BYTES",
    "KUBELET_PORTS_ANNOTATION",
    "RULES_FILE_MAX_BYTES",
    "YAML_ALIAS_BUDGET",
    "YAML_MAX_DEPTH",
    "ContainerOverride",
    "ContainerPort",
    "ExecAction",
    "GRPCAction",
    "HTTPGetAction",
    "HTTPHeader",
    "Match",
    "Probe",
    "ProbeKind",
    "ProbeOrigin",
    "ProbeProvider",
    "ResolvedProbe",
    "Rule",
    "RulesFile",
    "SpecError",
    "TCPSocketAction",
    "format_errors",
    "load_rules",
    "load_yaml",
    "parse_annotation",
    "parse_probe",
    "parse_probe_json",
    "read_rules_file",
    "resolve_port",
    "select_probes",
]

# The container annotation in which the kubelet records the container's `ports` as a JSON array.
KUBELET_PORTS_ANNOTATION: Final = "io.kubernetes.container.ports"

_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1
_MAX_PORT: Final = 65535

# Every check of our own raises this error type; format_errors shows its message as is.
_RULE: Final = "spec"

# Messages for pydantic's own errors, in the API server's terse style.
_PYDANTIC_MESSAGES: Final = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "invalid_key": "keys must be strings",
    "int_type": "must be an integer",
    "string_type": "must be a string",
    "tuple_type": "must be a list",
}

_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PORT_NAME_CHARS: Final = re.compile(r"[-a-z0-9]{1,15}")
# apimachinery's IsHTTPHeaderName: stricter than an RFC 7230 token, and it is what the API accepts.
_HTTP_HEADER_NAME: Final = re.compile(r"[-A-Za-z0-9]+")

_M = TypeVar("_M", bound=BaseModel)


class SpecError(CriProberError):
    """A probe spec, rules file or override annotation broke the rules: one message per problem."""

    def __init__(self, messages: Sequence[str], *, source: str | None = None) -> None:
        self.messages = list(messages)
        self.source = source
        super().__init__("\n".join(self.lines))

    @property
    def lines(self) -> list[str]:
        """The messages, each led by the source when known (``rules.yaml: probes[1]...``)."""
        prefix = f"{self.source}: " if self.source else ""
        return [prefix + message for message in self.messages]


def _is_port_name(name: str) -> bool:
    """Tell whether *name* is a valid IANA_SVC_NAME, the syntax of a named container port."""
    return (
        _PORT_NAME_CHARS.fullmatch(name) is not None
        and re.search("[a-z]", name) is not None
        and not name.startswith("-")
        and not name.endswith("-")
        and "--" not in name
    )


def format_errors(error: ValidationError, *, path: str = "") -> list[str]:
    """Turn *error* into ``<field path>: <rule>`` messages, the path in camelCase below *path*."""
    messages = []
    for detail in error.errors():
        where = _render_path(path, detail["loc"])
        rule = _PYDANTIC_MESSAGES.get(detail["type"], detail["msg"])
        messages.append(f"{where}: {rule}" if where else rule)
    return messages


def _render_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _IDENTIFIER.fullmatch(part):
            path += f".{part}" if path else part
        else:
            # Map keys such as label names may contain dots; Kubernetes writes them in brackets.
            path += f"[{part}]"
    return path


def _rule(message: str) -> PydanticCustomError:
    return PydanticCustomError(_RULE, message)


def _line_error(loc: tuple[int | str, ...], value: object, message: str) -> InitErrorDetails:
    return {"type": _rule(message), "loc": loc, "input": value}


def _show(value: int | str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _validate_with(
    handler: ModelWrapValidatorHandler[_M],
    data: object,
    errors: list[InitErrorDetails],
    *,
    title: str,
) -> _M:
    """Run pydantic's validation of *data* and report *errors* together with whatever it finds.

    A model validator can raise only one error, and an "after" one never runs when a field is
    invalid; merging keeps every problem in one report, as the API server gives it.
    """
    try:
        model = handler(data)
    except ValidationError as exc:
        found: list[InitErrorDetails] = [
            {
                "type": PydanticCustomError(detail["type"], detail["msg"]),
                "loc": detail["loc"],
                "input": detail["input"],
            }
            for detail in exc.errors()
        ]
        raise ValidationError.from_exception_data(title, [*found, *errors]) from None
    if errors:
        raise ValidationError.from_exception_data(title, errors)
    return model


def _non_negative_int32(value: int) -> int:
    if value < 0:
        raise _rule("must be >= 0")
    if value > _INT32_MAX:
        raise _rule(f"must be <= {_INT32_MAX}")
    return value


def _positive_int64(value: int) -> int:
    if value <= 0:
        raise _rule("must be greater than 0")
    if value > _INT64_MAX:
        raise _rule(f"must be <= {_INT64_MAX}")
    return value


def _zero_means(default: int) -> Callable[[int], int]:
    """Apply the API's defaulting: an explicit 0 is the same as leaving the field out."""

    def apply(value: int) -> int:
        return value or default

    return apply


def _port_number(value: int) -> int:
    if not 1 <= value <= _MAX_PORT:
        raise _rule(f"must be a port number 1-{_MAX_PORT} (got {value})")
    return value


def _port_number_or_name(value: object) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _rule("must be a port number or name")
    valid = _is_port_name(value) if isinstance(value, str) else 1 <= value <= _MAX_PORT
    if not valid:
        raise _rule(f"must be a valid port name or number 1-{_MAX_PORT} (got {_show(value)})")
    return value


def _grpc_port(value: object) -> int:
    if isinstance(value, str):
        raise _rule(f"must be a port number; gRPC probes take no port names (got {_show(value)})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _rule("must be an integer")
    return _port_number(value)


def _port_name(value: str) -> str:
    if not _is_port_name(value):
        raise _rule(
            "must be a valid port name: 1-15 of [-a-z0-9], at least one letter, "
            f"no leading, trailing or double '-' (got {_show(value)})"
        )
    return value


def _one_of(*allowed: str, default: str) -> Callable[[str], str]:
    """Default an empty string, then accept only *allowed* (case-sensitive, as the API is)."""
    choices = ", ".join(_show(choice) for choice in allowed)

    def check(value: str) -> str:
        value = value or default
        if value not in allowed:
            raise _rule(f"must be one of {choices} (got {_show(value)})")
        return value

    return check


def _http_header_name(value: str) -> str:
    if not _HTTP_HEADER_NAME.fullmatch(value):
        raise _rule(
            f"must be a valid HTTP header name: letters, digits and '-' (got {_show(value)})"
        )
    return value


def _non_empty(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise _rule("must not be empty")
    return value


def _kind_of(info: ValidationInfo) -> ProbeKind | None:
    """The probe type being validated, when the caller said (see _validate_probe)."""
    context = info.context
    return context.get("kind") if isinstance(context, dict) else None


_NonNegativeInt32 = Annotated[StrictInt, AfterValidator(_non_negative_int32)]
_PortNumberOrName = Annotated[int | str, PlainValidator(_port_number_or_name)]


class _Spec(BaseModel):
    """Base of every spec model: camelCase keys, unknown keys rejected, immutable."""

    # Input keys are the API's camelCase (set as aliases), in files and in Python constructors
    # alike; attributes keep snake_case names.
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        # Go's JSON decoding leaves a field unset for an explicit null (and YAML reads `key:` with
        # no value as null), so a null counts as leaving the key out.
        if not isinstance(data, dict):
            return data
        known = {field.alias or name for name, field in cls.model_fields.items()}
        return {key: value for key, value in data.items() if value is not None or key not in known}

    @classmethod
    def _keys_set(cls, data: Mapping[Any, Any], *fields: str) -> list[str]:
        """The keys of raw *data* that set one of *fields* to non-null, in *fields* order."""
        keys = (cls.model_fields[name].alias or name for name in fields)
        return [key for key in keys if data.get(key) is not None]


class ExecAction(_Spec):
    """Run a command in the container; exit status 0 is success."""

    command: Annotated[tuple[StrictStr, ...], AfterValidator(_non_empty)]


class HTTPHeader(_Spec):
    """One request header of an httpGet probe."""

    name: Annotated[StrictStr, AfterValidator(_http_header_name)]
    value: StrictStr = ""


class HTTPGetAction(_Spec):
    """GET a URL on the container; a 2xx or 3xx status is success."""

    path: Annotated[StrictStr, AfterValidator(lambda path: path or "/")] = "/"
    port: _PortNumberOrName
    host: StrictStr = ""  # "" means the pod IP, filled in at probe time
    scheme: Annotated[StrictStr, AfterValidator(_one_of("HTTP", "HTTPS", default="HTTP"))] = "HTTP"
    http_headers: tuple[HTTPHeader, ...] = Field(default=(), alias="httpHeaders")


class TCPSocketAction(_Spec):
    """Open a TCP connection to the container; connecting is success."""

    port: _PortNumberOrName
    host: StrictStr = ""  # "" means the pod IP, filled in at probe time


class GRPCAction(_Spec):
    """Call grpc.health.v1.Health/Check on the container; SERVING is success."""

    port: Annotated[int, PlainValidator(_grpc_port)]
    service: StrictStr = ""  # the API leaves it nil; the kubelet sends "" for nil


_HANDLER_FIELDS: Final = ("exec", "http_get", "tcp_socket", "grpc")


class Probe(_Spec):
    """A Kubernetes core/v1 Probe with the API defaults applied; equal specs probe alike."""

    exec: ExecAction | None = None
    http_get: HTTPGetAction | None = Field(default=None, alias="httpGet")
    tcp_socket: TCPSocketAction | None = Field(default=None, alias="tcpSocket")
    grpc: GRPCAction | None = None
    initial_delay_seconds: _NonNegativeInt32 = Field(default=0, alias="initialDelaySeconds")
    timeout_seconds: Annotated[_NonNegativeInt32, AfterValidator(_zero_means(1))] = Field(
        default=1, alias="timeoutSeconds"
    )
    period_seconds: Annotated[_NonNegativeInt32, AfterValidator(_zero_means(10))] = Field(
        default=10, alias="periodSeconds"
    )
    success_threshold: Annotated[_NonNegativeInt32, AfterValidator(_zero_means(1))] = Field(
        default=1, alias="successThreshold"
    )
    failure_threshold: Annotated[_NonNegativeInt32, AfterValidator(_zero_means(3))] = Field(
        default=3, alias="failureThreshold"
    )
    # Only for kills after liveness/startup failures; None falls back to the pod's grace period.
    termination_grace_period_seconds: (
        Annotated[StrictInt, AfterValidator(_positive_int64)] | None
    ) = Field(default=None, alias="terminationGracePeriodSeconds")

    @property
    def handler(self) -> ExecAction | HTTPGetAction | TCPSocketAction | GRPCAction:
        """The one handler this probe runs."""
        handler = self.exec or self.http_get or self.tcp_socket or self.grpc
        assert handler is not None, "validation guarantees exactly one handler"
        return handler

    @model_validator(mode="wrap")
    @classmethod
    def _exactly_one_handler(cls, data: Any, handler: ModelWrapValidatorHandler[Probe]) -> Probe:
        if not isinstance(data, dict):
            return handler(data)
        present = cls._keys_set(data, *_HANDLER_FIELDS)
        # As in the API server, the first handler counts and each later one is reported without
        # being validated itself.
        errors = [
            _line_error((key,), data[key], "may not specify more than 1 handler type")
            for key in present[1:]
        ]
        if not present:
            errors.append(_line_error((), data, "must specify a handler type"))
        kept = {key: value for key, value in data.items() if key not in present[1:]}
        return _validate_with(handler, kept, errors, title=cls.__name__)

    @field_validator("success_threshold")
    @classmethod
    def _success_threshold_for_kind(cls, value: int, info: ValidationInfo) -> int:
        if _kind_of(info) in (ProbeKind.LIVENESS, ProbeKind.STARTUP) and value != 1:
            raise _rule("must be 1")
        return value

    @field_validator("termination_grace_period_seconds")
    @classmethod
    def _grace_period_for_kind(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and _kind_of(info) is ProbeKind.READINESS:
            raise _rule("must not be set for readinessProbes")
        return value


def _validate_probe(value: object, kind: ProbeKind) -> Probe:
    """Validate *value* as a probe of type *kind*."""
    if isinstance(value, Probe):
        # A ready-made Probe was validated without knowing its type: check it again as one.
        value = value.model_dump(by_alias=True)
    return Probe.model_validate(value, context={"kind": kind})


class ContainerPort(_Spec):
    """A named container port, as in a container spec's ``ports``."""

    name: Annotated[StrictStr, AfterValidator(_port_name)]
    container_port: Annotated[StrictInt, AfterValidator(_port_number)] = Field(
        alias="containerPort"
    )
    protocol: Annotated[StrictStr, AfterValidator(_one_of("TCP", "UDP", "SCTP", default="TCP"))] = (
        "TCP"
    )


_PROBE_FIELDS: Final = {
    "liveness_probe": ProbeKind.LIVENESS,
    "readiness_probe": ProbeKind.READINESS,
    "startup_probe": ProbeKind.STARTUP,
}


class _ProbeSource(_Spec):
    """Probes for a container with the named ports they may use: a rule or an override."""

    ports: tuple[ContainerPort, ...] = ()
    liveness_probe: Probe | None = Field(default=None, alias="livenessProbe")
    readiness_probe: Probe | None = Field(default=None, alias="readinessProbe")
    startup_probe: Probe | None = Field(default=None, alias="startupProbe")

    def probe(self, kind: ProbeKind) -> Probe | None:
        """The probe of type *kind*, if defined here."""
        probes = {
            ProbeKind.LIVENESS: self.liveness_probe,
            ProbeKind.READINESS: self.readiness_probe,
            ProbeKind.STARTUP: self.startup_probe,
        }
        return probes[kind]

    @property
    def named_ports(self) -> dict[str, int]:
        """Port numbers by name, from ``ports``."""
        return {port.name: port.container_port for port in self.ports}

    @model_validator(mode="wrap")
    @classmethod
    def _defines_a_probe(
        cls, data: Any, handler: ModelWrapValidatorHandler[_ProbeSource]
    ) -> _ProbeSource:
        errors = []
        if isinstance(data, dict) and not cls._keys_set(data, *_PROBE_FIELDS):
            errors.append(
                _line_error(
                    (),
                    data,
                    "must define at least one of livenessProbe, readinessProbe, startupProbe",
                )
            )
        return _validate_with(handler, data, errors, title=cls.__name__)

    @field_validator(*_PROBE_FIELDS, mode="plain")
    @classmethod
    def _probe_of_kind(cls, value: object, info: ValidationInfo) -> Probe | None:
        # A field name is always set for a field validator.
        kind = _PROBE_FIELDS[info.field_name or ""]
        return None if value is None else _validate_probe(value, kind)

    @field_validator("ports")
    @classmethod
    def _unique_port_names(cls, ports: tuple[ContainerPort, ...]) -> tuple[ContainerPort, ...]:
        seen: set[str] = set()
        errors = []
        for index, port in enumerate(ports):
            if port.name in seen:
                errors.append(
                    _line_error((index, "name"), port.name, f"duplicate value {_show(port.name)}")
                )
            seen.add(port.name)
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return ports


class Match(_Spec):
    """Which containers a rule applies to: globs on names, and labels that must all be present."""

    namespace: StrictStr = "*"
    pod: StrictStr = "*"
    container: StrictStr = "*"
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)

    def matches(
        self,
        *,
        namespace: str,
        pod: str,
        container: str,
        labels: Mapping[str, str],
        pod_labels: Mapping[str, str],
    ) -> bool:
        """Tell whether a container with these names and labels is selected."""
        return (
            fnmatch.fnmatchcase(namespace, self.namespace)
            and fnmatch.fnmatchcase(pod, self.pod)
            and fnmatch.fnmatchcase(container, self.container)
            and all(
                labels.get(key) == value or pod_labels.get(key) == value
                for key, value in self.labels.items()
            )
        )


class Rule(_ProbeSource):
    """One entry of the rules file: probes for the containers it matches."""

    match: Match = Field(default_factory=Match)


class RulesFile(_Spec):
    """The ``--config`` file: rules tried in order."""

    probes: tuple[Rule, ...]


class ContainerOverride(_ProbeSource):
    """The value of a pod's ``probes.cri-prober.io/<container>`` annotation."""


# Who wrote a probe: the rules file (the node's operator; also RunProbe and `check`, whose
# callers are root on the node), a pod annotation (any pod author), or the pod's own spec (the
# probes the kubelet itself runs, so they get the rules file's trust: see serve --probes-from).
ProbeOrigin = Literal["rules", "annotation", "pod-spec"]


class ProbeProvider(Protocol):
    """Anything that may define a container's probes: a rule, an override, a pod spec's
    container."""

    def probe(self, kind: ProbeKind) -> Probe | None: ...

    @property
    def named_ports(self) -> Mapping[str, int]: ...


@dataclass(frozen=True, slots=True)
class ResolvedProbe:
    """A probe chosen for a container, with the named ports of the rule or override it came from.

    ``origin`` says who wrote it: the node's operator (``"rules"``) or the pod's author
    (``"annotation"``); the prober holds annotation probes to a stricter policy (serve
    ``--annotations``, ``--annotation-probe-hosts``). It is not part of equality: the manager
    compares it on its own.
    """

    probe: Probe
    ports: Mapping[str, int]
    origin: ProbeOrigin = field(default="rules", compare=False)
    # For a pod spec's probe: the container's static env, which its $(VAR) expansion uses
    # instead of the runtime's view of the environment.
    env: Mapping[str, str] | None = None
    # Where it came from, for `ps`/`inspect`: the rules file, the annotation's name, the source.
    source: str = field(default="", compare=False)

    def __hash__(self) -> int:
        # Explicit because the ports mapping is not hashable itself.
        return hash((self.probe, frozenset(self.ports.items())))


def select_probes(
    rules: RulesFile,
    *,
    namespace: str,
    pod: str,
    container: str,
    labels: Mapping[str, str],
    pod_labels: Mapping[str, str],
    override: ContainerOverride | None,
    pod_spec: ProbeProvider | None = None,
    pod_env: Mapping[str, str] | None = None,
    sources_named: Mapping[ProbeOrigin, str] | None = None,
) -> dict[ProbeKind, ResolvedProbe]:
    """Pick a container's probes: per type, the override's, else the pod spec's, else the first
    matching rule's.

    ``pod_env`` is the pod spec container's static env (for its probes' $(VAR) expansion);
    ``sources_named`` says where each origin's probes came from, for display.
    """
    sources: list[tuple[ProbeProvider, ProbeOrigin]] = (
        [] if override is None else [(override, "annotation")]
    )
    if pod_spec is not None:
        sources.append((pod_spec, "pod-spec"))
    sources += [
        (rule, "rules")
        for rule in rules.probes
        if rule.match.matches(
            namespace=namespace,
            pod=pod,
            container=container,
            labels=labels,
            pod_labels=pod_labels,
        )
    ]
    selected: dict[ProbeKind, ResolvedProbe] = {}
    for kind in ProbeKind:
        for source, origin in sources:
            probe = source.probe(kind)
            if probe is not None:
                selected[kind] = ResolvedProbe(
                    probe=probe,
                    ports=source.named_ports,
                    origin=origin,
                    env=pod_env if origin == "pod-spec" else None,
                    source=(sources_named or {}).get(origin, ""),
                )
                break
    return selected


def resolve_port(
    port: int | str, ports: Mapping[str, int], kubelet_ports_annotation: str | None
) -> int:
    """Turn a probe's port into a number, looking a name up in *ports*, then the kubelet's list.

    Raises:
        outcome.ProbeError: the name is nowhere to be found, or the number is out of range. Like
            the kubelet's, the probe attempt then errors (and is discarded); it does not fail.
    """
    number = port if isinstance(port, int) else ports.get(port)
    if number is None:
        number = _kubelet_port(str(port), kubelet_ports_annotation)
    if not 1 <= number <= _MAX_PORT:
        raise outcome.ProbeError(f"invalid port number: {number}")
    return number


def _kubelet_port(name: str, annotation: str | None) -> int:
    entries: object = []
    if annotation is not None:
        try:
            entries = json.loads(annotation)
        except (ValueError, RecursionError) as exc:
            raise outcome.ProbeError(
                f"cannot look up port {_show(name)}: "
                f"annotation {KUBELET_PORTS_ANNOTATION} is not valid JSON: {exc}"
            ) from exc
    for entry in entries if isinstance(entries, list) else []:
        # The kubelet takes the first port of that name (its containerPort, not a hostPort).
        if isinstance(entry, dict) and entry.get("name") == name:
            number = entry.get("containerPort")
            if isinstance(number, int) and not isinstance(number, bool):
                return number
    raise outcome.ProbeError(
        f"port {_show(name)} not found in the rule's ports or the container's ports"
    )


def parse_probe(data: object, *, kind: ProbeKind, path: str, source: str | None = None) -> Probe:
    """Validate *data* (decoded JSON or YAML) as a probe of type *kind*.

    *path* is where the probe sits, e.g. ``livenessProbe``; messages name fields below it.

    Raises:
        SpecError: one message per broken rule.
    """
    try:
        return _validate_probe(data, kind)
    except ValidationError as exc:
        raise SpecError(format_errors(exc, path=path), source=source) from None


def parse_probe_json(text: str, kind: ProbeKind, *, source: str) -> Probe:
    """Decode and validate a one-off probe spec: a core/v1 Probe object as JSON (camelCase).

    It is validated exactly like a configured probe of type ``kind``; messages name the field
    path inside the object (``exec.command: required``), led by ``source``.

    Raises:
        SpecError: the text is not JSON, or the probe breaks a rule.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            [f"not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"], source=source
        ) from None
    except RecursionError:
        raise SpecError(["nested too deeply"], source=source) from None
    except ValueError as exc:  # e.g. an integer longer than Python's int-conversion limit
        raise SpecError([f"not valid JSON: {exc}"], source=source) from None
    return parse_probe(data, kind=kind, path="", source=source)


# -- reading and parsing within bounds -------------------------------------------------------
#
# The rules file and the annotations are input cri-prober does not control (a ConfigMap that
# anyone with edit rights fills, any pod author's annotations), read by one process that probes
# the whole node. Each limit keeps such input to a moment of one core and a few MiB: without
# them a 5 MB rules file took 18 s and 521 MB to load, and 419 bytes of chained YAML merge keys
# took seconds and hundreds of MB, doubling with each line added.

# The rules file. Real ones are a few KiB; 1 MiB parses in well under a second with libyaml.
RULES_FILE_MAX_BYTES: Final = 1024 * 1024
# One override annotation's value. Kubernetes allows 256 KiB for all of an object's annotations
# together; an override is a few hundred bytes.
ANNOTATION_MAX_BYTES: Final = 64 * 1024
# Nodes that aliases (`*name`) and merge keys (`<<: *name`) may add to a rules file, each alias
# counted as a full copy of its anchor. Sharing a probe among hundreds of rules stays far below
# it; an alias bomb (each level doubling the one before) exceeds it within a dozen levels, and
# is rejected then, because the count comes from sizes recorded per anchor, never by expanding.
YAML_ALIAS_BUDGET: Final = 10_000
# The schema nests 6 deep (probes[0].livenessProbe.httpGet.httpHeaders[0].name); deeper is junk.
YAML_MAX_DEPTH: Final = 64

_YAML_TAG: Final = "tag:yaml.org,2002:"
# Plain scalars resolve as in the YAML 1.2 core schema, narrowed where YAML 1.1 (PyYAML's
# SafeLoader) reads surprising values: `1:30` (sexagesimal 90), `0x10`, `0o10`, `010` (octal 8
# in 1.1, 10 in 1.2), `1_000`, `yes`/`no`/`on`/`off` and dates all stay strings. An integer
# field given one then fails validation naming the field, and `command: [test, -f, on]` keeps
# its "on". An int is plain decimal without leading zeros, which every YAML version reads alike.
_YAML_NULLS: Final = frozenset({"", "~", "null", "Null", "NULL"})
_YAML_BOOLS: Final = {
    **dict.fromkeys(("true", "True", "TRUE"), True),
    **dict.fromkeys(("false", "False", "FALSE"), False),
}
_YAML_INT: Final = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
# A float needs a point or an exponent (so `010` is no float either), or is .inf or .nan.
_YAML_FLOAT: Final = re.compile(
    r"[-+]?(?:(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
)
_YAML_SCALAR_TAGS: Final = frozenset({"null", "bool", "int", "float"})
# libyaml's parser (PyYAML's wheels bundle it) is ~10x faster than the pure-Python one, which
# gives the same events; only the events are used, never PyYAML's composer or constructors.
_YAML_PARSER: Final[type[yaml.BaseLoader] | type[yaml.CBaseLoader]] = getattr(
    yaml, "CBaseLoader", yaml.BaseLoader
)
# What a message shows of a bad value at most.
_SHOWN_CHARS: Final = 64


def _too_large(limit: int, size: int | None = None) -> str:
    found = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return f"too large: {found}, the limit is {limit} bytes"


def read_rules_file(path: Path, *, limit: int = RULES_FILE_MAX_BYTES) -> bytes:
    """Read the rules file at *path*: a regular file of at most *limit* bytes.

    It is opened non-blocking and checked before any read, so a FIFO put where the file was is an
    error at once instead of an open() that waits for a writer forever; at most ``limit + 1``
    bytes are read, so a file that grows meanwhile (or lies about its size) is still bounded.
    Blocking otherwise (a regular file on a slow disk): the daemon calls it in a worker thread.

    Raises:
        SpecError: the file cannot be opened or read, is no regular file, or is too large.
    """
    source = str(path)
    try:
        return read_regular_file(path, max_bytes=limit, what="rules file")
    except UnsafeFile as exc:
        if exc.too_large:
            raise SpecError([_too_large(limit, exc.size)], source=source) from None
        raise SpecError([exc.reason], source=source) from None
    except OSError as exc:
        raise SpecError([f"cannot read: {exc.strerror}"], source=source) from None


def _rules_text(text: str | bytes, source: str) -> str:
    """Check a rules file's size and encoding; its text, decoded."""
    if isinstance(text, bytes):
        size: int | None = len(text)
    elif len(text) > RULES_FILE_MAX_BYTES:  # a character is at least a byte: no need to encode
        size = None
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise SpecError(
                [f"not valid Unicode: a lone surrogate at character {exc.start}"], source=source
            ) from None
    if size is None or size > RULES_FILE_MAX_BYTES:
        raise SpecError([_too_large(RULES_FILE_MAX_BYTES, size)], source=source)
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = text.count(b"\n", 0, exc.start) + 1
        raise SpecError(
            [f"not valid UTF-8: byte {exc.start} (line {line}): {exc.reason}"], source=source
        ) from None


class _Mark(Protocol):
    """Where an event starts: PyYAML's Mark, or libyaml's, which is another class."""

    line: int
    column: int


def _yaml_error(problem: str, mark: _Mark | None) -> yaml.MarkedYAMLError:
    # A marked error, so load_rules reports it with line and column like a syntax error.
    where = yaml.Mark("", 0, mark.line, mark.column, None, 0) if mark is not None else None
    return yaml.constructor.ConstructorError(None, None, problem, where)


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix(_YAML_TAG) if tag.startswith(_YAML_TAG) else tag


def _yaml_number(kind: str, value: str, mark: _Mark | None) -> int | float:
    if kind == "float":
        # Python spells YAML's .inf and .nan without the point.
        special = value.lower().lstrip("+-") in (".inf", ".nan")
        return float(value.replace(".", "") if special else value)
    try:
        return int(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise _yaml_error(f"integer too long: {len(value)} digits", mark) from None


def _yaml_scalar(event: yaml.ScalarEvent) -> object:
    """The value of a scalar: plain untagged ones resolved as described at _YAML_NULLS."""
    value, tag, mark = event.value, event.tag, event.start_mark
    if tag is None and event.implicit[0]:
        if value in _YAML_NULLS:
            return None
        if value in _YAML_BOOLS:
            return _YAML_BOOLS[value]
        if _YAML_INT.fullmatch(value):
            return _yaml_number("int", value, mark)
        if _YAML_FLOAT.fullmatch(value):
            return _yaml_number("float", value, mark)
        return value
    if tag is None or tag in ("!", _YAML_TAG + "str"):  # quoted, block, or the `!` tag
        return value
    kind = tag.removeprefix(_YAML_TAG)
    if kind not in _YAML_SCALAR_TAGS or not tag.startswith(_YAML_TAG):
        raise _yaml_error(f"unsupported tag {_tag_name(tag)}", mark)
    if kind == "null" and value in _YAML_NULLS:
        return None
    if kind == "bool" and value in _YAML_BOOLS:
        return _YAML_BOOLS[value]
    if kind == "int" and _YAML_INT.fullmatch(value):
        return _yaml_number("int", value, mark)
    if kind == "float" and (_YAML_FLOAT.fullmatch(value) or _YAML_INT.fullmatch(value)):
        return _yaml_number("float", value, mark)
    shown = _show(outcome.shorten(value, _SHOWN_CHARS))
    raise _yaml_error(f"not a valid {_tag_name(tag)}: {shown}", mark)


_NO_KEY: Final = object()  # a mapping waiting for its next key
_MERGE: Final = object()  # ... or for the value of its merge key `<<`


@dataclass(slots=True)
class _YamlOpen:
    """A sequence or mapping whose end has not been parsed yet."""

    items: list[object] | dict[object, object]
    anchor: str | None
    mark: _Mark | None
    # Nodes in it so far, itself included, each alias counted as a copy of its anchor.
    size: int = 1
    key: object = _NO_KEY
    # Keys brought in by merge keys (an earlier source wins); explicit keys override them.
    merged: dict[object, object] | None = None


class _YamlBuilder:
    """Builds the one document of a YAML stream from parser events, within the limits above.

    PyYAML's composer and constructors follow an alias or merge key each time it is used and
    recurse through nesting: the bombs. This builds each node once, shares an anchored value
    wherever it is aliased (as PyYAML does), keeps each anchor's size to charge aliases against
    YAML_ALIAS_BUDGET, and keeps its own stack, so depth costs no recursion.
    """

    def __init__(self) -> None:
        self.anchors: dict[str, tuple[object, int]] = {}  # value and size of finished anchors
        self.open: list[_YamlOpen] = []
        self.aliased = 0  # nodes aliases have added so far
        self.documents = 0
        self.root: object = None

    def build(self, parser: yaml.BaseLoader | yaml.CBaseLoader) -> object:
        while parser.check_event():
            event = parser.get_event()
            if isinstance(event, yaml.ScalarEvent):
                value = _yaml_scalar(event)
                self._claim_anchor(event.anchor, event)
                if event.anchor is not None:
                    self.anchors[event.anchor] = (value, 1)
                merge_key = event.value == "<<" and event.tag is None and event.implicit[0]
                self._add(value, 1, event.start_mark, merge_key=merge_key)
            elif isinstance(event, yaml.AliasEvent):
                self._alias(event)
            elif isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
                self._start(event)
            elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
                self._end()
            elif isinstance(event, yaml.DocumentStartEvent):
                self.documents += 1
                if self.documents > 1:
                    raise _yaml_error("expected a single document in the stream", event.start_mark)
        return self.root

    def _claim_anchor(self, anchor: str | None, event: yaml.Event) -> None:
        # PyYAML rejected a second anchor of the same name too (YAML lets the later one win).
        if anchor is not None and (anchor in self.anchors or self._building(anchor)):
            raise _yaml_error(f"found duplicate anchor {anchor!r}", event.start_mark)

    def _building(self, anchor: str) -> bool:
        return any(node.anchor == anchor for node in self.open)

    def _alias(self, event: yaml.AliasEvent) -> None:
        anchor = event.anchor or ""
        if anchor not in self.anchors:
            if self._building(anchor):
                problem = f"alias *{anchor} refers to a node that contains it"
            else:
                problem = f"found undefined alias {anchor!r}"
            raise _yaml_error(problem, event.start_mark)
        value, size = self.anchors[anchor]
        self.aliased += size
        if self.aliased > YAML_ALIAS_BUDGET:
            raise _yaml_error(
                f"aliases expand to more than {YAML_ALIAS_BUDGET} nodes"
                " (each alias counts as a copy of its anchor)",
                event.start_mark,
            )
        self._add(value, size, event.start_mark)

    def _start(self, event: yaml.SequenceStartEvent | yaml.MappingStartEvent) -> None:
        sequence = isinstance(event, yaml.SequenceStartEvent)
        tag = event.tag
        if tag not in (None, "!", _YAML_TAG + ("seq" if sequence else "map")):
            raise _yaml_error(f"unsupported tag {_tag_name(tag or '')}", event.start_mark)
        if len(self.open) >= YAML_MAX_DEPTH:
            raise _yaml_error(
                f"nested too deeply (more than {YAML_MAX_DEPTH} levels)", event.start_mark
            )
        self._claim_anchor(event.anchor, event)
        self.open.append(_YamlOpen([] if sequence else {}, event.anchor, event.start_mark))

    def _end(self) -> None:
        node = self.open.pop()
        value: object = node.items
        if node.merged and isinstance(node.items, dict):
            value = {**node.merged, **node.items}
        if node.anchor is not None:
            self.anchors[node.anchor] = (value, node.size)
        self._add(value, node.size, node.mark)

    def _add(
        self, value: object, size: int, mark: _Mark | None, *, merge_key: bool = False
    ) -> None:
        if not self.open:
            self.root = value
            return
        node = self.open[-1]
        node.size += size
        if isinstance(node.items, list):
            node.items.append(value)
        elif node.key is _NO_KEY:
            node.key = self._key(node, value, mark, merge_key=merge_key)
        elif node.key is _MERGE:
            self._merge(node, value, mark)
            node.key = _NO_KEY
        else:
            node.items[node.key] = value
            node.key = _NO_KEY

    def _key(self, node: _YamlOpen, key: object, mark: _Mark | None, *, merge_key: bool) -> object:
        if merge_key and node.merged is None:
            node.merged = {}
            return _MERGE
        if isinstance(key, list | dict):
            raise _yaml_error("a mapping key must be a scalar", mark)
        if key in node.items or merge_key:
            raise _yaml_error(f"found duplicate key {key!r}", mark)
        return key

    def _merge(self, node: _YamlOpen, value: object, mark: _Mark | None) -> None:
        # YAML 1.1's merge key, as PyYAML did it: with a list of mappings an earlier one wins,
        # and the mapping's own keys win over every merged one (see _end).
        assert node.merged is not None, "set when the merge key was seen"
        for source in value if isinstance(value, list) else [value]:
            if not isinstance(source, dict):
                raise _yaml_error("a merge key (<<) takes a mapping or a list of mappings", mark)
            for key, item in source.items():
                node.merged.setdefault(key, item)


def _rules_messages(error: ValidationError) -> list[str]:
    """format_errors' messages; an integer field given a string also shows what was read.

    That is where the YAML 1.1 forms that are no numbers here (`1:30`, `0x10`, `010`, `yes`) end
    up, and the value shown says why.
    """
    messages = format_errors(error)
    for index, detail in enumerate(error.errors()):
        if detail["type"] == "int_type" and isinstance(detail["input"], str):
            messages[index] += f" (got {_show(outcome.shorten(detail['input'], _SHOWN_CHARS))})"
    return messages


def load_yaml(text: str | bytes, *, source: str) -> object:
    """Read one YAML (or JSON) document within bounds: the rules file's reader, for any file.

    At most RULES_FILE_MAX_BYTES of UTF-8, within YAML_ALIAS_BUDGET and YAML_MAX_DEPTH, scalars
    resolved as described at _YAML_NULLS, duplicate keys rejected.

    Raises:
        SpecError: too large, not UTF-8, or a YAML error (with line and column).
    """
    text = _rules_text(text, source)
    parser: yaml.BaseLoader | yaml.CBaseLoader | None = None
    try:
        parser = _YAML_PARSER(text)
        return _YamlBuilder().build(parser)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([f"{where}{problem}"], source=source) from None
    except yaml.YAMLError as exc:
        raise SpecError([" ".join(str(exc).split())], source=source) from None
    finally:
        if parser is not None:
            parser.dispose()


def load_rules(text: str | bytes, *, source: str) -> RulesFile:
    """Parse a YAML rules file: *text*, at most RULES_FILE_MAX_BYTES of UTF-8, from *source*.

    *source* names the file in messages. The YAML is read within YAML_ALIAS_BUDGET and
    YAML_MAX_DEPTH, its scalars resolved as described at _YAML_NULLS, duplicate keys rejected.

    Raises:
        SpecError: too large, not UTF-8, a YAML error (with line and column), or broken rules.
    """
    data = load_yaml(text, source=source)
    try:
        return RulesFile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_rules_messages(exc), source=source) from None


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Build a JSON object, rejecting duplicate keys (json.loads would keep the last silently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {_show(key)}")
        result[key] = value
    return result


def parse_annotation(value: str, *, source: str) -> ContainerOverride:
    """Parse a ``probes.cri-prober.io/<container>`` annotation value (a JSON object).

    *source* names the annotation in messages, e.g. ``pod default/web-0 annotation ...``.

    Raises:
        SpecError: too large (ANNOTATION_MAX_BYTES), invalid JSON (with line and column) or
            broken rules.
    """
    # Checked before parsing: any pod author sets annotations, and a value is parsed (and a bad
    # one reported) for each container it names. The length in characters first, so a huge
    # value is not encoded only to be measured.
    if len(value) > ANNOTATION_MAX_BYTES:
        raise SpecError([_too_large(ANNOTATION_MAX_BYTES)], source=source)
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > ANNOTATION_MAX_BYTES:
        raise SpecError([_too_large(ANNOTATION_MAX_BYTES, size)], source=source)
    try:
        data = json.loads(value, object_pairs_hook=_unique_json_keys)
    except json.JSONDecodeError as exc:
        raise SpecError(
            [f"line {exc.lineno}, column {exc.colno}: {exc.msg}"], source=source
        ) from None
    except ValueError as exc:
        raise SpecError([str(exc)], source=source) from None
    except RecursionError:
        raise SpecError(["nested too deeply"], source=source) from None
    try:
        return ContainerOverride.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_errors(exc), source=source) from None
