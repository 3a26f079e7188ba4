"""Qwen3: the Qwen2 graph without q/k/v bias, with an RMSNorm per head on q and on k (before RoPE)
and a head_dim of its own (Qwen3-0.6B: hidden 1024, 16 heads of 128)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixqrt import ops
from mixqrt.models import qwen2
from mixqrt.models.arch import Arch, register


class ModelArgs(qwen2.ModelArgs):
    """Qwen3's config.json keys; attention_bias (q/k/v/o, as transformers' Qwen3) defaults to False."""

    @classmethod
    def from_dict(cls, config, model_type=None):
        return super().from_dict(config, model_type=model_type or "qwen3")


@dataclass
class Layer(qwen2.Layer):
    q_norm: np.ndarray = None       # [Dh] float32, per head of q
    k_norm: np.ndarray = None       # [Dh] float32, per head of k


class Model(qwen2.Model):
    args_class = ModelArgs
    layer_class = Layer
    layer_fields = qwen2.LAYER_FIELDS + (("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight"))

    def qkv(self, li: int, x: np.ndarray, positions: np.ndarray):
        """-> q [T, Hq, Dh], k [T, Hkv, Dh] (each head RMS-normed, then rotated), v [T, Hkv, Dh]."""
        a, L, t = self.args, self.layers[li], x.shape[0]
        nq, nkv, hq, hkv, dh = self.n_q, self.n_kv, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = qwen2._proj(L.qkv, ops.rmsnorm(x, L.input_norm, a.rms_norm_eps), L.o_proj)   # [T, Nq+2Nkv]
        if L.qkv_bias is not None:
            qkv += L.qkv_bias
        q = ops.rmsnorm(qkv[:, :nq].reshape(t * hq, dh), L.q_norm, a.rms_norm_eps).reshape(t, hq, dh)
        k = ops.rmsnorm(qkv[:, nq:nq + nkv].reshape(t * hkv, dh), L.k_norm, a.rms_norm_eps).reshape(t, hkv, dh)
        qk = self.rope(li, np.concatenate([q, k], axis=1), positions)
        return qk[:, :hq], qk[:, hq:], qkv[:, nq + nkv:].reshape(t, hkv, dh)


ARCH = register(Arch("qwen3", "Qwen3ForCausalLM", qk_norm=True, gguf_rope_freqs=True,
                     tiny={"attention_bias": False, "head_dim": 32}))
