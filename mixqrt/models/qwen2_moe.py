"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), routed experts
(top-k softmax router) and a shared expert scaled by its sigmoid gate (models/moe.py)."""
from __future__ import annotations

from mixqrt.models import moe, qwen2
from mixqrt.models.arch import Arch, register


class ModelArgs(moe.MoEArgs):
    arch = "qwen2_moe"


class Model(moe.MoEMixin, qwen2.Model):
    args_class = ModelArgs


ARCH = register(Arch("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias="always", moe=True, fold_norms=False,
                     gguf_name="qwen2moe", gguf_config=moe.gguf_config(norm_topk_prob=False),
                     tiny={**moe.TINY, "norm_topk_prob": False, "shared_expert_intermediate_size": 48}))
