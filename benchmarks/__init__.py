"""Benchmarks: timings as ratios against torch baselines measured in the same run."""
