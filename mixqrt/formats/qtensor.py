"""QTensor: a packed tensor (format + shape + bytes). The bytes may be a zero-copy view of an mmap."""
from __future__ import annotations

from types import MappingProxyType

import numpy as np

from mixqrt.errors import QuantError
from mixqrt.formats import layout


def _no_dequantizer(qt):
    raise QuantError("no dequantizer registered (mixqrt.formats.codec registers it on import)")


# Set by mixqrt.formats.codec when it loads (always before a QTensor exists: mixqrt.formats's
# __init__ imports it), so that this module depends on layout only and formats on this module.
_dequantizer = _no_dequantizer


def register_dequantizer(fn) -> None:
    global _dequantizer
    _dequantizer = fn


class QTensor:
    """A tensor in one of mixqrt's formats.

    raw: 1-D uint8 array holding exactly ``layout.expected_nbytes(fmt, shape)`` bytes, laid out as
    described in mixqrt.formats.layout. For plain formats (f32/f16/bf16) the bytes are the values.
    """

    __slots__ = ("fmt", "shape", "raw", "_meta", "__weakref__")   # weakref: ops' GEMM tile cache

    def __init__(self, fmt: str, shape, raw: np.ndarray, meta: dict | None = None):
        if fmt not in layout.PACKED and fmt not in layout.PLAIN and fmt not in layout.INTERLEAVED:
            raise QuantError(f"unknown format {fmt!r}; known: "
                             f"{', '.join(sorted((*layout.PACKED, *layout.PLAIN, *layout.INTERLEAVED)))}")
        shape = tuple(int(s) for s in shape)
        want = layout.expected_nbytes(fmt, shape)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raw = raw.reshape(-1).view(np.uint8)
        if raw.size != want:
            raise QuantError(f"{fmt} tensor of shape {shape} needs {want} bytes, got {raw.size}")
        self.fmt = fmt
        self.shape = shape
        self.raw = raw
        self.meta = meta

    @property
    def meta(self):
        """Per-tensor metadata, read-only: the kernels cache arguments derived from it (q3p levels),
        so a change must be a new mapping (``qt.meta = {...}``), which they notice."""
        return self._meta

    @meta.setter
    def meta(self, value) -> None:
        self._meta = MappingProxyType(dict(value or {}))

    # ------------------------------------------------------------------ sizes
    @property
    def nbytes(self) -> int:
        """Packed bytes, including every scale, offset, codebook and trailer."""
        return int(self.raw.size)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.numel

    @property
    def rows(self) -> int:
        return layout.rows_cols(self.shape)[0]

    @property
    def cols(self) -> int:
        return layout.rows_cols(self.shape)[1]

    # ------------------------------------------------------------------ bytes
    def to_bytes(self) -> bytes:
        return self.raw.tobytes()

    @classmethod
    def from_bytes(cls, b, fmt: str, shape) -> "QTensor":
        """Wrap bytes (or any buffer: bytes, memoryview, mmap slice) without copying."""
        return cls(fmt, shape, np.frombuffer(b, dtype=np.uint8))

    # ------------------------------------------------------------------ values
    def dequantize(self) -> np.ndarray:
        return _dequantizer(self)

    def __repr__(self) -> str:
        return f"QTensor(fmt={self.fmt!r}, shape={self.shape}, nbytes={self.nbytes}, bpw={self.bits_per_weight:.3f})"
