"""One error class per layer; all subclass ValueError so callers can catch bad input broadly."""


class MixqrtError(ValueError):
    """Base of every error mixqrt raises for bad input or bad files."""


class QuantError(MixqrtError):
    """Bad input to quantization: NaN/Inf, wrong dtype or rank, unknown format or recipe."""


class FormatError(MixqrtError):
    """A model file (.mxq, GGUF, safetensors) is truncated, inconsistent or lying."""


class ModelError(MixqrtError):
    """A model cannot be built: unknown architecture, missing or mis-shaped tensor, bad config."""


class GenerationError(MixqrtError):
    """Bad generation request: prompt too long for the context, bad argument types or values."""


class KernelError(MixqrtError):
    """Bad arguments to a kernel: shape, dtype, alignment or format mismatch."""
