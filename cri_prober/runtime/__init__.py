"""The runtime layer: the CRI client, endpoint resolution and the generated code behind them.

Nothing above this layer sees gRPC or protobuf types from ``runtime.v1``: it gets frozen
dataclasses and the error classes of ``cri_prober.errors``.
"""
