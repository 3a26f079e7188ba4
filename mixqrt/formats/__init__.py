"""Quantization formats: mixqrt.formats.quantize(w, fmt) -> QTensor; FORMATS lists every format's traits.

layout (byte layouts, ids and sizes from the C table), kmeans, rotation (a tensor's Hadamard rotation),
qtensor (the tensor type) and codec (quantize / dequantize per format, which registers the dequantizer)."""
from mixqrt.formats.codec import FORMATS, Format, bind_range, dequantize, dequantize_rows, quantize  # noqa: F401
from mixqrt.formats.qtensor import QTensor  # noqa: F401

__all__ = ["FORMATS", "Format", "QTensor", "bind_range", "dequantize", "dequantize_rows", "quantize"]
