"""Test support shared by the unit, real-containerd and reliability tests and the benchmarks."""
