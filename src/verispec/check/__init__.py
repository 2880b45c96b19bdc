"""Lossless checks: state oracles and output comparisons."""
