"""mixqrt: a pure-CPU LLM runtime with per-role mixed-bit quantization."""
from mixqrt.errors import (FormatError, GenerationError, KernelError, MixqrtError, ModelError,  # noqa: F401
                           QuantError)

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing mixqrt stays cheap
    if name in ("Pipeline", "load"):
        from mixqrt import pipeline
        return getattr(pipeline, name)
    if name == "SamplingParams":
        from mixqrt.generation import params
        return params.SamplingParams
    if name in ("Engine", "EngineBusy"):
        from mixqrt.generation import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'mixqrt' has no attribute {name!r}")
