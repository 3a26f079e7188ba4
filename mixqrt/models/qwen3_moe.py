"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no bias) and routed
experts (top-k of num_experts, norm_topk_prob), no shared expert (models/moe.py)."""
from __future__ import annotations

from mixqrt.models import moe, qwen3
from mixqrt.models.arch import Arch, register


class ModelArgs(moe.MoEArgs):
    arch = "qwen3_moe"


class Model(moe.MoEMixin, qwen3.Model):
    args_class = ModelArgs


ARCH = register(Arch("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True, fold_norms=False,
                     gguf_name="qwen3moe", gguf_config=moe.gguf_config(norm_topk_prob=True),
                     tiny={**moe.TINY, "attention_bias": False, "head_dim": 32, "norm_topk_prob": True}))
