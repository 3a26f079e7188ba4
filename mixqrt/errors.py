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


class RequestError(GenerationError):
    """A bad or unsupported request field (mixqrt.serving.protocol): ``field`` names it, OpenAI's error "param"
    (HTTP 400); ``code`` is OpenAI's error code where one applies ("context_length_exceeded")."""

    def __init__(self, field: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code

    @property
    def param(self) -> str | None:
        return self.field
