"""The rules and their precedence: the ``--config`` rules file and the per-pod annotation override
(which containers they match, which probes they define), and the pure functions that pick a
container's probes and resolve a probe's named port.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cri_prober.probing import outcome
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec.model import (
    _MAX_PORT,
    _SHOWN_CHARS,
    ContainerPort,
    Probe,
    SpecError,
    _line_error,
    _show,
    _Spec,
    _validate_probe,
    _validate_with,
    format_errors,
)
from cri_prober.probing.spec.yaml_loader import _too_large, load_yaml

__all__ = [
    "ANNOTATION_MAX_BYTES",
    "KUBELET_PORTS_ANNOTATION",
    "PORTS_FROM",
    "ContainerOverride",
    "Match",
    "ProbeOrigin",
    "ProbeProvider",
    "ResolvedProbe",
    "Rule",
    "RulesFile",
    "load_rules",
    "parse_annotation",
    "resolve_port",
    "select_probes",
]

# The container annotation in which the kubelet records the container's `ports` as a JSON array.
KUBELET_PORTS_ANNOTATION: Final = "io.kubernetes.container.ports"
# One override annotation's value. Kubernetes allows 256 KiB for all of an object's annotations
# together; an override is a few hundred bytes. (Why input is bounded at all: see yaml_loader.)
ANNOTATION_MAX_BYTES: Final = 64 * 1024


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


# Rules' resolved probes by (id of the rule, kind), with the rule itself to tell a reused ID.
SharedRuleProbes = dict[tuple[int, ProbeKind], tuple["ProbeProvider", ResolvedProbe]]


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
    shared: SharedRuleProbes | None = None,
) -> dict[ProbeKind, ResolvedProbe]:
    """Pick a container's probes: per type, the override's, else the pod spec's, else the first
    matching rule's.

    ``pod_env`` is the pod spec container's static env (for its probes' $(VAR) expansion);
    ``sources_named`` says where each origin's probes came from, for display. ``shared``: the
    rules' probes resolved so far (for the same ``sources_named``), which every container a rule
    matches shares instead of keeping its own copy and its own ports map.
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
            if probe is None:
                continue
            keep = shared if origin == "rules" else None
            kept = None if keep is None else keep.get((id(source), kind))
            if kept is not None and kept[0] is source:
                selected[kind] = kept[1]
                break
            selected[kind] = ResolvedProbe(
                probe=probe,
                ports=source.named_ports,
                origin=origin,
                env=pod_env if origin == "pod-spec" else None,
                source=(sources_named or {}).get(origin, ""),
            )
            if keep is not None:
                keep[(id(source), kind)] = (source, selected[kind])
            break
    return selected


# Where a probe's own named ports came from, by its origin: said when a name is not found.
PORTS_FROM: Final[Mapping[str, str]] = {
    "rules": "the rule's ports",
    "annotation": "the annotation's ports",
    "pod-spec": "the pod spec's container ports",
}


def resolve_port(
    port: int | str,
    ports: Mapping[str, int],
    kubelet_ports_annotation: str | None,
    *,
    ports_from: str = PORTS_FROM["rules"],
) -> int:
    """Turn a probe's port into a number, looking a name up in *ports*, then the kubelet's list.

    *ports_from* says where *ports* came from (``PORTS_FROM``), for the message when the name is
    in neither; "" when the caller has no named ports of its own (a lifecycle hook).

    Raises:
        outcome.ProbeError: the name is nowhere to be found, or the number is out of range. Like
            the kubelet's, the probe attempt then errors (and is discarded); it does not fail.
    """
    number = port if isinstance(port, int) else ports.get(port)
    if number is None:
        number = _kubelet_port(str(port), kubelet_ports_annotation, ports_from)
    if not 1 <= number <= _MAX_PORT:
        raise outcome.ProbeError(f"invalid port number: {number}")
    return number


def _kubelet_port(name: str, annotation: str | None, ports_from: str) -> int:
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
    # Say where the names were looked for: the probe's own ports (a rule's, an annotation's or
    # the pod spec's container's), then the kubelet's list on the CRI container, if it has one.
    kubelet = f"the kubelet's {KUBELET_PORTS_ANNOTATION} annotation"
    if annotation is None:
        kubelet += " (the container has none)"
    where = f"{ports_from} or {kubelet}" if ports_from else kubelet
    raise outcome.ProbeError(f"port {_show(name)} not found in {where}")


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


def load_rules(text: str | bytes, *, source: str) -> RulesFile:
    """Parse a YAML rules file: *text*, at most RULES_FILE_MAX_BYTES of UTF-8, from *source*.

    *source* names the file in messages. The YAML is read within YAML_ALIAS_BUDGET and
    YAML_MAX_DEPTH, its scalars resolved as described at yaml_loader._YAML_NULLS, duplicate keys
    rejected.

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
