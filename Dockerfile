# syntax=docker/dockerfile:1
# cri-prober container image: `docker build -t cri-prober:0.1.0 .`
#
# Two stages: the builder turns the checkout into wheels (cri-prober and every dependency), the
# final stage installs them from that local directory without a compiler, pip cache or source.
# The generated protobuf code is committed under cri_prober/_gen, so no protoc runs here.

ARG PYTHON_VERSION=3.11
# The base of both stages: any Debian-like image with python3 (and its venv module). The default
# is the official slim image; scripts/image-test passes a local one made with mmdebstrap from
# Debian's packages (python3, python3-venv), so the image builds with no registry at all.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim

FROM ${BASE_IMAGE} AS builder
WORKDIR /src
# Only what the wheel is built from (see .dockerignore): metadata, README (the long description)
# and the package. Tests, scripts and deploy files stay out of the image.
COPY pyproject.toml README.md ./
COPY cri_prober ./cri_prober
RUN python3 -m pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels .


FROM ${BASE_IMAGE}

ARG BASE_IMAGE
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="cri-prober" \
      org.opencontainers.image.description="Kubelet-exact liveness, readiness and startup probes for containers, spoken over CRI straight to containerd." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# cri-prober lives in its own virtualenv, /opt/cri-prober: the same on every base, whether its
# python3 is the official image's (/usr/local) or Debian's (whose pip refuses to install into the
# system Python, PEP 668). Its bin/ comes first on PATH, so `cri-prober` is the command as before.
# CONTAINER_RUNTIME_ENDPOINT: the runtime serve (and `cri-prober version` / `check` run in the
# container) talks to; override it for k3s (/run/k3s/containerd/containerd.sock) or CRI-O.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/cri-prober/bin:$PATH \
    CONTAINER_RUNTIME_ENDPOINT=unix:///run/containerd/containerd.sock

# Who runs it. CRI access is root-equivalent on the node whoever holds it (ExecSync into any
# container), so the point of a non-root user is to shrink what a compromised process can do
# inside the container, not to make the socket safe. containerd creates its socket
# root:root 0660, so the default user is uid 65532 with primary group 0: the socket's group
# gives it the connect() it needs, without being uid 0. If your runtime's socket has another
# group (containerd `[grpc] gid`), run with that group (`--group-add`, k8s runAsGroup /
# supplementalGroups). Where the API socket must live in a root-owned host directory (the
# compose file's bind mount, a hostPath), run as uid 0 with every capability dropped instead:
# root without CAP_DAC_OVERRIDE still owns, and so can use, root-owned sockets and directories;
# or first give the directory to 65532:0 (the Kubernetes DaemonSets' init container runs
# `chown 65532:0 /run/cri-prober` from this image as uid 0 with CAP_CHOWN alone).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/cri-prober \
    && /opt/cri-prober/bin/python -m pip install --no-cache-dir --disable-pip-version-check \
        --no-index --find-links /wheels cri-prober \
    && /opt/cri-prober/bin/python -m pip uninstall --yes --disable-pip-version-check pip \
    && useradd --system --uid 65532 --gid 0 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin cri-prober \
    && install -d -o 65532 -g 0 -m 0700 /run/cri-prober \
    && install -d -o 0 -g 0 -m 0755 /etc/cri-prober

USER 65532:0

# The API socket lives here (mount a volume to reach it from outside the container).
VOLUME ["/run/cri-prober"]
# Prometheus metrics (--metrics-address); the gRPC API itself is never on TCP here.
EXPOSE 9808

# `cri-prober health` speaks grpc.health.v1 to the API socket: exit 0 SERVING (the runtime is
# reachable and discovery fresh), non-zero otherwise; `|| exit 1` maps its other codes (2-4)
# onto the one Docker documents for "unhealthy".
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD cri-prober health || exit 1

ENTRYPOINT ["cri-prober"]
# Add `--config /etc/cri-prober/rules.yaml` (mounted) to probe by rules; without it only pod
# annotations define probes.
CMD ["serve", "--listen", "unix:///run/cri-prober/cri-prober.sock", "--metrics-address", "0.0.0.0:9808"]
