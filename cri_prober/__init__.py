"""cri-prober: kubelet-exact container probes spoken over CRI straight to the container runtime."""

__version__ = "0.1.0"
