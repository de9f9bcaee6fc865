"""Pod specs from the node's own sources (the kubelet's /pods, the API server, static pod files):
the probes the kubelet runs, matched to CRI containers by pod UID and container name."""
