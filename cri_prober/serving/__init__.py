"""The serving layer: the local gRPC API (criprober.v1, grpc.health.v1, reflection) and metrics.

Servers read a frozen snapshot of the manager's state and follow its event stream; they never
reach into workers.
"""
