"""The probe model: the Kubernetes core/v1 Probe and its handlers as pydantic models, with the API
server's defaults and validation, the messages that report a broken spec, and the parsers of a
single probe (decoded data or JSON text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Final, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainValidator,
    PrivateAttr,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec.common import (
    _MAX_PORT,
    GRPC_MODES,
    HTTP_PROTOCOLS,
    SpecError,
    Unsupported,
    _show,
)

__all__ = [
    "GRPC_MODES",
    "HTTP_PROTOCOLS",
    "ContainerPort",
    "ExecAction",
    "GRPCAction",
    "HTTPGetAction",
    "HTTPHeader",
    "Probe",
    "SpecError",
    "TCPSocketAction",
    "Unsupported",
    "format_errors",
    "parse_probe",
    "parse_probe_json",
]

_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1

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


def _unset_or_one_of(*allowed: str) -> Callable[[str | None], str | None]:
    """Accept None or "" (the field left out: None, so a dump leaves it out as the API does) or
    one of *allowed* (case-sensitive, as the API is)."""
    check = _one_of(*allowed, default=allowed[0])

    def accept(value: str | None) -> str | None:
        return check(value) if value else None

    return accept


class HTTPGetAction(_Spec):
    """GET a URL on the container; a 2xx or 3xx status is success."""

    path: Annotated[StrictStr, AfterValidator(lambda path: path or "/")] = "/"
    port: _PortNumberOrName
    host: StrictStr = ""  # "" means the pod IP, filled in at probe time
    scheme: Annotated[StrictStr, AfterValidator(_one_of("HTTP", "HTTPS", default="HTTP"))] = "HTTP"
    http_headers: tuple[HTTPHeader, ...] = Field(default=(), alias="httpHeaders")
    # KEP-5999 (1.37, gate H2CContainerProbe): "HTTP2" sends the GET over h2c with prior
    # knowledge; None (left out) and "HTTP1" keep HTTP/1.1. Honoured only where the node's kubelet
    # would (Prober); a kubelet without the gate ignores it.
    protocol: Annotated[StrictStr | None, AfterValidator(_unset_or_one_of(*HTTP_PROTOCOLS))] = None

    @model_validator(mode="after")
    def _h2c_is_cleartext(self) -> HTTPGetAction:
        # The API server's rule (validateHTTPGetAction, 1.37): h2c has no TLS.
        if self.protocol == "HTTP2" and self.scheme == "HTTPS":
            raise _rule("protocol: HTTP2 cannot be combined with scheme HTTPS")
        return self


class TCPSocketAction(_Spec):
    """Open a TCP connection to the container; connecting is success."""

    port: _PortNumberOrName
    host: StrictStr = ""  # "" means the pod IP, filled in at probe time


class GRPCAction(_Spec):
    """Call grpc.health.v1.Health/Check on the container; SERVING is success."""

    port: Annotated[int, PlainValidator(_grpc_port)]
    service: StrictStr = ""  # the API leaves it nil; the kubelet sends "" for nil
    # KEP-4939 (1.37, gate GRPCContainerProbeTLS): "TLS" calls the health service over TLS
    # without verifying the server's certificate; None (left out) and "Plaintext" keep plaintext.
    mode: Annotated[StrictStr | None, AfterValidator(_unset_or_one_of(*GRPC_MODES))] = None


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
    # What of its handler cri-prober cannot send as the spec asks (set by the pod spec parser,
    # which alone accepts unknown keys): a probe with any of them is not run (Prober).
    _unsupported: tuple[Unsupported, ...] = PrivateAttr(default=())

    @property
    def unsupported(self) -> tuple[Unsupported, ...]:
        """The handler's fields this probe cannot be sent with (see ``Unsupported``)."""
        return self._unsupported

    def with_unsupported(self, fields: Sequence[Unsupported]) -> Probe:
        """This probe marked with ``fields`` (a copy; equal only to probes marked alike)."""
        if not fields:
            return self
        marked = self.model_copy()
        marked._unsupported = tuple(fields)
        return marked

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
