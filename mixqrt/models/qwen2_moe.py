"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), routed experts
(top-k softmax router) and a shared expert scaled by its sigmoid gate (models/moe.py)."""
from __future__ import annotations

from mixqrt.models import moe, qwen2


class ModelArgs(moe.MoEArgs):
    arch = "qwen2_moe"


class Model(moe.MoEMixin, qwen2.Model):
    args_class = ModelArgs
