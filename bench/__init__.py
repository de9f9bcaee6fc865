"""Benchmarks for cri-prober: each module is runnable as ``python -m bench.<name> [--quick]``.

Every comparison is a ratio of two contenders measured side by side in one run (interleaved
rounds), reported as the median over rounds; docs/benchmarks.md has the results and discussion.
"""
