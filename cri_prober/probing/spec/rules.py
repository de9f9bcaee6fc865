"""The rules as pydantic models: the ``--config`` rules file and the per-pod annotation override
(which containers they match, which probes they define), and their parsers. The pure functions
that pick a container's probes and resolve a probe's named port are in ``core``, which does
without pydantic.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from typing import Any, Final

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
from cri_prober.probing.spec.common import (
    _SHOWN_CHARS,
    ANNOTATION_MAX_BYTES,
    SpecError,
    _show,
)
from cri_prober.probing.spec.model import (
    ContainerPort,
    Probe,
    _line_error,
    _Spec,
    _validate_probe,
    _validate_with,
    format_errors,
)
from cri_prober.probing.spec.yaml_loader import _too_large

__all__ = [
    "ContainerOverride",
    "Match",
    "Rule",
    "parse_annotation",
    "parse_rules",
]

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


class _RulesFileModel(_Spec):
    """The ``--config`` file as validated (``parse_rules``; ``core.load_rules`` gives its rules
    as a ``RulesFile``)."""

    probes: tuple[Rule, ...]


class ContainerOverride(_ProbeSource):
    """The value of a pod's ``probes.cri-prober.io/<container>`` annotation."""


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


def parse_rules(data: object, *, source: str) -> tuple[Rule, ...]:
    """Validate *data*, a rules file's decoded YAML (``core.load_rules`` reads it), from *source*.

    Raises:
        SpecError: the rules break a rule of the schema; *source* leads each message.
    """
    try:
        return _RulesFileModel.model_validate(data).probes
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
