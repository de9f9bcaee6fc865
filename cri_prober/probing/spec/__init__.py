"""Probe specs as users write them: the Kubernetes core/v1 Probe with the API server's defaults and
validation (``model``), the ``--config`` rules file and the per-pod annotation override
(``rules``), the pure functions that pick a container's probes, resolve named ports and load a
rules file, with the types the rest of cri-prober holds (``core``; ``common``: the spec error and
the bounds both sides share), and the bounded YAML loader that reads the rules file
(``yaml_loader``).

This package re-exports their public names, so callers import from ``cri_prober.probing.spec``.
``core``'s, ``common``'s and ``yaml_loader``'s are imported with the package; the pydantic
models' (``model``, ``rules``) on their first use, so that a ``serve`` with nothing to probe
never loads pydantic (issue 36, idle RSS). A module that must not load them at import imports
them where it calls them (``from cri_prober.probing.spec.rules import parse_annotation`` in the
function), not at its top.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec.common import (
    ANNOTATION_MAX_BYTES,
    GRPC_MODES,
    HTTP_PROTOCOLS,
    SpecError,
    Unsupported,
)
from cri_prober.probing.spec.core import (
    KUBELET_PORTS_ANNOTATION,
    PORTS_FROM,
    ProbeOrigin,
    ProbeProvider,
    ResolvedProbe,
    RulesFile,
    SharedRuleProbes,
    load_rules,
    resolve_port,
    select_probes,
)
from cri_prober.probing.spec.yaml_loader import (
    RULES_FILE_MAX_BYTES,
    YAML_ALIAS_BUDGET,
    YAML_MAX_DEPTH,
    load_yaml,
    read_rules_file,
)

if TYPE_CHECKING:
    from cri_prober.probing.spec.model import (
        ContainerPort,
        ExecAction,
        GRPCAction,
        HTTPGetAction,
        HTTPHeader,
        Probe,
        TCPSocketAction,
        format_errors,
        parse_probe,
        parse_probe_json,
    )
    from cri_prober.probing.spec.rules import ContainerOverride, Match, Rule, parse_annotation

# The names whose modules import pydantic, by the module that defines them.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "ContainerPort",
            "ExecAction",
            "GRPCAction",
            "HTTPGetAction",
            "HTTPHeader",
            "Probe",
            "TCPSocketAction",
            "format_errors",
            "parse_probe",
            "parse_probe_json",
        ),
        "cri_prober.probing.spec.model",
    ),
    **dict.fromkeys(
        ("ContainerOverride", "Match", "Rule", "parse_annotation"),
        "cri_prober.probing.spec.rules",
    ),
}


def __getattr__(name: str) -> Any:
    """A model's name, imported on first use (PEP 562) and kept as this package's attribute."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ANNOTATION_MAX_BYTES",
    "GRPC_MODES",
    "HTTP_PROTOCOLS",
    "KUBELET_PORTS_ANNOTATION",
    "PORTS_FROM",
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
    "SharedRuleProbes",
    "SpecError",
    "TCPSocketAction",
    "Unsupported",
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
