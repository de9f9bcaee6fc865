"""Probe handlers: pure functions from a resolved target to an outcome (kubelet pkg/probe).

A failing target is an outcome (``ProbeResult.FAILURE`` with readable output), never an exception;
only a probe that could not run at all raises ``ProbeError``.
"""
