"""Helpers for mixqrt's own tests and benchmarks (synthetic model files)."""
