"""``cri-prober serve``: the daemon, configured from flags; bad flags or rules exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from cri_prober import daemon, logs
from cri_prober.cli.common import (
    EXIT_USAGE,
    EventLoop,
    fail,
    https_ca_file_option,
    https_verify_option,
    node_address_option,
    resolve_runtime_endpoint,
    run_async,
    runtime_endpoint_option,
    runtime_request_timeout_option,
    tls_options,
)
from cri_prober.errors import ConfigError
from cri_prober.podspecs.options import (
    DEFAULT_INTERVAL,
    MIRROR_SOURCES,
    SOURCE_SYNTAX,
    PodSourceOptions,
    SourceSpec,
    default_node_name,
    parse_mirror,
    parse_source,
)
from cri_prober.probing.kubelet_profile import GATES, NEWEST_MINOR, OLDEST_MINOR, KubeletProfile
from cri_prober.probing.prober import AnnotationHosts
from cri_prober.probing.spec import SpecError
from cri_prober.runtime.client import DEFAULT_MAX_CONCURRENT_EXECS

API_WARNING = (
    "The local API can run commands inside containers (RunProbe with an exec probe): anyone "
    "who can reach --listen can exec into every container on the node. Keep it on the "
    "default unix socket (mode 0600, root only) or a loopback address."
)


def _annotation_hosts(values: tuple[str, ...]) -> AnnotationHosts:
    try:
        return AnnotationHosts.parse(values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _sources(values: tuple[str, ...]) -> tuple[SourceSpec, ...]:
    specs: list[SourceSpec] = []
    for value in values:
        try:
            spec = parse_source(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        if spec in specs:
            raise click.BadParameter(f"{value!r} is given twice")
        specs.append(spec)
    return tuple(specs)


def _mirror(value: str | None) -> str:
    if value is None:
        return ""
    try:
        return parse_mirror(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command(epilog=API_WARNING)
@runtime_endpoint_option
@click.option(
    "-c",
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Probe rules file (YAML); re-read on SIGHUP without disturbing unchanged probes.",
)
@click.option(
    "--listen",
    default="unix:///run/cri-prober/cri-prober.sock",
    show_default=True,
    metavar="URI",
    help="Local gRPC API: unix://PATH (mode 0600, parent dir created) or tcp://127.0.0.1:PORT.",
)
@click.option(
    "--metrics-address",
    default=None,
    metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (off by default).",
)
@click.option(
    "--metrics-attempt-durations",
    is_flag=True,
    default=False,
    help="Also export cri_prober_probe_duration_seconds, every attempt's duration by result "
    "(up to 70 more series per probe).",
)
@click.option(
    "--pleg",
    type=click.Choice(["auto", "relist", "events"]),
    default="auto",
    show_default=True,
    help="Container discovery: relisting, CRI events, or auto (events only where the runtime "
    "broadcasts them to every subscriber, i.e. containerd >= 2.0).",
)
@click.option(
    "--relist-period",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Relist interval (the safety relist in events mode is longer).",
)
@click.option(
    "--on-failure",
    type=click.Choice(["report", "stop"]),
    default="report",
    show_default=True,
    help="On a liveness or startup failure only report it, or also stop the container through "
    "CRI StopContainer with the kubelet's grace-period rule.",
)
@click.option(
    "--failure-hold",
    type=click.Choice(["auto", "always"]),
    default="auto",
    show_default=True,
    help="After a published liveness or startup failure, the kubelet holds the probe until the "
    "container restarts (its kill brings a new one). auto: hold only where something acts on "
    "the failure (--on-failure stop, or a pod spec's probe, which the kubelet acts on); "
    "elsewhere keep probing and publish the recovery. always: the kubelet's hold everywhere.",
)
@node_address_option
@click.option(
    "--max-concurrent-execs",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_CONCURRENT_EXECS,
    show_default=True,
    help="Node-wide cap on ExecSync calls in flight (containerd collapses under many more).",
)
@runtime_request_timeout_option
@https_verify_option
@https_ca_file_option
@click.option(
    "--history-size",
    type=click.IntRange(min=1, max=10_000),
    default=32,
    show_default=True,
    help="Probe attempts kept per probe for inspect.",
)
@click.option(
    "--state-file",
    default="auto",
    show_default=True,
    metavar="PATH|auto|none",
    help="Where each container's started/ready state is kept across cri-prober restarts, so a "
    "container still starting keeps its startup probe (the kubelet's KEP-4781 rule). auto: "
    "state.json beside the --listen unix socket; none: keep nothing.",
)
@click.option(
    "--probe-on-exit/--no-probe-on-exit",
    default=True,
    show_default=True,
    help="When a container exits, run its probes at once so the failure follows the exit; "
    "--no-probe-on-exit keeps the kubelet's timing (each probe notices at its next tick).",
)
@click.option(
    "--annotations",
    type=click.Choice(["off", "exec-only", "all"]),
    default="all",
    show_default=True,
    help="Which probes pod annotations (probes.cri-prober.io/<container>, set by any pod author) "
    "may define: none, exec probes only (they run inside the pod's own container), or all "
    "(network probes go to the pod's own IP unless --annotation-probe-hosts allows a host).",
)
@click.option(
    "--annotation-probe-hosts",
    multiple=True,
    metavar="CIDR[,CIDR...]",
    callback=lambda _ctx, _param, value: _annotation_hosts(value),
    help="Addresses an annotation's httpGet/tcpSocket probe may name as its host (repeatable). "
    "Default: none. Loopback, unspecified and link-local addresses stay refused unless a "
    "network inside them is named (127.0.0.1/32, not 0.0.0.0/0).",
)
@click.option(
    "--probes-from",
    multiple=True,
    metavar="SOURCE",
    callback=lambda _ctx, _param, value: _sources(value),
    help=f"Run the probes in the pods' own specs, read from SOURCE: {SOURCE_SYNTAX} "
    "(repeatable; the first source listing a pod wins). Per container and probe type an "
    "annotation comes first, then the pod spec, then the rules file. kubelet: the node's "
    "kubelet /pods (default https://127.0.0.1:10250/pods; http://127.0.0.1:10255/pods is the "
    "read-only port); apiserver: watch this node's pods; manifests: static pod files.",
)
@click.option(
    "--mirror",
    metavar="kubelet[:URL]",
    callback=lambda _ctx, _param, value: _mirror(value),
    help="Mirror the kubelet's verdicts instead of running the pod specs' probes again: read "
    "its per-probe counters every second (default https://127.0.0.1:10250/metrics/probes, "
    "which needs `get` on `nodes/metrics`; http://127.0.0.1:10255/metrics/probes is the "
    "read-only port) and its pod status (ready, started) from --probes-from kubelet or "
    "apiserver. Costs the runtime nothing; annotations and rules still run. See "
    "docs/kubelet-mirror.md.",
)
@click.option(
    "--mirror-explain",
    type=click.Choice(["off", "rerun"]),
    default="off",
    show_default=True,
    help="With --mirror: rerun runs a mirrored probe once when the kubelet's counters show a "
    "new failure (at most once per 10 s per probe), to capture the output the counters lack; "
    "recorded as cri-prober's own attempt, counted toward nothing.",
)
@click.option(
    "--pod-spec-probes",
    type=click.Choice(["all", "network-only"]),
    default="all",
    show_default=True,
    help="Which probes of the pod specs (--probes-from) to run: all, or network-only "
    "(httpGet, tcpSocket, grpc), leaving their exec probes to the kubelet alone, so each runs "
    "once on the node instead of twice. The rules file does not stand in for a probe left out.",
)
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    default=None,
    metavar="NAME",
    help="This node's name, for --probes-from apiserver (its field selector) and manifests "
    "(static pods are named <name>-<node name>). Env: NODE_NAME; default: the host name, "
    "lowercased, as the kubelet's default.",
)
@click.option(
    "--pod-source-interval",
    type=click.FloatRange(min=0.2),
    default=DEFAULT_INTERVAL,
    show_default=True,
    metavar="SECONDS",
    help="How often the kubelet and manifests sources read the pods again.",
)
@click.option(
    "--kubelet-token-file",
    type=_FILE,
    default=None,
    help="Bearer token for --probes-from kubelet, re-read on every poll (default: the pod's "
    "service-account token, when it exists).",
)
@click.option(
    "--kubelet-client-cert",
    type=_FILE,
    default=None,
    help="Client certificate for --probes-from kubelet (PEM; with --kubelet-client-key).",
)
@click.option("--kubelet-client-key", type=_FILE, default=None, help="Its private key (PEM).")
@click.option(
    "--kubelet-ca",
    type=_FILE,
    default=None,
    help="CA bundle that signed the kubelet's serving certificate (default: the system's).",
)
@click.option(
    "--kubelet-insecure-skip-tls-verify",
    is_flag=True,
    default=False,
    help="Do not verify the kubelet's serving certificate (often self-signed).",
)
@click.option(
    "--kubeconfig",
    type=_FILE,
    default=None,
    help="Kubeconfig for --probes-from apiserver (default: the pod's service account when "
    "in a cluster, else KUBECONFIG, else ~/.kube/config).",
)
@click.option(
    "--kubelet-version",
    default=None,
    metavar="VERSION",
    help="The kubelet release whose probe behaviour to follow where releases differ "
    f"(1.{OLDEST_MINOR} to 1.{NEWEST_MINOR}, e.g. 1.33 or v1.33.2; docs/kubelet-fidelity.md, "
    '"Kubelet releases"). Default: the Node object\'s status.nodeInfo.kubeletVersion with '
    f"--probes-from apiserver (RBAC: get on nodes), else 1.{NEWEST_MINOR}. The Node object "
    "wins over this flag when readable (a disagreement is logged as a warning).",
)
@click.option(
    "--kubelet-feature-gates",
    default=None,
    metavar="NAME=BOOL,...",
    help="The node kubelet's feature gates that change probing, as its --feature-gates: "
    + ", ".join(sorted(GATES))
    + ". Others are refused; a gate locked in that release may only be set to its value.",
)
@click.option(
    "--event-loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="Event loop: uvloop's (libuv) where installed, or asyncio's own.",
)
@click.option(
    "--log-format",
    type=click.Choice(["json", "console"]),
    default=None,
    help="Log format (default: json when stderr is not a terminal, console otherwise).",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning, error.")
def serve(
    runtime_endpoint: str | None,
    config_file: Path | None,
    listen: str,
    metrics_address: str | None,
    metrics_attempt_durations: bool,
    pleg: str,
    relist_period: float,
    on_failure: str,
    failure_hold: str,
    node_address: str,
    max_concurrent_execs: int,
    runtime_request_timeout: float,
    https_verify: bool,
    https_ca_file: Path | None,
    history_size: int,
    state_file: str,
    probe_on_exit: bool,
    annotations: str,
    annotation_probe_hosts: AnnotationHosts,
    probes_from: tuple[SourceSpec, ...],
    mirror: str,
    mirror_explain: str,
    pod_spec_probes: str,
    node_name: str | None,
    pod_source_interval: float,
    kubelet_token_file: Path | None,
    kubelet_client_cert: Path | None,
    kubelet_client_key: Path | None,
    kubelet_ca: Path | None,
    kubelet_insecure_skip_tls_verify: bool,
    kubeconfig: Path | None,
    kubelet_version: str | None,
    kubelet_feature_gates: str | None,
    event_loop: EventLoop,
    log_format: str | None,
    log_level: str,
) -> None:
    """Discover containers and probe them like the kubelet, until SIGTERM."""
    try:
        logs.configure(log_format=log_format, level=log_level)  # type: ignore[arg-type]
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    if (kubelet_client_cert is None) != (kubelet_client_key is None):
        fail("--kubelet-client-cert and --kubelet-client-key go together", EXIT_USAGE)
    if mirror and not any(spec.kind in MIRROR_SOURCES for spec in probes_from):
        fail(
            "--mirror needs --probes-from kubelet or apiserver: the pod specs say which probes "
            "the kubelet runs, and the pod status their ready and started",
            EXIT_USAGE,
        )
    if mirror_explain != "off" and not mirror:
        fail("--mirror-explain needs --mirror", EXIT_USAGE)
    if mirror and on_failure == "stop":
        fail(
            "--mirror with --on-failure stop: the kubelet already acts on the probes it runs",
            EXIT_USAGE,
        )
    try:
        kubelet = KubeletProfile.parse(kubelet_version, kubelet_feature_gates)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    try:
        rules = daemon.read_rules(config_file)
    except SpecError as exc:
        fail("invalid probe rules:\n" + str(exc), EXIT_USAGE)
    config = daemon.ServeConfig(
        endpoint=resolve_runtime_endpoint(runtime_endpoint),
        config_file=config_file,
        listen=listen,
        metrics_address=metrics_address,
        metrics_attempt_durations=metrics_attempt_durations,
        freeze_gc=True,
        tune_malloc=True,
        own_worker_threads=True,
        pleg=pleg,  # type: ignore[arg-type]
        relist_period=relist_period,
        on_failure=on_failure,  # type: ignore[arg-type]
        failure_hold=failure_hold,  # type: ignore[arg-type]
        node_address=node_address,
        max_concurrent_execs=max_concurrent_execs,
        runtime_request_timeout=runtime_request_timeout,
        https=tls_options(https_verify, https_ca_file),
        history_size=history_size,
        state_file=(
            "auto"
            if state_file == "auto"
            else None
            if state_file in ("none", "")
            else Path(state_file)
        ),
        probe_on_exit=probe_on_exit,
        annotations=annotations,  # type: ignore[arg-type]
        annotation_probe_hosts=annotation_probe_hosts,
        probes_from=probes_from,
        mirror=mirror,
        mirror_explain=mirror_explain == "rerun",
        pod_spec_probes=pod_spec_probes,  # type: ignore[arg-type]
        kubelet=kubelet,
        kubelet_version_flag=kubelet_version,
        kubelet_gates_flag=kubelet_feature_gates,
        pod_sources=PodSourceOptions(
            # Lowercased as the kubelet's node name is (static pods are named after it).
            node_name=((node_name or "").strip() or default_node_name()).lower(),
            interval=pod_source_interval,
            kubelet_token_file=kubelet_token_file,
            kubelet_client_cert=kubelet_client_cert,
            kubelet_client_key=kubelet_client_key,
            kubelet_ca=kubelet_ca,
            kubelet_insecure_skip_tls_verify=kubelet_insecure_skip_tls_verify,
            kubeconfig=kubeconfig,
        ),
    )

    async def run() -> int:
        return await daemon.Daemon(config, rules).run()

    # Non-zero when a fatal task failed (it was logged as task_failed).
    if code := run_async(run, event_loop=event_loop):
        sys.exit(code)
