"""Which probes a container gets: the pod's own spec, its override annotation and the rules file,
in that precedence (``select_probes``), with override annotations parsed once per change and
admitted as ``serve --annotations`` allows, and pod-spec exec probes left to the kubelet when
``serve --pod-spec-probes network-only`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import structlog

from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import shorten
from cri_prober.probing.spec import (
    ResolvedProbe,
    RulesFile,
    SharedRuleProbes,
    SpecError,
    select_probes,
)

if TYPE_CHECKING:
    from cri_prober.podspecs.model import PodSpec
    from cri_prober.probing.spec import ContainerOverride

log = structlog.get_logger(__name__)

OVERRIDE_ANNOTATION_PREFIX = "probes.cri-prober.io/"
# The longest error text logged for a bad override annotation: validation messages quote the
# values they reject, and an annotation can be as big as the API server lets a pod's be.
ANNOTATION_ERROR_LOG_CHARS = 2048

# Which probes pod annotations may define (serve --annotations): none, exec probes only (they run
# inside the pod's own container), or all (network probes then follow --annotation-probe-hosts).
AnnotationMode = Literal["off", "exec-only", "all"]

# Which probes of the pods' own specs cri-prober runs (serve --pod-spec-probes): all, or the
# network ones only (httpGet, tcpSocket, grpc), leaving each exec probe to the kubelet alone, so
# the runtime runs it once, not twice (docs/benchmarks.md: what one exec costs the runtime).
PodSpecProbes = Literal["all", "network-only"]


@dataclass(frozen=True, slots=True)
class _CachedOverride:
    """A container's parsed override annotation, with the text it was parsed from.

    Keeping the text costs nothing extra: it is the string discovery's PodInfo holds for as
    long as the pod exists, and the entry goes when the container leaves the node.
    """

    value: str
    override: ContainerOverride | None  # None: the annotation was refused (and logged once)


class ProbeSelection:
    """Resolves each container's probe specs from the rules, its annotation and its pod's spec."""

    def __init__(
        self,
        rules: RulesFile,
        *,
        annotations: AnnotationMode,
        rules_source: str,
        pod_spec_probes: PodSpecProbes = "all",
    ) -> None:
        self.rules = rules
        self.annotations: AnnotationMode = annotations
        self.rules_source = rules_source
        self.pod_spec_probes: PodSpecProbes = pod_spec_probes
        # The kubelet's SidecarContainers gate (on by default from 1.29, locked on from 1.33):
        # off, a restartable init container is an ordinary one, never probed (the manager sets
        # it from its kubelet profile).
        self.sidecars = True
        # Pod-spec exec probes left to the kubelet, by (sandbox ID, container name, kind): each
        # is logged once while its container is on the node, not at every reconcile.
        self._left_to_kubelet: set[tuple[str, str, ProbeKind]] = set()
        # Parsed override annotations by (sandbox ID, container name), for containers on the node
        # now: ``forget_others`` drops the others (pods without a slot included).
        self._overrides: dict[tuple[str, str], _CachedOverride] = {}
        # The rules' resolved probes, shared by every container a rule matches (issue 25: a
        # node's memory, by what is kept), for the rules they came from.
        self._shared: SharedRuleProbes = {}
        self._shared_for = rules

    def cached_overrides(self) -> int:
        """How many parsed annotations are kept (one per annotated container on the node)."""
        return len(self._overrides)

    def specs_for(
        self, info: ContainerInfo, pod_spec: PodSpec | None = None
    ) -> dict[ProbeKind, ResolvedProbe]:
        """The probes ``info`` gets, by kind (empty: none)."""
        spec_container = None
        if pod_spec is not None:
            if info.name in pod_spec.init_containers:
                # D8: the kubelet never probes an ordinary init container, whatever else
                # matches it.
                return {}
            spec_container = pod_spec.containers.get(info.name)
            if spec_container is not None and spec_container.sidecar and not self.sidecars:
                # Kubelet 1.28 (SidecarContainers off) starts workers for restartable init
                # containers only with the gate on (prober_manager.go AddPod, release-1.28).
                return {}
        override = self._override(info.pod, info.name)
        if self._shared_for is not self.rules:
            self._shared, self._shared_for = {}, self.rules
        selected = select_probes(
            self.rules,
            namespace=info.pod.namespace,
            pod=info.pod.name,
            container=info.name,
            labels=info.labels,
            pod_labels=info.pod.labels,
            override=override,
            pod_spec=spec_container,
            pod_env=spec_container.env if spec_container is not None else None,
            sources_named={
                "rules": self.rules_source,
                "annotation": f"annotation {OVERRIDE_ANNOTATION_PREFIX}{info.name}",
                "pod-spec": pod_spec.source if pod_spec is not None else "",
            },
            shared=self._shared,
        )
        if self.pod_spec_probes == "network-only" and pod_spec is not None:
            self._leave_exec_to_kubelet(info, pod_spec, selected)
        if pod_spec is not None and pod_spec.deleting:
            # D3: the kubelet stops liveness and startup probing as soon as a pod's termination
            # begins (StopLivenessAndStartup); readiness goes on until the containers stop.
            selected.pop(ProbeKind.LIVENESS, None)
            selected.pop(ProbeKind.STARTUP, None)
        return selected

    def forget_others(self, live: set[tuple[str, str]]) -> None:
        """Forget the annotations of containers that left the node ((sandbox ID, name) pairs).

        A pod whose bad annotation gave it no probe never had a slot, so dropping slots alone
        would keep its entry (and the annotation's text) forever.
        """
        for gone in self._overrides.keys() - live:
            del self._overrides[gone]
        if self._left_to_kubelet:
            self._left_to_kubelet = {k for k in self._left_to_kubelet if k[:2] in live}

    def _leave_exec_to_kubelet(
        self, info: ContainerInfo, pod_spec: PodSpec, selected: dict[ProbeKind, ResolvedProbe]
    ) -> None:
        """Drop the pod spec's exec probes from ``selected``: the kubelet runs them already.

        The rules file does not step in for a kind dropped here (the pod spec defines it, and
        the kubelet runs it); an annotation's probe, chosen before the spec's, is kept.
        """
        for kind in [k for k, r in selected.items() if r.origin == "pod-spec" and r.probe.exec]:
            del selected[kind]
            key = (info.pod.sandbox_id, info.name, kind)
            if key not in self._left_to_kubelet:
                self._left_to_kubelet.add(key)
                log.info(
                    "pod_spec_exec_probe_left_to_kubelet",
                    pod=pod_spec.label,
                    container=info.name,
                    probe=kind.field_name,
                    reason="serve --pod-spec-probes network-only",
                )

    def _override(self, pod: PodInfo, container: str) -> ContainerOverride | None:
        value = pod.annotations.get(OVERRIDE_ANNOTATION_PREFIX + container)
        if value is None:
            return None
        key = (pod.sandbox_id, container)
        cached = self._overrides.get(key)
        # Discovery hands back the same PodInfo, and so the same string, while a pod is
        # unchanged: the identity test settles nearly every call without comparing the text.
        if cached is not None and (cached.value is value or cached.value == value):
            return cached.override
        override = self._parse_override(pod, container, value)
        self._overrides[key] = _CachedOverride(value, override)
        return override

    def _parse_override(self, pod: PodInfo, container: str, value: str) -> ContainerOverride | None:
        """The annotation's probes if ``--annotations`` lets them in; else log why not, once."""
        source = (
            f"pod {pod.namespace}/{pod.name} annotation {OVERRIDE_ANNOTATION_PREFIX}{container}"
        )
        if self.annotations == "off":
            log.info("probe_annotation_ignored", source=source, reason="serve --annotations off")
            return None
        # Imported here: the models (pydantic) load with the first annotation (issue 36).
        from cri_prober.probing.spec.rules import parse_annotation

        try:
            override = parse_annotation(value, source=source)
        except SpecError as exc:
            # A bad annotation must not take the file's probes away: report it, use the file.
            log.error("bad_probe_annotation", error=shorten(str(exc), ANNOTATION_ERROR_LOG_CHARS))
            return None
        if self.annotations == "exec-only":
            refused = [
                f"{source}: {kind.field_name}: only exec probes are allowed "
                "(serve --annotations exec-only)"
                for kind in ProbeKind
                if (probe := override.probe(kind)) is not None and probe.exec is None
            ]
            if refused:
                # All or nothing, like an invalid annotation: the file's probes apply instead.
                log.error("bad_probe_annotation", error="\n".join(refused))
                return None
        return override
