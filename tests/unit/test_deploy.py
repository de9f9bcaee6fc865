"""Deployment files: compose, Dockerfiles, Kubernetes manifests, systemd unit, rules, the wheel.

Neither a Docker engine nor a cluster nor systemd as PID 1 is available where the suite runs, so
these tests validate structure and the references between files, services, volumes and flags;
they do not run the deployments.
"""

from __future__ import annotations

import configparser
import copy
import fnmatch
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml

import cri_prober
from cri_prober.cli import main as cli_main
from cri_prober.probing.spec import load_rules
from tests.support.podsecurity import (
    KUBELET_DIR_GID,
    KUBELET_DIR_MODE,
    KUBELET_DIR_UID,
    effective_security,
    mount_of,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_RULES = REPO / "examples" / "rules.yaml"
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
CONTAINERD_DOCKERFILE = REPO / "deploy" / "compose" / "containerd.Dockerfile"
K8S_DIR = REPO / "deploy" / "kubernetes"
UNIT = REPO / "deploy" / "systemd" / "cri-prober.service"

METRICS_PORT = 9808
API_DIR = "/run/cri-prober"
API_SOCKET = f"unix://{API_DIR}/cri-prober.sock"
CONTAINERD_RUN = "/run/containerd"
IMAGE_USER = "65532:0"
# The open-file limit shipped in the systemd unit and docker-compose.yml.
NOFILE = 65536


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in an argument list."""
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# -- example rules ------------------------------------------------------------------------------


def test_example_rules_are_valid() -> None:
    """examples/rules.yaml loads with cri-prober's own rules loader."""
    rules = load_rules(EXAMPLE_RULES.read_text(), source=str(EXAMPLE_RULES))
    assert len(rules.probes) >= 2


def test_every_rules_file_in_the_repo_is_valid() -> None:
    """Any rules*.yaml under examples/ or deploy/ is a valid rules file."""
    files = sorted({*REPO.glob("examples/**/*rules*.yaml"), *REPO.glob("deploy/**/*rules*.yaml")})
    assert EXAMPLE_RULES in files
    for path in files:
        load_rules(path.read_text(), source=str(path))


# -- docker-compose.yml -------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    type: str  # "volume" or "bind"
    source: str
    target: str
    read_only: bool
    create_host_path: bool


def parse_mount(entry: str | dict[str, Any], named: set[str]) -> Mount:
    """Normalise a compose volume entry (short or long syntax)."""
    if isinstance(entry, dict):
        return Mount(
            type=entry["type"],
            source=entry["source"],
            target=entry["target"],
            read_only=bool(entry.get("read_only", False)),
            create_host_path=bool(entry.get("bind", {}).get("create_host_path", False)),
        )
    parts = entry.split(":")
    source, target = parts[0], parts[1]
    mode = parts[2] if len(parts) > 2 else ""
    kind = "bind" if source.startswith((".", "/", "~")) else "volume"
    assert kind == "bind" or source in named, f"volume {source!r} is not declared"
    # Short-syntax binds create a missing host path, which hides typos: count them as not.
    return Mount(kind, source, target, "ro" in mode.split(","), False)


@pytest.fixture(name="compose", scope="module")
def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def mounts(compose: dict[str, Any], service: str) -> list[Mount]:
    named = set(compose.get("volumes") or {})
    return [parse_mount(entry, named) for entry in compose["services"][service].get("volumes", [])]


class TestCompose:
    def test_services(self, compose: dict[str, Any]) -> None:
        """The node (network namespace holder), containerd and cri-prober, and nothing else."""
        assert set(compose["services"]) == {"node", "containerd", "cri-prober"}

    def test_node_service_holds_the_network_namespace(self, compose: dict[str, Any]) -> None:
        """node only holds the netns (containerd's image, a sleep), unprivileged; containerd and
        cri-prober join it, so a containerd restart leaves cri-prober's network in place."""
        node = compose["services"]["node"]
        assert node["image"] == compose["services"]["containerd"]["image"]
        assert "build" not in node  # the image containerd's build makes
        assert [*node["entrypoint"], *node["command"]] == ["sleep", "infinity"]
        assert not node.get("privileged", False)
        assert node["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in node["security_opt"]
        assert node["read_only"] is True
        assert "network_mode" not in node
        assert not node.get("volumes")
        for name in ("containerd", "cri-prober"):
            assert compose["services"][name]["network_mode"] == "service:node", name

    def test_health_gated_start(self, compose: dict[str, Any]) -> None:
        """cri-prober starts only once containerd's healthcheck passes."""
        depends = compose["services"]["cri-prober"]["depends_on"]
        assert depends == {"containerd": {"condition": "service_healthy"}}
        assert compose["services"]["containerd"]["healthcheck"]["test"] == ["CMD", "ctr", "version"]

    def test_named_volumes_declared_and_used(self, compose: dict[str, Any]) -> None:
        """Every named volume used is declared at the top level, and every declared one used."""
        declared = set(compose["volumes"])
        used = {
            mount.source
            for service in compose["services"]
            for mount in mounts(compose, service)
            if mount.type == "volume"
        }
        assert used == declared
        targets = {m.target: m.source for m in mounts(compose, "containerd") if m.type == "volume"}
        assert "/var/lib/containerd" in targets  # snapshots cannot live on the overlay rootfs

    def test_containerd_run_is_a_shared_directory_volume(self, compose: dict[str, Any]) -> None:
        """/run/containerd is one named volume in both services; no socket file is mounted."""
        sources = set()
        for service in ("containerd", "cri-prober"):
            run = [m for m in mounts(compose, service) if m.target == CONTAINERD_RUN]
            assert len(run) == 1, service
            assert run[0].type == "volume"
            sources.add(run[0].source)
            for mount in mounts(compose, service):
                assert not mount.source.endswith(".sock"), mount
                assert not mount.target.endswith(".sock"), mount
        assert len(sources) == 1

    def test_bind_mounts_exist_in_the_repo(self, compose: dict[str, Any]) -> None:
        """Each bind-mounted host path is in the repo, unless compose is told to create it."""
        for service in compose["services"]:
            for mount in mounts(compose, service):
                if mount.type != "bind":
                    continue
                path = (REPO / mount.source).resolve()
                assert path.is_relative_to(REPO), mount
                if mount.create_host_path:
                    top = Path(mount.source).parts[0]  # pathlib drops a leading "./"
                    assert top in (REPO / ".dockerignore").read_text().split(), mount
                    assert f"/{top}/" in (REPO / ".gitignore").read_text().split(), mount
                else:
                    assert path.exists(), f"{service}: {mount.source} does not exist"

    def test_builds_reference_existing_files(self, compose: dict[str, Any]) -> None:
        """Both images are built from Dockerfiles in the repo."""
        for service in compose["services"].values():
            if "build" not in service:  # node: containerd's image
                continue
            build = service["build"]
            assert (REPO / build["context"] / build["dockerfile"]).is_file(), build

    def test_healthchecks(self, compose: dict[str, Any]) -> None:
        """containerd and cri-prober have healthchecks; cri-prober's speaks the gRPC health
        protocol. node's (the image's, containerd's) is disabled: a sleep has nothing to check."""
        for name, service in compose["services"].items():
            if name == "node":
                assert service["healthcheck"] == {"disable": True}
            else:
                assert service["healthcheck"]["test"]
        test = compose["services"]["cri-prober"]["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL")
        assert "cri-prober health" in " ".join(test[1:])

    def test_ports_are_loopback_only_and_include_metrics(self, compose: dict[str, Any]) -> None:
        """Every published port is bound to 127.0.0.1; the metrics port is one of them."""
        published = [
            port for service in compose["services"].values() for port in service.get("ports", [])
        ]
        assert published
        for port in published:
            assert str(port).startswith("127.0.0.1:"), port
        assert f"127.0.0.1:{METRICS_PORT}:{METRICS_PORT}" in published
        # Published by the netns owner only (a service with network_mode: service: cannot).
        assert [name for name, s in compose["services"].items() if s.get("ports")] == ["node"]
        command = compose["services"]["cri-prober"]["command"]
        assert flag_value(command, "--metrics-address") == f"0.0.0.0:{METRICS_PORT}"

    def test_cri_prober_service(self, compose: dict[str, Any]) -> None:
        """cri-prober: node network, rules and API socket wired, minimal privileges."""
        service = compose["services"]["cri-prober"]
        assert service["network_mode"] == "service:node"
        assert "ports" not in service  # published on the node service it shares a netns with
        assert not service.get("privileged", False)
        assert service["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in service["security_opt"]
        assert service["read_only"] is True
        assert service["restart"] == "unless-stopped"
        command = service["command"]
        assert command[0] == "serve"
        assert (
            flag_value(command, "--runtime-endpoint") == f"unix://{CONTAINERD_RUN}/containerd.sock"
        )
        assert flag_value(command, "--listen") == API_SOCKET
        by_target = {m.target: m for m in mounts(compose, "cri-prober")}
        rules = by_target[flag_value(command, "--config") or ""]
        assert rules.type == "bind"
        assert rules.read_only
        assert (REPO / rules.source).resolve() == EXAMPLE_RULES
        api = by_target[API_DIR]
        assert api.type == "bind"  # the API socket directory is exposed to the host

    def test_open_file_limit_like_the_unit(self, compose: dict[str, Any]) -> None:
        """cri-prober's nofile limit is the systemd unit's, not the engine's default (containerd
        2.x: a soft 1,024), so a flooded metrics port cannot take the descriptors probes need."""
        nofile = compose["services"]["cri-prober"]["ulimits"]["nofile"]
        assert nofile == {"soft": NOFILE, "hard": NOFILE}

    def test_containerd_service(self, compose: dict[str, Any]) -> None:
        """containerd alone is privileged, in a private cgroup namespace, with its config."""
        service = compose["services"]["containerd"]
        assert service["privileged"] is True
        assert service["cgroup"] == "private"
        assert service["network_mode"] == "service:node"
        assert "ports" not in service
        others = [s for name, s in compose["services"].items() if name != "containerd"]
        assert not any(s.get("privileged", False) for s in others)
        targets = {m.target: m for m in mounts(compose, "containerd")}
        config = targets["/etc/containerd/config.toml"]
        assert config.read_only
        text = (REPO / config.source).read_text()
        assert f'address = "{CONTAINERD_RUN}/containerd.sock"' in text
        assert f'state = "{CONTAINERD_RUN}"' in text
        cni = targets["/etc/cni/net.d"]
        for conf in (REPO / cni.source).glob("*.conflist"):
            json.loads(conf.read_text())


# -- Dockerfiles --------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, rest = whole.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return result


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def one(steps: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in steps if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


class TestDockerfile:
    def test_slim_python_base(self) -> None:
        """Every stage is a python:<version>-slim image (BASE_IMAGE's default)."""
        steps = instructions(DOCKERFILE)
        args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in steps if k == "ARG" and "=" in a}
        for keyword, rest in steps:
            if keyword == "FROM":
                image = rest.split()[0].replace("${BASE_IMAGE}", args["BASE_IMAGE"])
                image = image.replace("${PYTHON_VERSION}", args["PYTHON_VERSION"])
                assert re.fullmatch(r"python:3\.\d+-slim", image), image

    def test_installs_the_package_from_the_repo_without_protoc(self) -> None:
        """The builder makes wheels from the checkout; no protoc or grpcio-tools in the image."""
        text = DOCKERFILE.read_text()
        steps = instructions(DOCKERFILE)
        copies = [args for keyword, args in steps if keyword == "COPY" and "--from" not in args]
        sources = {src for args in copies for src in args.split()[:-1]}
        assert {"pyproject.toml", "README.md", "cri_prober"} <= sources
        assert "pip wheel" in text
        assert "--no-index" in text
        assert "protoc" not in text.replace("no protoc", "")
        assert "grpcio-tools" not in text

    def test_copied_files_are_not_dockerignored(self) -> None:
        """What the builder copies is in the build context (.dockerignore leaves it in)."""
        patterns = [
            line.strip()
            for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        for path in ("pyproject.toml", "README.md", "cri_prober", "cri_prober/_gen/__init__.py"):
            assert (REPO / path).exists()
            for pattern in patterns:
                parts = Path(path).parts
                prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
                assert not any(fnmatch.fnmatch(p, pattern) for p in prefixes), (path, pattern)
        for excluded in (".venv", ".git", "tests"):
            assert excluded in patterns

    def test_entrypoint_and_default_command(self) -> None:
        """ENTRYPOINT is cri-prober; CMD serves on the default socket with metrics on 9808."""
        final = final_stage(instructions(DOCKERFILE))
        assert json.loads(one(final, "ENTRYPOINT")) == ["cri-prober"]
        command = json.loads(one(final, "CMD"))
        assert command[0] == "serve"
        assert flag_value(command, "--listen") == API_SOCKET
        assert flag_value(command, "--metrics-address") == f"0.0.0.0:{METRICS_PORT}"
        assert one(final, "EXPOSE") == str(METRICS_PORT)

    def test_non_root_user(self) -> None:
        """The image runs as uid 65532 in group 0 (containerd's socket group), not as root."""
        final = final_stage(instructions(DOCKERFILE))
        assert one(final, "USER") == IMAGE_USER
        text = DOCKERFILE.read_text()
        assert "useradd --system --uid 65532 --gid 0" in text
        assert f"install -d -o 65532 -g 0 -m 0700 {API_DIR}" in text

    def test_healthcheck_uses_the_grpc_health_command(self) -> None:
        """HEALTHCHECK runs `cri-prober health`, mapped onto Docker's unhealthy status."""
        healthcheck = one(final_stage(instructions(DOCKERFILE)), "HEALTHCHECK")
        assert re.search(r"CMD cri-prober health \|\| exit 1$", healthcheck), healthcheck

    def test_oci_labels(self) -> None:
        """The usual org.opencontainers.image labels are set."""
        labels = " ".join(args for keyword, args in instructions(DOCKERFILE) if keyword == "LABEL")
        for key in ("title", "description", "version", "licenses"):
            assert f"org.opencontainers.image.{key}=" in labels

    def test_version_arg_matches_the_package(self) -> None:
        """The image's default VERSION is the package version."""
        steps = instructions(DOCKERFILE)
        assert f"VERSION={cri_prober.__version__}" in [a for k, a in steps if k == "ARG"]

    def test_containerd_image(self) -> None:
        """The compose containerd image is Debian with containerd, runc and the CNI plugins."""
        steps = instructions(CONTAINERD_DOCKERFILE)
        args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in steps if k == "ARG" and "=" in a}
        base = one(steps, "FROM").replace("${BASE_IMAGE}", args["BASE_IMAGE"])
        assert base.startswith("debian:bookworm-slim")  # BASE_IMAGE's default
        run = one(steps, "RUN")
        for package in ("containerd", "runc", "containernetworking-plugins"):
            assert re.search(rf"\b{package}\b", run), package
        assert "ctr" in one(steps, "HEALTHCHECK")


# -- Kubernetes ---------------------------------------------------------------------------------

# Two alternative manifests: the rules-file mode and the pod-spec mode (probes from the pods' own
# specs, read from the API server); a third file adds the kubelet source's RBAC to the second.
RULES_MANIFEST = K8S_DIR / "daemonset.yaml"
PODSPECS_MANIFEST = K8S_DIR / "daemonset-podspecs.yaml"
KUBELET_RBAC = K8S_DIR / "rbac-kubelet-source.yaml"
MIRROR_RBAC = K8S_DIR / "rbac-kubelet-mirror.yaml"  # serve --mirror's nodes/metrics
DAEMONSET_MANIFESTS = {"rules": RULES_MANIFEST, "podspecs": PODSPECS_MANIFEST}
# The schemas every manifest is checked against (bundled with kubernetes-validate, so offline):
# the release whose kubelet cri-prober follows (its probes say `kube-probe/1.<minor>` of it).
KUBERNETES_VERSION = "1.34"
RBAC_API = "rbac.authorization.k8s.io/v1"


def k8s_files() -> list[Path]:
    return sorted(K8S_DIR.glob("*.yaml"))


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def the_daemonset(path: Path) -> dict[str, Any]:
    (daemonset,) = by_kind(load_docs(path), "DaemonSet")
    return daemonset


@pytest.fixture(name="k8s", scope="module")
def _k8s() -> list[dict[str, Any]]:
    """The rules-file mode's objects."""
    return load_docs(RULES_MANIFEST)


@pytest.fixture(name="podspecs", scope="module")
def _podspecs() -> list[dict[str, Any]]:
    """The pod-spec mode's objects."""
    return load_docs(PODSPECS_MANIFEST)


@pytest.fixture(name="daemonset", scope="module", params=sorted(DAEMONSET_MANIFESTS))
def _daemonset(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each mode's DaemonSet: what they share is tested on both."""
    return the_daemonset(DAEMONSET_MANIFESTS[request.param])


def pod_spec(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(daemonset)["containers"]
    assert isinstance(only, dict)
    return only


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value of a repeatable ``--flag VALUE`` / ``--flag=VALUE``."""
    values = []
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            values.append(args[index + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def rbac_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for doc in docs if doc["kind"] in ("Role", "ClusterRole") for rule in doc["rules"]]


def granted(rule: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples a rule grants."""
    return {
        (group, resource, verb)
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }


def bound_service_accounts(docs: list[dict[str, Any]]) -> dict[str, set[tuple[str, str]]]:
    """ClusterRole name -> (namespace, name) of each ServiceAccount a binding gives it to."""
    bound: dict[str, set[tuple[str, str]]] = {}
    for binding in by_kind(docs, "ClusterRoleBinding"):
        role = binding["roleRef"]
        assert (role["apiGroup"], role["kind"]) == ("rbac.authorization.k8s.io", "ClusterRole")
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", subject
            bound.setdefault(role["name"], set()).add((subject["namespace"], subject["name"]))
    return bound


def document_ids() -> list[Any]:
    return [
        pytest.param(path, index, id=f"{path.name}:{index}:{doc['kind']}")
        for path in k8s_files()
        for index, doc in enumerate(load_docs(path))
    ]


class TestKubernetesSchemas:
    """Every object validates against the Kubernetes API's own schemas, strictly, offline."""

    @pytest.fixture(autouse=True)
    def _no_network(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The schemas are bundled: validating must not reach for the network."""

        def refuse(*_args: object, **_kwargs: object) -> None:
            raise AssertionError("kubernetes-validate tried to use the network")

        monkeypatch.setattr(socket.socket, "connect", refuse)
        monkeypatch.setattr(socket, "create_connection", refuse)
        monkeypatch.setattr(socket, "getaddrinfo", refuse)

    @pytest.mark.parametrize(("path", "index"), document_ids())
    def test_document_is_valid(self, path: Path, index: int) -> None:
        """Strict mode: unknown fields (a misspelt or misplaced key) are errors."""
        doc = load_docs(path)[index]
        # The version validated against is the pinned one, not the nearest older bundled one.
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == (
            KUBERNETES_VERSION
        )

    def test_the_validator_rejects_unknown_fields_and_wrong_types(self) -> None:
        """The check above has teeth: a misspelt key or a string port fails it."""
        daemonset = the_daemonset(PODSPECS_MANIFEST)
        misspelt = copy.deepcopy(daemonset)
        container(misspelt)["livenessprobe"] = container(misspelt).pop("livenessProbe")
        with pytest.raises(kubernetes_validate.ValidationError, match="livenessprobe"):
            kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
        mistyped = copy.deepcopy(daemonset)
        container(mistyped)["ports"][0]["containerPort"] = str(METRICS_PORT)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(mistyped, KUBERNETES_VERSION, strict=True)

    def test_every_manifest_is_covered(self) -> None:
        """Each YAML under deploy/kubernetes/ is one of the known manifests (and so tested)."""
        assert set(k8s_files()) == {RULES_MANIFEST, PODSPECS_MANIFEST, KUBELET_RBAC, MIRROR_RBAC}


class TestKubernetes:
    def test_objects(self, k8s: list[dict[str, Any]]) -> None:
        """Rules mode: a Namespace, a ConfigMap and a DaemonSet in it; no RBAC, since it never
        talks to the API server."""
        kinds = sorted(doc["kind"] for doc in k8s)
        assert kinds == ["ConfigMap", "DaemonSet", "Namespace"]
        (namespace,) = by_kind(k8s, "Namespace")
        name = namespace["metadata"]["name"]
        for doc in k8s:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == name
            assert doc["apiVersion"] in ("v1", "apps/v1")
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "privileged"

    def test_namespace_comes_first_in_its_file(self) -> None:
        """`kubectl apply -f` creates objects in order, so the Namespace must precede the rest."""
        for path in k8s_files():
            kinds = [doc["kind"] for doc in load_docs(path)]
            if "Namespace" in kinds:
                assert kinds[0] == "Namespace", path

    def test_configmap_rules_are_the_example(self, k8s: list[dict[str, Any]]) -> None:
        """The ConfigMap's rules.yaml is examples/rules.yaml verbatim, and valid."""
        (configmap,) = by_kind(k8s, "ConfigMap")
        text = configmap["data"]["rules.yaml"]
        assert text == EXAMPLE_RULES.read_text()
        load_rules(text, source="ConfigMap cri-prober-rules")

    def test_host_network_without_privileges(self, daemonset: dict[str, Any]) -> None:
        """hostNetwork like the kubelet's probes; no hostPID, no privileged."""
        spec = pod_spec(daemonset)
        assert spec["hostNetwork"] is True
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert not spec.get("hostPID", False)
        assert not spec.get("hostIPC", False)
        security = container(daemonset)["securityContext"]
        assert security.get("privileged", False) is False
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert "add" not in security["capabilities"]

    def test_rules_mode_has_no_api_token(self) -> None:
        """The rules-file mode never talks to the API server: no token mounted."""
        spec = pod_spec(the_daemonset(RULES_MANIFEST))
        assert spec["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in spec

    def test_runs_as_the_image_user(self, daemonset: dict[str, Any]) -> None:
        """uid 65532 / gid 0 like the image, non-root enforced, RuntimeDefault seccomp."""
        security = pod_spec(daemonset)["securityContext"]
        uid, gid = IMAGE_USER.split(":")
        assert security["runAsUser"] == int(uid)
        assert security["runAsGroup"] == int(gid)
        assert security["runAsNonRoot"] is True
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}

    def test_containerd_socket_directory(self, daemonset: dict[str, Any]) -> None:
        """/run/containerd is a hostPath Directory mounted as a directory, never the socket."""
        volumes = {volume["name"]: volume for volume in pod_spec(daemonset)["volumes"]}
        for volume in volumes.values():
            if "hostPath" in volume:
                assert not volume["hostPath"]["path"].endswith(".sock"), volume
        mounts = {m["mountPath"]: m for m in container(daemonset)["volumeMounts"]}
        run = mounts[CONTAINERD_RUN]
        assert volumes[run["name"]]["hostPath"] == {"path": CONTAINERD_RUN, "type": "Directory"}
        for mount in mounts.values():
            assert mount["name"] in volumes
            assert not mount["mountPath"].endswith(".sock")

    def test_scheduling(self, daemonset: dict[str, Any]) -> None:
        """Every node: tolerate all taints, node-critical priority, rolling updates."""
        spec = pod_spec(daemonset)
        assert {"operator": "Exists"} in spec["tolerations"]
        assert spec["priorityClassName"] == "system-node-critical"
        assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        selector = daemonset["spec"]["selector"]["matchLabels"]
        labels = daemonset["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()

    def test_env_from_downward_api(self, daemonset: dict[str, Any]) -> None:
        """NODE_NAME from spec.nodeName; the host-network probe address from status.hostIP."""
        env = {item["name"]: item for item in container(daemonset)["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        node_address = env["CRI_PROBER_NODE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert node_address == "status.hostIP"

    def test_args_and_mounts_agree(self, daemonset: dict[str, Any]) -> None:
        """The API socket and the runtime socket are where the mounts put them."""
        spec = pod_spec(daemonset)
        main = container(daemonset)
        args = main["args"]
        assert args[0] == "serve"
        mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        assert flag_value(args, "--listen") == API_SOCKET
        # A host directory, so state.json outlives the pod (restarts and rollouts, KEP-4781).
        api_dir = volumes[mounts[API_DIR]["name"]]["hostPath"]
        assert (api_dir["path"], api_dir["type"]) == (API_DIR, "DirectoryOrCreate")
        assert "/tmp" in mounts  # the root filesystem is read-only
        endpoint = flag_value(args, "--runtime-endpoint") or ""
        assert endpoint == f"unix://{CONTAINERD_RUN}/containerd.sock"

    def test_rules_mode_reads_the_configmap(self, k8s: list[dict[str, Any]]) -> None:
        """--config is the rules.yaml the ConfigMap volume puts there, read-only."""
        (daemonset,) = by_kind(k8s, "DaemonSet")
        args = container(daemonset)["args"]
        mounts = {m["mountPath"]: m for m in container(daemonset)["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in pod_spec(daemonset)["volumes"]}
        config = Path(flag_value(args, "--config") or "")
        rules_mount = mounts[str(config.parent)]
        assert rules_mount["readOnly"] is True
        configmap = volumes[rules_mount["name"]]["configMap"]["name"]
        assert configmap == "cri-prober-rules"
        assert config.name == "rules.yaml"
        assert not flag_values(args, "--probes-from")

    def test_metrics_port_and_annotations(self, daemonset: dict[str, Any]) -> None:
        """Metrics on 9808, named, announced with prometheus.io annotations."""
        main = container(daemonset)
        assert flag_value(main["args"], "--metrics-address") == f"0.0.0.0:{METRICS_PORT}"
        assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in main[
            "ports"
        ]
        annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(METRICS_PORT)

    def test_own_health_probes_speak_grpc_health(self, daemonset: dict[str, Any]) -> None:
        """Readiness runs `cri-prober health` (grpc.health.v1) on the API socket; liveness only
        asks that the daemon answers (NOT_SERVING while the runtime or a pod source is down is
        no reason to restart it)."""
        main = container(daemonset)
        assert main["readinessProbe"]["exec"]["command"] == ["cri-prober", "health"]
        assert main["livenessProbe"]["exec"]["command"] == ["cri-prober", "health", "--answering"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert main[probe]["timeoutSeconds"] >= 5  # a Python process starts per run
        liveness = main["livenessProbe"]
        # Tolerate a containerd restart (NOT_SERVING for a while) before restarting.
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120

    def test_resources(self, daemonset: dict[str, Any]) -> None:
        """Modest requests and a memory limit, from docs/reliability.md §13's measurements: the
        request covers the steady RSS (~80 MiB), the limit the peak under hostile pod sources
        (under 160 MiB) with room to spare."""
        resources = container(daemonset)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys()
        assert _mebibytes(resources["requests"]["memory"]) >= 96
        assert _mebibytes(resources["limits"]["memory"]) >= 160 + 64

    def test_the_two_modes_are_alternatives(self) -> None:
        """Same Namespace and the same DaemonSet name and selector: applying one mode's file
        updates the other's DaemonSet in place, so two cri-probers never share a node (and its
        /run/cri-prober). Everything else in the pod template is the same but for the mode."""
        rules, podspecs = load_docs(RULES_MANIFEST), load_docs(PODSPECS_MANIFEST)
        assert by_kind(rules, "Namespace") == by_kind(podspecs, "Namespace")
        first, second = the_daemonset(RULES_MANIFEST), the_daemonset(PODSPECS_MANIFEST)
        for key in ("name", "namespace"):
            assert first["metadata"][key] == second["metadata"][key]
        assert first["spec"]["selector"] == second["spec"]["selector"]
        assert first["spec"]["updateStrategy"] == second["spec"]["updateStrategy"]
        mode_keys = {"serviceAccountName", "automountServiceAccountToken", "volumes"}
        for key in pod_spec(first).keys() | pod_spec(second).keys():
            if key not in mode_keys | {"containers"}:
                assert pod_spec(first).get(key) == pod_spec(second).get(key), key
        for key in container(first).keys() | container(second).keys():
            if key not in ("args", "volumeMounts"):
                assert container(first).get(key) == container(second).get(key), key


class TestApiSocketDirectory:
    """The API socket's hostPath directory, as the kubelet creates it on a fresh node (root:root
    0755), ends up writable by the user serve runs as: an init container with CAP_CHOWN alone
    gives it to that user first. Issue 35: without it uid 65532 could not bind its socket
    (Permission denied, exit 2, CrashLoopBackOff)."""

    @staticmethod
    def api_volume(daemonset: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        main = container(daemonset)
        listen = (flag_value(main["args"], "--listen") or "").removeprefix("unix://")
        (mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == str(Path(listen).parent)]
        volumes = {volume["name"]: volume for volume in pod_spec(daemonset)["volumes"]}
        return mount["name"], volumes[mount["name"]]

    def test_serve_can_bind_in_a_directory_the_kubelet_created(
        self, daemonset: dict[str, Any]
    ) -> None:
        """Start from the kubelet's root:root 0755, apply every init container that mounts the
        directory (each a `chown UID:GID DIR` with CAP_CHOWN), then ask whether serve's user
        may create its socket there (write and search on the directory, without any
        capability: it drops ALL)."""
        spec = pod_spec(daemonset)
        name, volume = self.api_volume(daemonset)
        assert volume["hostPath"]["type"] == "DirectoryOrCreate"
        owner, group, mode = KUBELET_DIR_UID, KUBELET_DIR_GID, KUBELET_DIR_MODE
        for init in spec.get("initContainers", []):
            path = mount_of(init, name)
            if path is None:
                continue
            security = effective_security(spec, init)
            argv = [*init.get("command", []), *init.get("args", [])]
            assert argv[0] == "chown", argv
            assert argv[2:] == [path], argv
            assert "CHOWN" in security.capabilities()
            owner, group = (int(part) for part in argv[1].split(":"))
        serve = effective_security(spec, container(daemonset))
        assert serve.capabilities() == set()
        if serve.uid == owner:
            allowed = mode >> 6
        elif serve.gid == group:
            allowed = mode >> 3
        else:
            allowed = mode
        assert allowed & 0o3 == 0o3, (
            f"uid {serve.uid} gid {serve.gid} cannot create its socket in a directory "
            f"{owner}:{group} {mode:o}"
        )

    def test_the_init_container_holds_only_cap_chown(self, daemonset: dict[str, Any]) -> None:
        """Root for one chown and nothing more: every capability but CHOWN dropped, no privilege
        escalation, a read-only root filesystem, the main image (nothing else to pull), only the
        API directory mounted, and the owner it sets is serve's user and group."""
        spec = pod_spec(daemonset)
        main = container(daemonset)
        name, _volume = self.api_volume(daemonset)
        (init,) = spec["initContainers"]
        security = effective_security(spec, init)
        assert security.uid == 0
        assert security.drop == ("ALL",)
        assert security.add == ("CHOWN",)
        assert security.no_new_privs
        assert security.read_only_root
        assert init["securityContext"].get("privileged", False) is False
        assert (init["image"], init["imagePullPolicy"]) == (main["image"], main["imagePullPolicy"])
        assert [m["name"] for m in init["volumeMounts"]] == [name]
        assert mount_of(init, name) == mount_of(main, name)
        assert init["resources"]["limits"]["memory"]
        serve = effective_security(spec, main)
        assert init["command"][1] == f"{serve.uid}:{serve.gid}"
        assert serve.run_as_non_root
        assert serve.uid != 0


class TestKubernetesPodSpecs:
    """daemonset-podspecs.yaml: probes from the pods' own specs, read from the API server with
    the least privilege that allows it; rbac-kubelet-source.yaml for the kubelet source."""

    def test_objects(self, podspecs: list[dict[str, Any]]) -> None:
        """Namespace, ServiceAccount, ClusterRole and binding, DaemonSet; no rules ConfigMap."""
        kinds = [doc["kind"] for doc in podspecs]
        assert sorted(kinds) == [
            "ClusterRole", "ClusterRoleBinding", "DaemonSet", "Namespace", "ServiceAccount",
        ]  # fmt: skip
        (namespace,) = by_kind(podspecs, "Namespace")
        for doc in podspecs:
            if doc["kind"] in ("ServiceAccount", "DaemonSet"):
                assert doc["metadata"]["namespace"] == namespace["metadata"]["name"]
            if doc["kind"].startswith("ClusterRole"):
                assert doc["apiVersion"] == RBAC_API
                assert "namespace" not in doc["metadata"]

    def test_cluster_role_reads_pods_and_nothing_else(self, podspecs: list[dict[str, Any]]) -> None:
        """Exactly get, list and watch on core pods, and get on nodes (the node's kubelet
        version, issue 37): no other verb, resource, group or name."""
        (role,) = by_kind(podspecs, "ClusterRole")
        pods, nodes = role["rules"]
        for rule in (pods, nodes):
            assert set(rule) == {"apiGroups", "resources", "verbs"}  # no resourceNames, no URLs
        assert granted(pods) == {("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch")}
        assert granted(nodes) == {("", "nodes", "get")}

    def test_the_daemonsets_service_account_is_the_one_bound(
        self, podspecs: list[dict[str, Any]]
    ) -> None:
        """The pod runs as the ServiceAccount the binding gives the pods role to, with its token
        mounted (the in-cluster config reads it)."""
        (account,) = by_kind(podspecs, "ServiceAccount")
        (role,) = by_kind(podspecs, "ClusterRole")
        spec = pod_spec(the_daemonset(PODSPECS_MANIFEST))
        identity = (account["metadata"]["namespace"], account["metadata"]["name"])
        assert spec["serviceAccountName"] == identity[1]
        assert spec["automountServiceAccountToken"] is True
        assert bound_service_accounts(podspecs) == {role["metadata"]["name"]: {identity}}

    def test_node_name_reaches_the_flag(self) -> None:
        """NODE_NAME comes from spec.nodeName and is passed as --node-name=$(NODE_NAME), which
        the kubelet expands: the API server is asked for this node's pods only."""
        main = container(the_daemonset(PODSPECS_MANIFEST))
        env = {item["name"]: item for item in main["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert flag_values(main["args"], "--node-name") == ["$(NODE_NAME)"]

    def test_probes_from_the_api_server_and_only_report(self) -> None:
        """--probes-from apiserver, no rules file, and report mode: the kubelet acts, not us."""
        args = container(the_daemonset(PODSPECS_MANIFEST))["args"]
        assert args[0] == "serve"
        assert flag_values(args, "--probes-from") == ["apiserver"]
        assert flag_value(args, "--config") is None
        assert flag_value(args, "-c") is None
        assert flag_values(args, "--on-failure") in ([], ["report"])

    def test_kubelet_source_rbac_reads_pods_through_the_kubelet_only(self) -> None:
        """rbac-kubelet-source.yaml grants get on nodes/pods (the kubelet's /pods) to the same
        ServiceAccount, and nothing else; it adds no Namespace or account of its own."""
        docs = load_docs(KUBELET_RBAC)
        assert sorted(doc["kind"] for doc in docs) == ["ClusterRole", "ClusterRoleBinding"]
        (role,) = by_kind(docs, "ClusterRole")
        (rule,) = role["rules"]
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert granted(rule) == {("", "nodes/pods", "get")}
        (account,) = by_kind(load_docs(PODSPECS_MANIFEST), "ServiceAccount")
        identity = (account["metadata"]["namespace"], account["metadata"]["name"])
        assert bound_service_accounts(docs) == {role["metadata"]["name"]: {identity}}

    def test_kubelet_mirror_rbac_reads_the_kubelets_metrics_only(self) -> None:
        """rbac-kubelet-mirror.yaml grants get on nodes/metrics (the kubelet's /metrics/probes,
        serve --mirror) and list and watch on core events (the kubelet's Unhealthy events, with
        --probes-from apiserver) to the same ServiceAccount, and nothing else."""
        docs = load_docs(MIRROR_RBAC)
        assert sorted(doc["kind"] for doc in docs) == ["ClusterRole", "ClusterRoleBinding"]
        (role,) = by_kind(docs, "ClusterRole")
        metrics, events = role["rules"]
        for rule in (metrics, events):
            assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert granted(metrics) == {("", "nodes/metrics", "get")}
        assert granted(events) == {("", "events", "list"), ("", "events", "watch")}
        (account,) = by_kind(load_docs(PODSPECS_MANIFEST), "ServiceAccount")
        identity = (account["metadata"]["namespace"], account["metadata"]["name"])
        assert bound_service_accounts(docs) == {role["metadata"]["name"]: {identity}}

    def test_least_privilege_everywhere(self) -> None:
        """No manifest grants a write verb, a wildcard, secrets, or nodes/proxy (which would
        allow exec into every container through the kubelet); nodes/proxy is named only in the
        kubelet source's file, in the comment explaining when and why one might add it."""
        for path in k8s_files():
            for rule in rbac_rules(load_docs(path)):
                for group, resource, verb in granted(rule):
                    assert verb in ("get", "list", "watch"), (path.name, rule)
                    assert "*" not in (group, resource, verb), (path.name, rule)
                    assert resource in (
                        "pods",
                        "nodes/pods",
                        "nodes",
                        "nodes/metrics",
                        "events",
                    ), (path.name, rule)
                    # The Node object only for its kubeletVersion: get, never list or watch.
                    assert resource != "nodes" or verb == "get", (path.name, rule)
                    # Events only as serve --mirror reads them: list and watch, in the mirror's
                    # file, never get (one by name) anywhere.
                    assert resource != "events" or (
                        verb in ("list", "watch") and path == MIRROR_RBAC
                    ), (path.name, rule)
                assert "nonResourceURLs" not in rule, (path.name, rule)
            if "nodes/proxy" in path.read_text():
                assert path in (KUBELET_RBAC, MIRROR_RBAC)
                code = [line.split("#", 1)[0] for line in path.read_text().splitlines()]
                assert not any("nodes/proxy" in line for line in code)


# -- serve command lines ------------------------------------------------------------------------

# The values the downward API gives the DaemonSets' fieldRef variables, for $(VAR) expansion.
DOWNWARD_API_SAMPLE = {"spec.nodeName": "node-1", "status.hostIP": "192.0.2.10"}


def expand_k8s_args(main: dict[str, Any]) -> list[str]:
    """A container's args with $(VAR) expanded from its env, as the kubelet does."""
    values = {}
    for item in main.get("env", []):
        if "value" in item:
            values[item["name"]] = item["value"]
        else:
            values[item["name"]] = DOWNWARD_API_SAMPLE[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return [
        re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m[1], m[0]), arg)
        for arg in main["args"]
    ]


def serve_command_lines() -> list[Any]:
    lines = [
        pytest.param(expand_k8s_args(container(the_daemonset(path))), id=f"kubernetes-{mode}")
        for mode, path in sorted(DAEMONSET_MANIFESTS.items())
    ]
    compose = yaml.safe_load(COMPOSE.read_text())
    lines.append(pytest.param(compose["services"]["cri-prober"]["command"], id="compose"))
    dockerfile = json.loads(one(final_stage(instructions(DOCKERFILE)), "CMD"))
    lines.append(pytest.param(dockerfile, id="dockerfile"))
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.read_string(UNIT.read_text())
    lines.append(pytest.param(shlex.split(unit["Service"]["ExecStart"])[1:], id="systemd"))
    return lines


@pytest.mark.parametrize("argv", serve_command_lines())
def test_serve_command_lines_parse(argv: list[str]) -> None:
    """Each deployment's `serve` arguments parse with the real CLI: every flag exists and every
    value has the right form (a renamed or mistyped flag fails here, not on the node)."""
    assert argv[0] == "serve"
    serve = cli_main.get_command(click.Context(cli_main), "serve")
    assert serve is not None
    with serve.make_context("serve", list(argv[1:])) as ctx:
        assert ctx.params


# -- systemd ------------------------------------------------------------------------------------


@pytest.fixture(name="unit", scope="module")
def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


class TestSystemdUnit:
    def test_ordered_after_containerd_but_not_bound_to_it(
        self, unit: configparser.ConfigParser
    ) -> None:
        """After= and Wants= containerd; nothing that would stop cri-prober with containerd."""
        section = unit["Unit"]
        assert "containerd.service" in section["After"].split()
        assert "containerd.service" in section["Wants"].split()
        for key in ("Requires", "BindsTo", "PartOf", "Requisite"):
            assert key not in section, key

    def test_notify_and_watchdog(self, unit: configparser.ConfigParser) -> None:
        """Type=notify from the main process, with a watchdog."""
        service = unit["Service"]
        assert service["Type"] == "notify"
        assert service["NotifyAccess"] == "main"
        assert 10 <= int(service["WatchdogSec"]) <= 120

    def test_exec_lines(self, unit: configparser.ConfigParser) -> None:
        """ExecStart serves with the rules and the API in the runtime directory; reload is HUP."""
        service = unit["Service"]
        argv = shlex.split(service["ExecStart"])
        assert argv[:2] == ["/usr/local/bin/cri-prober", "serve"]
        assert flag_value(argv, "--config") == "/etc/cri-prober/rules.yaml"
        assert flag_value(argv, "--listen") == API_SOCKET
        assert "/run/" + service["RuntimeDirectory"] == API_DIR
        assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
        assert service["Restart"] in ("always", "on-failure")

    def test_runtime_directory(self, unit: configparser.ConfigParser) -> None:
        """systemd creates /run/cri-prober (0700) for the API socket and keeps it across
        restarts, so the state file (KEP-4781) is there when cri-prober starts again."""
        service = unit["Service"]
        assert service["RuntimeDirectory"] == "cri-prober"
        assert service["RuntimeDirectoryMode"] == "0700"
        assert service["RuntimeDirectoryPreserve"] == "yes"
        assert API_DIR in service["ReadWritePaths"].split()

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("PrivateDevices", "yes"),
            ("ProtectKernelTunables", "yes"),
            ("ProtectKernelModules", "yes"),
            ("ProtectKernelLogs", "yes"),
            ("ProtectControlGroups", "yes"),
            ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
            ("RestrictNamespaces", "yes"),
            ("RestrictSUIDSGID", "yes"),
            ("LockPersonality", "yes"),
            ("MemoryDenyWriteExecute", "yes"),
            ("SystemCallArchitectures", "native"),
            ("CapabilityBoundingSet", ""),
            ("AmbientCapabilities", ""),
        ],
    )
    def test_hardening(self, unit: configparser.ConfigParser, key: str, value: str) -> None:
        """Each hardening option is set as intended."""
        assert unit["Service"][key] == value

    def test_open_file_limit(self, unit: configparser.ConfigParser) -> None:
        """LimitNOFILE is explicit (soft = hard) and far above what probes need: 1,024 (the
        default soft limit) is what a metrics flood exhausted before the reserve existed."""
        assert unit["Service"]["LimitNOFILE"] == str(NOFILE)

    def test_no_user_namespace(self, unit: configparser.ConfigParser) -> None:
        """PrivateUsers= would map the socket's owner away and break connecting to containerd."""
        assert "PrivateUsers" not in unit["Service"]
        assert "DynamicUser" not in unit["Service"]

    def test_install(self, unit: configparser.ConfigParser) -> None:
        """Enabled with the multi-user target."""
        assert unit["Install"]["WantedBy"] == "multi-user.target"


# -- packaging ----------------------------------------------------------------------------------


@pytest.fixture(name="wheel", scope="module")
def _wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True,
        timeout=180,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (built,) = out.glob("cri_prober-*.whl")
    return built


class TestPackaging:
    """`pip install .` builds a complete wheel (a few seconds: pip builds it for real)."""

    def test_wheel_contents(self, wheel: Path) -> None:
        """The wheel has the generated code, py.typed, this module and the console script."""
        assert wheel.name == f"cri_prober-{cri_prober.__version__}-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            dist_info = f"cri_prober-{cri_prober.__version__}.dist-info"
            entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
            metadata = archive.read(f"{dist_info}/METADATA").decode()
        assert "cri_prober/_gen/runtime/v1/api_pb2.py" in names
        assert "cri_prober/_gen/runtime/v1/api_pb2_grpc.py" in names
        generated = {
            path.relative_to(REPO).as_posix()
            for path in (REPO / "cri_prober" / "_gen").rglob("*_pb2*.py")
        }
        assert generated <= names
        assert "cri_prober/py.typed" in names
        assert "cri_prober/systemd.py" in names
        assert not any("__pycache__" in name or name.startswith("tests/") for name in names)
        # Test support stays in tests/: no fake runtime or testbed harness ships.
        assert "cri_prober/testing.py" not in names
        assert "cri_prober/fake_runtime.py" not in names
        assert re.search(r"^cri-prober = cri_prober\.cli:main$", entry_points, re.MULTILINE)
        assert f"Version: {cri_prober.__version__}" in metadata

    def test_installed_console_script_reports_the_version(
        self, wheel: Path, tmp_path: Path
    ) -> None:
        """The cri-prober command installed from the wheel prints --version."""
        target = tmp_path / "site"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
             "--target", str(target), str(wheel)],
            check=True, timeout=120,
        )  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(target)}
        where = subprocess.run(
            [sys.executable, "-c", "import cri_prober; print(cri_prober.__file__)"],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert Path(where.stdout.strip()).is_relative_to(target)  # the wheel, not the checkout
        # Every module of the installed package imports with neither tests/ nor scripts/ around.
        imported = subprocess.run(
            [sys.executable, "-c",
             "import importlib, pkgutil, sys, cri_prober\n"
             "for m in pkgutil.walk_packages(cri_prober.__path__, 'cri_prober.'):\n"
             "    if m.name != 'cri_prober.__main__':  # that one runs the CLI\n"
             "        importlib.import_module(m.name)\n"
             "print(sorted(n.split('.')[0] for n in sys.modules if n.split('.')[0] in "
             "('tests', 'scripts', 'bench')))"],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        assert imported.stdout.strip() == "[]"
        version = subprocess.run(
            [str(target / "bin" / "cri-prober"), "--version"],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        assert version.stdout.strip() == f"cri-prober, version {cri_prober.__version__}"


def _mebibytes(quantity: str) -> int:
    """A Kubernetes memory quantity in Mi or Gi, in MiB."""
    units = {"Mi": 1, "Gi": 1024}
    return int(quantity[:-2]) * units[quantity[-2:]]
