"""The discovery layer: the node's pods and containers as the kubelet's PLEG sees them.

A ``NodeSource`` keeps a view of the node fresh and publishes what changed; ``pleg.Discovery`` does
it over CRI by relisting or by following container events. ``naming`` resolves the names users give
containers.
"""
