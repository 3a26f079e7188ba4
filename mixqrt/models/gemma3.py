"""Gemma 3 (the text decoder; HF model_type gemma3_text, GGUF architecture gemma3).

Differences from the Qwen2 graph, each in the layer function it changes:
  embed      the embedding times sqrt(hidden_size) (in float32, as llama.cpp and HF's float32 runs)
  norms      RMSNorm multiplies by (1 + weight); four per layer: input (before attention),
             post_attention (on the attention output, before the residual add), pre_feedforward and
             post_feedforward around the FFN; the final norm too
  qkv        per-head RMSNorm on q and k before RoPE; q scaled by query_pre_attn_scalar ** -0.5
  RoPE       sliding (local) layers at rope_local_base_freq without scaling, full (global) layers at
             rope_theta with config.rope_scaling
  attention  local layers see the last sliding_window positions (ops.attention window=)
  FFN        GeGLU: down(gelu_tanh(gate) * up)
  head       final_logit_softcapping, when set: cap * tanh(logits / cap)
Which layers are local: config.layer_types, else every layer but each sliding_window_pattern-th.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mixqrt import ops
from mixqrt.errors import ModelError
from mixqrt.models import qwen2
from mixqrt.models.arch import Arch, register


@dataclass
class ModelArgs(qwen2.ModelArgs):
    """Gemma3TextConfig's keys (defaults as transformers' Gemma3TextConfig)."""
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list | None = None
    rope_local_base_freq: float = 10000.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, config, model_type=None):
        return super().from_dict(config, model_type="gemma3")

    def validate(self) -> None:
        super().validate()
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelError(f"config hidden_activation {str(self.hidden_activation)[:40]!r} is not supported "
                             f"(gemma3: gelu_pytorch_tanh)")
        if self.attn_logit_softcapping is not None:
            raise ModelError("config attn_logit_softcapping is not supported (Gemma 3 has none)")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq") + \
                (("final_logit_softcapping",) if self.final_logit_softcapping is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ModelError(f"config {name} must be a positive finite number, got {v!r}")
            setattr(self, name, float(v))
        n = self.num_hidden_layers
        if self.layer_types is not None:
            if not isinstance(self.layer_types, list) or len(self.layer_types) != n or \
                    any(t not in ("sliding_attention", "full_attention") for t in self.layer_types):
                raise ModelError(f"config layer_types must list {n} entries of 'sliding_attention' or "
                                 f"'full_attention'")
            sliding = [t == "sliding_attention" for t in self.layer_types]
        else:
            pat = self.sliding_window_pattern
            if isinstance(pat, bool) or not isinstance(pat, int) or pat < 1:
                raise ModelError(f"config sliding_window_pattern must be a positive integer, got {pat!r}")
            sliding = [(i + 1) % pat != 0 for i in range(n)]
        if self.sliding_window is None:
            sliding = [False] * n
        else:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ModelError(f"config sliding_window must be a positive integer, got {w!r}")
        self.sliding = sliding


@dataclass
class Layer(qwen2.Layer):
    q_norm: np.ndarray = None          # [Dh] float32 (HF weight; the graph multiplies by 1 + it)
    k_norm: np.ndarray = None
    pre_ff_norm: np.ndarray = None     # [D]
    post_ff_norm: np.ndarray = None    # [D]


def _norm(x, w, eps):
    """Gemma's RMSNorm: x / rms(x) * (1 + w)."""
    return ops.rmsnorm(x, w + np.float32(1.0), eps)


