"""Benchmarks that compare tandem with baselines measured in the same run."""
