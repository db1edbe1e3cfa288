"""Helpers shared by tests, benchmarks and notebooks (references, tiny checkpoints)."""
