"""Helpers shared by the model graphs: tensor shapes, float32 conversion (row fusion: models/spec.fuse)."""
from __future__ import annotations

import numpy as np

from mixqrt.errors import ModelError


def is_qtensor(t) -> bool:
    return hasattr(t, "raw") and hasattr(t, "fmt") and hasattr(t, "dequantize")


def tensor_shape(t) -> tuple:
    if is_qtensor(t):
        return tuple(t.shape)
    if isinstance(t, np.ndarray):
        return t.shape
    raise ModelError(f"expected a QTensor or numpy array, got {type(t).__name__}")


def to_f32(t, name: str = "tensor") -> np.ndarray:
    """A float32 array for norm weights, biases and float matrices (QTensors are dequantized)."""
    arr = t.dequantize() if is_qtensor(t) else t
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.floating):
        raise ModelError(f"tensor {name!r} must be a float array or QTensor, got "
                         f"{getattr(arr, 'dtype', type(arr).__name__)}")
    return np.ascontiguousarray(arr, dtype=np.float32)
