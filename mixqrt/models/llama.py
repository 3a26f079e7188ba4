"""Llama: the Qwen2 graph without q/k/v bias (unless config.attention_bias, which also adds o_proj bias)."""
from __future__ import annotations

from mixqrt.models import qwen2
from mixqrt.models.arch import Arch, register


class ModelArgs(qwen2.ModelArgs):
    """Same HF config keys; model_type defaults to 'llama' (so attention_bias defaults to False)."""

    @classmethod
    def from_dict(cls, config, model_type=None):
        mt = model_type or (config.get("model_type") if isinstance(config, dict) else None) or "llama"
        return super().from_dict(config, model_type=mt)


class Model(qwen2.Model):
    """Same forward as Qwen2."""

    args_class = ModelArgs


# llama.cpp's converter permutes Llama's q/k rows (its RoPE pairs interleaved values); io/gguf undoes it
ARCH = register(Arch("llama", "LlamaForCausalLM", native_decode=True, gguf_permuted_qk=True, gguf_rope_freqs=True,
                     tiny={"attention_bias": False}))
