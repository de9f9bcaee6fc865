"""``serve --probes-from``: the source strings users write, the options that go with them, and
building the configured sources."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from cri_prober.podspecs.kubelet_metrics import KubeletMetricsReader
    from cri_prober.podspecs.source import PodSource

DEFAULT_KUBELET_URL: Final = "https://127.0.0.1:10250/pods"
# A pod's own service-account token: the kubelet source's default credential in a DaemonSet.
SERVICE_ACCOUNT_TOKEN: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
DEFAULT_INTERVAL: Final = 2.0

SourceKind = Literal["kubelet", "apiserver", "manifests"]
SOURCE_SYNTAX: Final = "kubelet[:URL], apiserver or manifests:DIR"


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One ``--probes-from`` value: which source, and its URL or directory."""

    kind: SourceKind
    target: str = ""  # the kubelet's URL, the manifests directory; "" for apiserver

    @property
    def text(self) -> str:
        """As the user would write it."""
        return f"{self.kind}:{self.target}" if self.target else self.kind


def parse_source(text: str) -> SourceSpec:
    """Read one ``--probes-from`` value.

    Raises:
        ValueError: not one of the forms in SOURCE_SYNTAX (the message says which is wrong).
    """
    kind, _, target = text.partition(":")
    if kind == "kubelet":
        url = target or DEFAULT_KUBELET_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{text!r}: the kubelet's URL must start with http:// or https://")
        return SourceSpec("kubelet", url)
    if kind == "apiserver":
        if target:
            raise ValueError(f"{text!r}: apiserver takes no argument (use --kubeconfig)")
        return SourceSpec("apiserver")
    if kind == "manifests":
        if not target:
            raise ValueError(
                f"{text!r}: manifests needs a directory, e.g. manifests:/etc/kubernetes/manifests"
            )
        return SourceSpec("manifests", target)
    raise ValueError(f"{text!r}: unknown source; expected {SOURCE_SYNTAX}")


def default_node_name() -> str:
    """``NODE_NAME`` from the environment, else the host name lowercased (the kubelet's
    default node name)."""
    return os.environ.get("NODE_NAME", "").strip() or socket.gethostname().lower()


@dataclass(frozen=True, slots=True)
class PodSourceOptions:
    """Everything the sources need beyond their ``--probes-from`` value."""

    node_name: str
    interval: float = DEFAULT_INTERVAL
    kubelet_token_file: Path | None = None  # None: the service-account token if it exists
    kubelet_client_cert: Path | None = None
    kubelet_client_key: Path | None = None
    kubelet_ca: Path | None = None
    kubelet_insecure_skip_tls_verify: bool = False
    kubeconfig: Path | None = None  # None: KUBECONFIG, else in-cluster
    # serve --mirror: the kubelet and apiserver sources keep each container's ready and started.
    keep_statuses: bool = False


def build_sources(specs: Sequence[SourceSpec], options: PodSourceOptions) -> list[PodSource]:
    """The configured sources, in ``--probes-from`` order (the first to list a pod wins)."""
    sources: list[PodSource] = []
    for spec in specs:
        if spec.kind == "kubelet":
            from cri_prober.podspecs.kubelet import KubeletSource

            token = options.kubelet_token_file
            if token is None and SERVICE_ACCOUNT_TOKEN.exists():
                token = SERVICE_ACCOUNT_TOKEN
            sources.append(
                KubeletSource(
                    url=spec.target,
                    name=spec.text,
                    interval=options.interval,
                    token_file=token,
                    client_cert=options.kubelet_client_cert,
                    client_key=options.kubelet_client_key,
                    ca_file=options.kubelet_ca,
                    insecure_skip_tls_verify=options.kubelet_insecure_skip_tls_verify,
                    keep_statuses=options.keep_statuses,
                )
            )
        elif spec.kind == "apiserver":
            # Imported here: the Kubernetes client is only loaded when this source is chosen.
            from cri_prober.podspecs.apiserver import ApiServerSource

            sources.append(
                ApiServerSource(
                    node_name=options.node_name,
                    kubeconfig=options.kubeconfig,
                    keep_statuses=options.keep_statuses,
                )
            )
        else:
            from cri_prober.podspecs.manifests import ManifestsSource

            sources.append(
                ManifestsSource(
                    Path(spec.target),
                    name=spec.text,
                    node_name=options.node_name,
                    interval=options.interval,
                )
            )
    return sources


MIRROR_SYNTAX: Final = "kubelet[:URL]"
# The pod sources that can give serve --mirror the pod status (a static pod file has none).
MIRROR_SOURCES: Final = ("kubelet", "apiserver")


def parse_mirror(text: str) -> str:
    """Read ``--mirror``: the URL of the kubelet's ``/metrics/probes``.

    Raises:
        ValueError: not ``kubelet[:URL]`` with an http(s) URL.
    """
    from cri_prober.podspecs.kubelet_metrics import DEFAULT_METRICS_URL

    kind, _, target = text.partition(":")
    if kind != "kubelet":
        raise ValueError(f"{text!r}: expected {MIRROR_SYNTAX}")
    url = target or DEFAULT_METRICS_URL
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{text!r}: the kubelet's URL must start with http:// or https://")
    return url


def build_mirror(url: str, options: PodSourceOptions) -> KubeletMetricsReader:
    """The reader of the kubelet's probe counters (``--mirror``), with the kubelet source's
    credentials."""
    from cri_prober.podspecs.kubelet_metrics import KubeletMetricsReader

    token = options.kubelet_token_file
    if token is None and SERVICE_ACCOUNT_TOKEN.exists():
        token = SERVICE_ACCOUNT_TOKEN
    return KubeletMetricsReader(
        url,
        token_file=token,
        client_cert=options.kubelet_client_cert,
        client_key=options.kubelet_client_key,
        ca_file=options.kubelet_ca,
        insecure_skip_tls_verify=options.kubelet_insecure_skip_tls_verify,
    )
