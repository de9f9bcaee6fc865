# containerd for docker-compose.yml: a disposable "node" to run cri-prober against (dev/CI only).
# There is no official containerd image; Debian's packages give containerd 1.6, runc and the
# standard CNI plugins (installed in /usr/lib/cni, which containerd-config.toml points at).
# BASE_IMAGE: scripts/image-test passes a local Debian bookworm made with mmdebstrap (no registry).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        containerd runc containernetworking-plugins iptables ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# /var/lib/containerd and /run/containerd are volumes in the compose file: snapshots cannot
# live on the container's own overlay filesystem, and the socket directory is shared with
# cri-prober.
HEALTHCHECK --interval=2s --timeout=5s --retries=30 CMD ["ctr", "version"]

ENTRYPOINT ["containerd"]
CMD ["--config", "/etc/containerd/config.toml"]
