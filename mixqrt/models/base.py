"""Helpers shared by the model graphs: tensor shapes, float32 conversion, row fusion at load time."""
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


def fuse_rows(parts: list):
    """Stack [N_i, K] tensors into one [sum N_i, K] tensor, or None when they cannot share one.

    Packed rows are independent (each row is its own run of blocks), so fusing QTensors of one
    format is concatenating their bytes. Formats with a per-tensor trailer (q5g) or per-tensor
    metadata are not fused; the graph then runs one matmul per part.
    """
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.ascontiguousarray(np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=0))
    if not all(is_qtensor(p) for p in parts):
        return None
    from mixqrt.quant import layout
    from mixqrt.quant.qtensor import QTensor
    fmt = parts[0].fmt
    if any(p.fmt != fmt or len(p.shape) != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
        return None
    if fmt in layout.PACKED and layout.PACKED[fmt].trailer:
        return None
    if any(p.meta for p in parts):
        return None
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    return QTensor(fmt, shape, np.concatenate([np.asarray(p.raw).reshape(-1) for p in parts]))
