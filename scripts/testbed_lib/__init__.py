"""The containerd testbed behind scripts/testbed.py, split by concern.

packages installs containerd, images builds the OCI images, network claims subnets and writes the
CNI config, containerd starts a testbed (through cri for readiness), teardown stops it, cli parses.
"""
