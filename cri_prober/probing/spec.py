"""Probe specs as users write them: the Kubernetes core/v1 Probe with the API server's defaults and
validation, the ``--config`` rules file and the per-pod annotation override, plus the pure
functions that pick a container's probes and resolve named ports.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeVar

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
from cri_prober.probing import outcome
from cri_prober.probing.kinds import ProbeKind

__all__ = [
    "KUBELET_PORTS_ANNOTATION",
    "ContainerOverride",
    "ContainerPort",
    "ExecAction",
    "GRPCAction",
    "HTTPGetAction",
    "HTTPHeader",
    "Match",
    "Probe",
    "ProbeKind",
    "ResolvedProbe",
    "Rule",
    "RulesFile",
    "SpecError",
    "TCPSocketAction",
    "format_errors",
    "load_rules",
    "parse_annotation",
    "parse_probe",
    "parse_probe_json",
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


@dataclass(frozen=True, slots=True)
class ResolvedProbe:
    """A probe chosen for a container, with the named ports of the rule or override it came from."""

    probe: Probe
    ports: Mapping[str, int]

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
) -> dict[ProbeKind, ResolvedProbe]:
    """Pick a container's probes: per type, the override's, else the first matching rule's."""
    sources: list[_ProbeSource] = [] if override is None else [override]
    sources += [
        rule
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
        for source in sources:
            probe = source.probe(kind)
            if probe is not None:
                selected[kind] = ResolvedProbe(probe=probe, ports=source.named_ports)
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


class _RulesLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys, which PyYAML would silently resolve to the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a key of base is fine
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep)


def load_rules(text: str, *, source: str) -> RulesFile:
    """Parse the YAML rules file *text*, read from *source* (a file name, for messages).

    Raises:
        SpecError: a YAML syntax error (with line and column) or broken rules.
    """
    try:
        data = yaml.load(text, Loader=_RulesLoader)  # safe: _RulesLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([f"{where}{problem}"], source=source) from None
    except yaml.YAMLError as exc:
        raise SpecError([" ".join(str(exc).split())], source=source) from None
    except RecursionError:
        raise SpecError(["nested too deeply"], source=source) from None
    except (ValueError, IndexError, KeyError, AttributeError, TypeError, OverflowError) as exc:
        # SafeLoader parses some scalars it then cannot build (an explicit !!int tag on "",
        # a \U escape past Unicode, a bad !!timestamp): its constructors raise plain errors.
        raise SpecError([f"invalid YAML value: {exc}"], source=source) from None
    try:
        return RulesFile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_errors(exc), source=source) from None


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
        SpecError: invalid JSON (with line and column) or broken rules.
    """
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
