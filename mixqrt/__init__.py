"""mixqrt: a pure-CPU LLM runtime with per-role mixed-bit quantization."""
from mixqrt.errors import (FormatError, GenerationError, KernelError, MixqrtError, ModelError,  # noqa: F401
                           QuantError)

__version__ = "0.1.0"
