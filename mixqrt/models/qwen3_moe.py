"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no bias) and routed
experts (top-k of num_experts, norm_topk_prob), no shared expert (models/moe.py)."""
from __future__ import annotations

from mixqrt.models import moe, qwen3


class ModelArgs(moe.MoEArgs):
    arch = "qwen3_moe"


class Model(moe.MoEMixin, qwen3.Model):
    args_class = ModelArgs
