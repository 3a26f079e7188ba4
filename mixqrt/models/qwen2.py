"""Qwen2 (and, without q/k/v bias, Llama) decoder graph in the mlx-lm style.

Weights arrive with Hugging Face names and [out, in] layouts, each a QTensor or a float32 array.
``sanitize`` turns that checkpoint layout into the runtime layout once, at load: q/k/v fused into
one [Nq+2Nkv, K] projection and gate/up into one [2I, K] when the parts share a format, norm
weights and biases as float32, and the lm_head resolved (tied or not). The forward never copies
weights.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import numpy as np

from mixqrt import ops
from mixqrt.cache import KVCache
from mixqrt.errors import GenerationError, ModelError
from mixqrt.limits import check_config_limits
from mixqrt.models.base import fuse_rows, tensor_shape, to_f32

_REQUIRED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


# ============================================================================ config
@dataclass
class ModelArgs:
    """Field names are the HF config.json keys; defaults are those of transformers' configs."""
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None   # None: the architecture's default (qwen2: True, llama: False)
    mlp_bias: bool = False
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, config: dict, model_type: str | None = None) -> "ModelArgs":
        """Build from a config.json dict; unknown keys are kept in ``extra`` and otherwise ignored."""
        if not isinstance(config, dict):
            raise ModelError(f"model config must be a dict, got {type(config).__name__}")
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ModelError(f"model config is missing required key(s): {', '.join(missing)}")
        names = {f.name for f in fields(cls)} - {"extra", "model_type"}
        kw = {k: config[k] for k in names if config.get(k) is not None}
        mt = model_type or config.get("model_type") or "qwen2"
        args = cls(model_type=str(mt), extra={k: v for k, v in config.items() if k not in names}, **kw)
        args.validate()
        return args

    def validate(self) -> None:
        check_config_limits(vars(self), "model config")   # bounds first: nothing is sized from a lie

        def pos_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ModelError(f"config {name} must be a positive integer, got {v!r}")
            setattr(self, name, int(v))

        for name in _REQUIRED + ("max_position_embeddings",):
            pos_int(name)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        pos_int("num_key_value_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelError(f"num_attention_heads={self.num_attention_heads} does not divide "
                                 f"hidden_size={self.hidden_size} (and no head_dim is given)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        pos_int("head_dim")
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ModelError(f"config {name} must be a positive finite number, got {v!r}")
            setattr(self, name, float(v))
        if self.hidden_act not in ("silu", "swish"):
            raise ModelError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.mlp_bias:
            raise ModelError("mlp_bias=True is not supported")
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in (None, "default"):
                raise ModelError(f"rope_scaling type {kind!r} is not supported (refusing to run with wrong "
                                 f"positions)")
        self.tie_word_embeddings = bool(self.tie_word_embeddings)
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"
        self.attention_bias = bool(self.attention_bias)


# ============================================================================ weights
@dataclass
class Layer:
    input_norm: np.ndarray          # [D] float32
    qkv: list                       # fused: [W [Nq+2Nkv, D]]; unfused fallback: [Wq, Wk, Wv]
    qkv_bias: np.ndarray | None     # [Nq+2Nkv] float32
    o_proj: object                  # [D, Nq]
    o_bias: np.ndarray | None       # [D] float32 (llama attention_bias only)
    post_norm: np.ndarray           # [D] float32
    gate_up: list                   # fused: [W [2I, D]]; unfused fallback: [Wgate, Wup]
    down: object                    # [D, I]


def _proj(ws: list, x: np.ndarray) -> np.ndarray:
    if len(ws) == 1:
        return ops.matmul(ws[0], x)
    return np.concatenate([ops.matmul(w, x) for w in ws], axis=-1)   # only when formats differ


def _hot_max_t() -> int:
    v = os.environ.get("MIXQRT_HOT_MAX_T", "0")
    try:
        return max(0, int(v))
    except ValueError:
        raise ModelError(f"MIXQRT_HOT_MAX_T={v!r} is not a non-negative integer") from None


# Forward calls of at most this many tokens run with the pool in hot mode (ops.hot): workers spin
# between the ~100 products of a decode step instead of futex-sleeping after each. Off by default
# (0): measured neutral to 7-9 % slower at 2 threads on the 7B file (docs/decode-ab.md); set
# MIXQRT_HOT_MAX_T=16 (or this attribute) to turn it on.
HOT_MAX_T = _hot_max_t()


class Model:
    """Decoder-only transformer. ``model(tokens, cache, pos0)`` -> logits."""

    args_class = ModelArgs
    kv_dtype = np.float32          # set to np.float16 to halve the KV cache (ops.attention reads both)

    def __init__(self, args: ModelArgs, weights: dict, generation_config: dict | None = None):
        if not isinstance(args, ModelArgs):
            args = self.args_class.from_dict(args)
        self.args = args
        self.generation_config = dict(generation_config or {})
        a = args
        self.n_q = a.num_attention_heads * a.head_dim           # width of q
        self.n_kv = a.num_key_value_heads * a.head_dim          # width of k and of v
        w = self.sanitize(dict(weights))
        self.embed_tokens = w.pop("model.embed_tokens.weight")  # [V, D]
        self.norm = w.pop("model.norm.weight")                  # [D] float32
        self.lm_head = w.pop("lm_head.weight")                  # [V, D]
        self.layers = []
        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(Layer(
                input_norm=w.pop(p + "input_layernorm.weight"),
                qkv=w.pop(p + "self_attn.qkv_proj.weight"),
                qkv_bias=w.pop(p + "self_attn.qkv_proj.bias", None),
                o_proj=w.pop(p + "self_attn.o_proj.weight"),
                o_bias=w.pop(p + "self_attn.o_proj.bias", None),
                post_norm=w.pop(p + "post_attention_layernorm.weight"),
                gate_up=w.pop(p + "mlp.gate_up_proj.weight"),
                down=w.pop(p + "mlp.down_proj.weight"),
            ))
        self.unused_weights = sorted(w)   # e.g. rotary inv_freq buffers; kept for inspection

    # ------------------------------------------------------------------ load-time layout
    def sanitize(self, w: dict) -> dict:
        """Checkpoint layout -> runtime layout. Accepts already fused qkv_proj / gate_up_proj tensors
        (a .mxq may store them fused so that loading stays zero-copy)."""
        a = self.args
        d, inter = a.hidden_size, a.intermediate_size

        def take(name, shape, vector=False):
            if name not in w:
                raise ModelError(f"missing tensor {name!r}")
            t = w.pop(name)
            got = tensor_shape(t)
            if got != tuple(shape):
                raise ModelError(f"tensor {name!r} has shape {got}, expected {tuple(shape)}")
            return to_f32(t, name) if vector else (to_f32(t, name) if isinstance(t, np.ndarray) else t)

        out = {}
        out["model.embed_tokens.weight"] = take("model.embed_tokens.weight", (a.vocab_size, d))
        out["model.norm.weight"] = take("model.norm.weight", (d,), vector=True)
        if "lm_head.weight" in w:
            out["lm_head.weight"] = take("lm_head.weight", (a.vocab_size, d))
        elif a.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        else:
            raise ModelError("missing tensor 'lm_head.weight' (tie_word_embeddings is false)")

        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}."
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                out[p + n] = take(p + n, (d,), vector=True)
            # attention: q/k/v -> qkv
            f = p + "self_attn.qkv_proj."
            if f + "weight" in w:
                out[f + "weight"] = [take(f + "weight", (self.n_q + 2 * self.n_kv, d))]
                if a.attention_bias:
                    out[f + "bias"] = take(f + "bias", (self.n_q + 2 * self.n_kv,), vector=True)
            else:
                parts = [take(p + "self_attn.q_proj.weight", (self.n_q, d)),
                         take(p + "self_attn.k_proj.weight", (self.n_kv, d)),
                         take(p + "self_attn.v_proj.weight", (self.n_kv, d))]
                fused = fuse_rows(parts)
                out[f + "weight"] = [fused] if fused is not None else parts
                if a.attention_bias:
                    out[f + "bias"] = np.concatenate([
                        take(p + "self_attn.q_proj.bias", (self.n_q,), vector=True),
                        take(p + "self_attn.k_proj.bias", (self.n_kv,), vector=True),
                        take(p + "self_attn.v_proj.bias", (self.n_kv,), vector=True)])
            out[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight", (d, self.n_q))
            if a.attention_bias and a.model_type != "qwen2":
                out[p + "self_attn.o_proj.bias"] = take(p + "self_attn.o_proj.bias", (d,), vector=True)
            # mlp: gate/up -> gate_up
            g = p + "mlp.gate_up_proj.weight"
            if g in w:
                out[g] = [take(g, (2 * inter, d))]
            else:
                parts = [take(p + "mlp.gate_proj.weight", (inter, d)), take(p + "mlp.up_proj.weight", (inter, d))]
                fused = fuse_rows(parts)
                out[g] = [fused] if fused is not None else parts
            out[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight", (d, inter))
        out.update(w)   # leftovers (ignored by the graph)
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def context_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def make_cache(self, max_len: int | None = None, dtype=None) -> KVCache:
        """A cache for max_len positions (default: the whole context); dtype float32 or float16
        (default: self.kv_dtype)."""
        a = self.args
        return KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                       int(max_len or a.max_position_embeddings), dtype or self.kv_dtype)

    # ------------------------------------------------------------------ forward
    def __call__(self, tokens, cache: KVCache | None = None, pos0: int | None = None, *,
                 last_only: bool = False, chunk_size: int = 512) -> np.ndarray:
        """Run `tokens` ([T] ints) at positions pos0 .. pos0+T-1 (pos0 defaults to cache.offset).

        Returns logits [vocab] for the last position when last_only, else [T, vocab] float32.
        The prompt is processed chunk_size tokens at a time so activations stay bounded.
        """
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise GenerationError(f"tokens must be a non-empty 1-D integer array, got shape {ids.shape} "
                                  f"dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.args.vocab_size:
            raise GenerationError(f"token ids must be in [0, {self.args.vocab_size}), got "
                                  f"[{int(ids.min())}, {int(ids.max())}]")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise GenerationError(f"chunk_size must be a positive int, got {chunk_size!r}")
        t = ids.size
        if cache is None:
            cache = self.make_cache(t if pos0 is None else int(pos0) + t)
        if pos0 is None:
            pos0 = cache.offset
        cache.check_room(int(pos0), t)
        if t <= HOT_MAX_T and not ops.is_hot():
            with ops.hot():                      # decode-sized step, hot mode opted into (HOT_MAX_T)
                return self._run(ids, cache, int(pos0), last_only, chunk_size)
        return self._run(ids, cache, int(pos0), last_only, chunk_size)

    def _run(self, ids, cache, pos0, last_only, chunk_size):
        t = ids.size
        out = None if last_only else np.empty((t, self.args.vocab_size), dtype=np.float32)   # [T, V]
        for s in range(0, t, chunk_size):
            e = min(t, s + chunk_size)
            h = self._forward_hidden(ids[s:e], cache, pos0 + s)                 # [t, D]
            if last_only:
                if e == t:
                    return ops.matmul(self.lm_head, ops.rmsnorm(h[-1:], self.norm, self.args.rms_norm_eps))[0]
            else:
                out[s:e] = ops.matmul(self.lm_head, ops.rmsnorm(h, self.norm, self.args.rms_norm_eps))
        return out

    def _forward_hidden(self, ids: np.ndarray, cache: KVCache, pos0: int) -> np.ndarray:
        a = self.args
        t, nq, nkv = ids.size, self.n_q, self.n_kv
        hq, hkv, dh, eps, theta = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps, a.rope_theta
        positions = np.arange(pos0, pos0 + t, dtype=np.int64)                 # [t]
        x = ops.embed(self.embed_tokens, ids)                                   # [t, D]
        for li, L in enumerate(self.layers):
            h = ops.rmsnorm(x, L.input_norm, eps)                               # [t, D]
            qkv = _proj(L.qkv, h)                                               # [t, Nq+2Nkv]
            if L.qkv_bias is not None:
                qkv += L.qkv_bias
            qk = ops.rope(qkv[:, :nq + nkv].reshape(t, hq + hkv, dh), positions, theta)  # q, k heads in one call
            q, k = qk[:, :hq], qk[:, hq:]                                       # [t, Hq, Dh], [t, Hkv, Dh]
            cache.write(li, k, qkv[:, nq + nkv:].reshape(t, hkv, dh), pos0)
            att = ops.attention(q, cache.keys[li], cache.values[li], pos0)     # [t, Hq, Dh]
            x += ops.matmul(L.o_proj, att.reshape(t, nq))
            if L.o_bias is not None:
                x += L.o_bias
            h = ops.rmsnorm(x, L.post_norm, eps)
            gu = _proj(L.gate_up, h)                                            # [t, 2I]
            x += ops.matmul(L.down, ops.silu_mul(gu[:, :a.intermediate_size], gu[:, a.intermediate_size:]))
        cache.advance(pos0 + t)
        return x

    def logits(self, token_ids) -> np.ndarray:
        """Logits [T, vocab] float32 of every position, from position 0 with a fresh cache."""
        ids = np.asarray(token_ids)
        return self(ids, self.make_cache(max(1, ids.size)), 0, last_only=False)
