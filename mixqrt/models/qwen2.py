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
from mixqrt.models import spec
from mixqrt.models.base import tensor_shape, to_f32

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


def _proj(ws: list, x: np.ndarray, then=None) -> np.ndarray:
    """x @ [W1; W2; ...]^T; then: the weight multiplied next (ops.matmul's decode prefetch)."""
    if len(ws) == 1:
        return ops.matmul(ws[0], x, then=then)
    nxt = list(ws[1:]) + [then]                                           # only when formats differ
    return np.concatenate([ops.matmul(w, x, then=t) for w, t in zip(ws, nxt)], axis=-1)


def _hot_max_t() -> int:
    v = os.environ.get("MIXQRT_HOT_MAX_T", "0")
    try:
        return max(0, int(v))
    except ValueError:
        raise ModelError(f"MIXQRT_HOT_MAX_T={v!r} is not a non-negative integer") from None


# Forward calls of at most this many tokens run with the pool in hot mode (ops.hot): workers spin
# between the ~100 products of a decode step instead of futex-sleeping after each. Off by default
# (0): measured neutral to 7-9 % slower at 2 threads on the 7B file (docs/lab/decode-ab.md); set
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
        """Checkpoint layout -> runtime layout, by models/spec.py: every tensor checked against the
        config's shape, each fusion group taken as stored (a .mxq stores it fused when spec.fuse
        allows, so loading stays zero-copy) or fused here with the same spec.fuse. A group that
        cannot be fused (formats differ, q5g) stays a list of parts: one matmul each."""
        a = self.args
        ms = spec.ModelSpec(vars(a), a.model_type)
        shapes = ms.shapes(with_lm_head=True)   # a tied .mxq holds its own lm_head copy

        def take(name, vector=False):
            if name not in w:
                raise ModelError(f"missing tensor {name!r}")
            t = w.pop(name)
            got, want = tensor_shape(t), shapes.get(name) or ms.fused_shape(name)
            if got != tuple(want):
                raise ModelError(f"tensor {name!r} has shape {got}, expected {tuple(want)}")
            return to_f32(t, name) if (vector or isinstance(t, np.ndarray)) else t

        out = {spec.EMBED: take(spec.EMBED)}
        if spec.LM_HEAD in w:
            out[spec.LM_HEAD] = take(spec.LM_HEAD)
        elif a.tie_word_embeddings:
            out[spec.LM_HEAD] = out[spec.EMBED]
        else:
            raise ModelError("missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        grouped = {}
        for i in range(a.num_hidden_layers):
            for target, parts in ms.groups(i):
                vector = len(ms.fused_shape(target)) == 1     # biases: float32, so they always fuse
                if target in w:                                # stored fused: the mmap view as is
                    t = take(target, vector)
                    out[target] = t if vector else [t]
                else:
                    ts = [take(p, vector) for p in parts]
                    fused = spec.fuse(ts)
                    out[target] = fused if vector else ([fused] if fused is not None else ts)
                grouped.update(dict.fromkeys(parts))
        for name, shape in shapes.items():
            if name not in grouped and name not in out:
                out[name] = take(name, vector=len(shape) == 1)
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
        ids = self.check_tokens(tokens)
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

    def check_tokens(self, tokens) -> np.ndarray:
        """tokens -> int64 [T]: a non-empty 1-D integer array of ids in [0, vocab)."""
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise GenerationError(f"tokens must be a non-empty 1-D integer array, got shape {ids.shape} "
                                  f"dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.args.vocab_size:
            raise GenerationError(f"token ids must be in [0, {self.args.vocab_size}), got "
                                  f"[{int(ids.min())}, {int(ids.max())}]")
        return ids.astype(np.int64, copy=False)

    def _run(self, ids, cache, pos0, last_only, chunk_size):
        t = ids.size
        out = None if last_only else np.empty((t, self.args.vocab_size), dtype=np.float32)   # [T, V]
        for s in range(0, t, chunk_size):
            e = min(t, s + chunk_size)
            h = self._forward_hidden(ids[s:e], cache, pos0 + s)                 # [t, D]
            if last_only:
                if e == t:
                    return self.head(h[-1:])[0]
            else:
                out[s:e] = self.head(h)
        return out

    def _forward_hidden(self, ids: np.ndarray, cache: KVCache, pos0: int, before_layer=None) -> np.ndarray:
        """Hidden states [t, D] of ids at positions pos0..; writes the KV cache and advances it.
        before_layer(li), if given, runs before each layer (RowSplitRunner's prefetcher)."""
        x = self.embed(ids)                                                     # [t, D]
        if ids.size == 1 and before_layer is None and ops.FUSED_DECODE and cache.dtype == np.float32:
            fused = self.fused_layers()
            if fused is not None:                      # one native call per layer, same bits
                ops.run_decode_layers(fused, x, cache.keys, cache.values, pos0)
                cache.advance(pos0 + 1)
                return x
        positions = np.arange(pos0, pos0 + ids.size, dtype=np.int64)          # [t]
        for li in range(len(self.layers)):
            if before_layer is not None:
                before_layer(li)
            self.attn_stage(li, x, cache, pos0, positions)
            self.ffn_stage(li, x)
        cache.advance(pos0 + ids.size)
        return x

    def fused_layers(self):
        """The layers as ops.decode_layer objects (single-token forward in one native call each), built
        on first use; None where a layer does not fit them (a projection left in parts because its
        formats differ): that model decodes op by op."""
        got = self.__dict__.get("_fused")
        if got is None:
            a, out = self.args, []
            for li, L in enumerate(self.layers):
                if len(L.qkv) != 1 or len(L.gate_up) != 1:
                    out = False
                    break
                nxt = self.layers[li + 1].qkv[0] if li + 1 < len(self.layers) else self.lm_head
                out.append(ops.decode_layer((L.qkv[0], L.o_proj, L.gate_up[0], L.down), L.input_norm, L.post_norm,
                                            L.qkv_bias, L.o_bias, a.rms_norm_eps, a.rope_theta,
                                            a.num_attention_heads, a.num_key_value_heads, a.head_dim, nxt))
            got = self._fused = out
        return got or None

    # ------------------------------------------------------------------ batched decode
    def decode_batch(self, tokens, caches, prefill=None) -> np.ndarray:
        """One decode step for B sequences: tokens[b] at position caches[b].offset -> logits [B, V]
        float32; every cache advances by one. The projections run as [B, D] products (one sweep
        over the packed weights serves every sequence); attention runs per sequence on its own cache.

        prefill=(ids, cache): a prompt chunk of another sequence rides in the same sweep (its rows
        are appended to the products; its attention is causal on its own cache from cache.offset).
        Its cache advances by len(ids) and the logits of its last position are row B of the result
        ([B + 1, V]): the engine interleaves prefill with decode without a second weight sweep."""
        ids, caches = self.check_batch(tokens, caches)
        if prefill is not None:
            p_ids, p_cache = prefill
            p_ids = self.check_tokens(p_ids)
            if not isinstance(p_cache, KVCache) or any(p_cache is c for c in caches):
                raise GenerationError("decode_batch: prefill wants its own KVCache, not one of the decoding sequences'")
            p_cache.check_room(p_cache.offset, p_ids.size)
            prefill = (p_ids, p_cache)
        t = ids.size + (0 if prefill is None else prefill[0].size)
        if t <= HOT_MAX_T and not ops.is_hot():
            with ops.hot():
                return self._decode_batch(ids, caches, prefill=prefill)
        return self._decode_batch(ids, caches, prefill=prefill)

    def check_batch(self, tokens, caches) -> tuple[np.ndarray, list]:
        """-> (ids int64 [B], caches) for decode_batch: B >= 1 distinct caches, each with room for one more."""
        caches = list(caches)
        ids = self.check_tokens(tokens)
        if ids.size != len(caches):
            raise GenerationError(f"decode_batch wants one cache per token, got {ids.size} tokens and "
                                  f"{len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise GenerationError("decode_batch: two sequences share one KV cache")
        for c in caches:
            if not isinstance(c, KVCache):
                raise GenerationError(f"decode_batch: caches must be KVCache objects, got {type(c).__name__}")
            c.check_room(c.offset, 1)
        return ids, caches

    def _decode_batch(self, ids: np.ndarray, caches: list, before_layer=None, prefill=None) -> np.ndarray:
        b_n = ids.size
        pos = np.asarray([c.offset for c in caches], dtype=np.int64)          # [B]
        if prefill is not None:
            p_ids, p_cache = prefill
            p0 = p_cache.offset
            ids = np.concatenate([ids, p_ids])
            pos = np.concatenate([pos, np.arange(p0, p0 + p_ids.size, dtype=np.int64)])
        x = self.embed(ids)                                                    # [B (+P), D]
        att = np.empty((ids.size, self.args.num_attention_heads, self.args.head_dim), dtype=np.float32)
        for li in range(len(self.layers)):
            if before_layer is not None:
                before_layer(li)
            q, k, v = self.qkv(li, x, pos)                                     # row b at position pos[b]
            for b, c in enumerate(caches):
                c.write(li, k[b:b + 1], v[b:b + 1], int(pos[b]))
            ops.attention_batch(q[:b_n], [c.keys[li] for c in caches], [c.values[li] for c in caches], pos[:b_n],
                                out=att[:b_n])
            if prefill is not None:
                p_cache.write(li, k[b_n:], v[b_n:], p0)
                att[b_n:] = ops.attention(q[b_n:], p_cache.keys[li], p_cache.values[li], p0)
            self.attn_out(li, x, att)
            self.ffn_stage(li, x)
        for b, c in enumerate(caches):
            c.advance(int(pos[b]) + 1)
        if prefill is None:
            return self.head(x)
        p_cache.advance(p0 + p_ids.size)
        return self.head(x[np.r_[0:b_n, ids.size - 1]])

    # ------------------------------------------------------------------ layer functions
    # The one layer graph: the forward, decode_batch and the runners of runtime/scheduler.py (which
    # run "stage A" = attn_stage and "stage B" = ffn_stage of a layer on separate cores) call these.
    # x [T, D] float32 is the residual stream, updated in place.
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return ops.embed(self.embed_tokens, ids)                                # [T, D]

    def qkv(self, li: int, x: np.ndarray, positions: np.ndarray):
        """-> q [T, Hq, Dh], k [T, Hkv, Dh] (both rotated at positions [T]), v [T, Hkv, Dh]."""
        a, L, t = self.args, self.layers[li], x.shape[0]
        nq, nkv, hq, hkv, dh = self.n_q, self.n_kv, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = _proj(L.qkv, ops.rmsnorm(x, L.input_norm, a.rms_norm_eps), L.o_proj)   # [T, Nq+2Nkv]
        if L.qkv_bias is not None:
            qkv += L.qkv_bias
        qk = ops.rope(qkv[:, :nq + nkv].reshape(t, hq + hkv, dh), positions, a.rope_theta)  # q, k heads in one call
        return qk[:, :hq], qk[:, hq:], qkv[:, nq + nkv:].reshape(t, hkv, dh)

    def attn_out(self, li: int, x: np.ndarray, att: np.ndarray) -> None:
        """x += o_proj(att) (+ bias); att [T, Hq, Dh]."""
        L = self.layers[li]
        x += ops.matmul(L.o_proj, att.reshape(x.shape[0], self.n_q), then=L.gate_up[0])
        if L.o_bias is not None:
            x += L.o_bias

    def attn_stage(self, li: int, x: np.ndarray, cache: KVCache, pos0: int, positions=None) -> None:
        """Stage A of layer li: norm, qkv, rope, KV write at pos0.., attention, o_proj, residual."""
        if positions is None:
            positions = np.arange(pos0, pos0 + x.shape[0], dtype=np.int64)
        q, k, v = self.qkv(li, x, positions)
        cache.write(li, k, v, pos0)
        self.attn_out(li, x, ops.attention(q, cache.keys[li], cache.values[li], pos0))

    def ffn_in(self, li: int, x: np.ndarray) -> np.ndarray:
        """The FFN's input: post-attention norm of x."""
        return ops.rmsnorm(x, self.layers[li].post_norm, self.args.rms_norm_eps)

    def ffn_out(self, li: int, x: np.ndarray, gate: np.ndarray, up: np.ndarray | None = None) -> None:
        """x += down(silu(gate) * up); up None: gate is the fused gate-up output [T, 2I], whose SiLU
        product the down projection makes row by row (ops.matmul silu: the same bits)."""
        nxt = self.layers[li + 1].qkv[0] if li + 1 < len(self.layers) else self.lm_head
        if up is None:
            x += ops.matmul(self.layers[li].down, gate, then=nxt, silu=True)
        else:
            x += ops.matmul(self.layers[li].down, ops.silu_mul(gate, up), then=nxt)

    def ffn_stage(self, li: int, x: np.ndarray) -> None:
        """Stage B of layer li: norm, gate_up, silu, down, residual."""
        gu = _proj(self.layers[li].gate_up, self.ffn_in(li, x), self.layers[li].down)   # [T, 2I]
        self.ffn_out(li, x, gu)

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm and lm_head: logits [T, V]."""
        return ops.matmul(self.lm_head, ops.rmsnorm(x, self.norm, self.args.rms_norm_eps), then=self.layers[0].qkv[0])

    def logits(self, token_ids) -> np.ndarray:
        """Logits [T, vocab] float32 of every position, from position 0 with a fresh cache."""
        ids = np.asarray(token_ids)
        return self(ids, self.make_cache(max(1, ids.size)), 0, last_only=False)
