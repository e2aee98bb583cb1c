"""Workloads, their oracle hit rates and load drivers: what the demo and the benchmarks share."""
