"""Benchmark helpers: workload prompt sets and loaders."""