class Model(qwen2.Model):
    args_class = ModelArgs
    layer_class = Layer
    layer_fields = qwen2.LAYER_FIELDS + (("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight"),
                                         ("pre_ff_norm", "pre_feedforward_layernorm.weight"),
                                         ("post_ff_norm", "post_feedforward_layernorm.weight"))

    def _window(self, li: int):
        a = self.args
        return a.sliding_window if a.sliding[li] else None

    def kv_windows(self):
        return [self._window(li) for li in range(self.args.num_hidden_layers)]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        x = ops.embed(self.embed_tokens, ids)
        x *= np.float32(math.sqrt(self.args.hidden_size))
        return x

    def rope(self, li: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if self.args.sliding[li]:
            return ops.rope(x, positions, self.args.rope_local_base_freq)
        return super().rope(li, x, positions)

    def qkv(self, li: int, x: np.ndarray, positions: np.ndarray):
        a, L, t = self.args, self.layers[li], x.shape[0]
        nq, nkv, hq, hkv, dh = self.n_q, self.n_kv, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = qwen2._proj(L.qkv, _norm(x, L.input_norm, a.rms_norm_eps), L.o_proj)       # [T, Nq+2Nkv]
        if L.qkv_bias is not None:
            qkv += L.qkv_bias
        q = _norm(qkv[:, :nq].reshape(t * hq, dh), L.q_norm, a.rms_norm_eps).reshape(t, hq, dh)
        k = _norm(qkv[:, nq:nq + nkv].reshape(t * hkv, dh), L.k_norm, a.rms_norm_eps).reshape(t, hkv, dh)
        qk = self.rope(li, np.concatenate([q, k], axis=1), positions)
        q = qk[:, :hq]
        q *= np.float32(a.query_pre_attn_scalar ** -0.5 * math.sqrt(dh))   # the op scales by 1/sqrt(Dh)
        return q, qk[:, hq:], qkv[:, nq + nkv:].reshape(t, hkv, dh)

    def attend(self, li, q, cache, pos0, out=None):
        if getattr(cache, "packed", False):
            return cache.attend(li, q, pos0, out)
        return ops.attention(q, cache.keys[li], cache.values[li], pos0, out, window=self._window(li))

    def attend_batch(self, li, q, caches, pos, out):
        if getattr(caches[0], "packed", False):
            ops.kv_attention_batch(q, caches, li, pos, out=out)
            return
        w = self._window(li)
        if w is None or all(int(p) + 1 <= w for p in pos):
            return super().attend_batch(li, q, caches, pos, out)
        for b, c in enumerate(caches):
            ops.attention(q[b:b + 1], c.keys[li], c.values[li], int(pos[b]), out[b:b + 1], window=w)

    def attn_out(self, li: int, x: np.ndarray, att: np.ndarray) -> None:
        """x += post_attention_norm(o_proj(att))."""
        L = self.layers[li]
        o = ops.matmul(L.o_proj, att.reshape(x.shape[0], self.n_q), then=L.gate_up[0])
        if L.o_bias is not None:
            o += L.o_bias
        x += _norm(o, L.post_norm, self.args.rms_norm_eps)

    def ffn_in(self, li: int, x: np.ndarray) -> np.ndarray:
        return _norm(x, self.layers[li].pre_ff_norm, self.args.rms_norm_eps)

    def ffn_out(self, li: int, x: np.ndarray, gate: np.ndarray, up: np.ndarray | None = None) -> None:
        """x += post_feedforward_norm(down(gelu_tanh(gate) * up)); up None: gate is the fused output."""
        if up is None:
            inter = gate.shape[-1] // 2
            gate, up = gate[:, :inter], gate[:, inter:]
        L = self.layers[li]
        y = ops.matmul(L.down, ops.gelu_tanh_mul(gate, up), then=self._next_weight(li))
        x += _norm(y, L.post_ff_norm, self.args.rms_norm_eps)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return _norm(x, self.norm, self.args.rms_norm_eps)

    def head(self, x: np.ndarray) -> np.ndarray:
        a = self.args
        first = self.layers[0].qkv[0] if self.layers and self.layers[0] is not None else None
        logits = ops.matmul(self.lm_head, self.final_norm(x), then=first)
        if a.final_logit_softcapping is not None:
            cap = np.float32(a.final_logit_softcapping)
            logits = np.tanh(logits / cap) * cap
        return logits


def _gguf_config(m, cfg: dict) -> None:
    """llama.cpp's Gemma 3 metadata: every 6th layer global, local RoPE base 10000 unless the file says
    (rope.freq_base_swa); attention scale 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 27B."""
    del cfg["hidden_act"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["sliding_window"] = m.int("attention.sliding_window", 4096)
    cfg["sliding_window_pattern"] = 6
    cfg["rope_local_base_freq"] = m.float("rope.freq_base_swa", 10000.0)
    cfg["query_pre_attn_scalar"] = m.hidden // m.n_head if (m.hidden, m.n_head) == (5376, 32) else m.head_dim
    if m.garch == "gemma-embedding":            # EmbeddingGemma: this graph, bidirectional (mixqrt.generation.embed)
        cfg["use_bidirectional_attention"] = True
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = m.float(key, required=False)
        if v:
            cfg[key] = v


# Gemma 3: text-only checkpoints say gemma3_text; ffn_norm in GGUF is the norm before the FFN
ARCH = register(Arch(
    "gemma3", "Gemma3ForCausalLM", aliases=("gemma3_text",), qk_norm=True, ffn_norms=True, fold_norms=False,
    float_norms=True, norm_plus_one=True, gguf_aliases=("gemma-embedding",),
    gguf_names={"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    gguf_config=_gguf_config,
    tiny={"model_type": "gemma3_text", "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh",
          "head_dim": 32, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 24,
          "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "final_logit_softcapping": None}))
