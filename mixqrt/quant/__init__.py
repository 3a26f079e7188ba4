"""Quantization formats: mixqrt.quant.quantize(w, fmt) -> QTensor; FORMATS lists every format's traits."""
from mixqrt.quant.formats import FORMATS, Format, bind_range, dequantize, dequantize_rows, quantize  # noqa: F401
from mixqrt.quant.qtensor import QTensor  # noqa: F401

__all__ = ["FORMATS", "Format", "QTensor", "bind_range", "dequantize", "dequantize_rows", "quantize"]
