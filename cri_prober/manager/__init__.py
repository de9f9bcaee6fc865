"""The manager layer: one owner of container slots and workers (the kubelet's probeManager)."""
