"""Qwen2 (and, without q/k/v bias, Llama) decoder graph in the mlx-lm style.

Weights arrive with Hugging Face names and [out, in] layouts, each a QTensor or a float32 array.
``sanitize`` turns that checkpoint layout into the runtime layout once, at load: q/k/v fused into
one [Nq+2Nkv, K] projection and gate/up into one [2I, K] when the parts share a format, norm
weights and biases as float32, and the lm_head resolved (tied or not). The forward never copies
weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from mixqrt import ops
from mixqrt.platform import tuning
from mixqrt.models.kv_cache import KVCache, kv_type_of_dtype, make_kv_cache
from mixqrt.errors import GenerationError, ModelError
from mixqrt.kv.packed import PackedKVCache
from mixqrt.models.config_limits import check_config_limits
from mixqrt.models import spec
from mixqrt.models.arch import Arch, find as find_arch, register
from mixqrt.models.base import tensor_shape, to_f32

KV_CACHES = (KVCache, PackedKVCache)

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
    inv_freq: np.ndarray | None = field(default=None, repr=False, compare=False)   # derived (validate)

    @classmethod
    def from_dict(cls, config: dict, model_type: str | None = None) -> "ModelArgs":
        """Build from a config.json dict; unknown keys are kept in ``extra`` and otherwise ignored."""
        if not isinstance(config, dict):
            raise ModelError(f"model config must be a dict, got {type(config).__name__}")
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ModelError(f"model config is missing required key(s): {', '.join(missing)}")
        names = {f.name for f in fields(cls)} - {"extra", "model_type", "inv_freq"}
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
        self.inv_freq = rope_inv_freq(self.rope_scaling, self.rope_theta, self.head_dim)
        self.tie_word_embeddings = bool(self.tie_word_embeddings)
        if self.attention_bias is None:         # the architecture's default (Arch.qkv_bias)
            a = find_arch(self.model_type)
            self.attention_bias = a is not None and a.qkv_bias == "always"
        self.attention_bias = bool(self.attention_bias)


def _scaling_number(rs: dict, key: str, default=None) -> float:
    v = rs.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelError(f"config rope_scaling.{key} must be a positive finite number, got {v!r}")
    return float(v)


def rope_inv_freq(rs, theta: float, head_dim: int) -> np.ndarray | None:
    """RoPE's inverse frequencies [head_dim/2] under config.rope_scaling, or None for plain RoPE
    (theta's own frequencies, the C kernel's). Types: "default"; "linear" (every frequency / factor);
    "llama3" (Llama 3.x: long wavelengths / factor, short ones kept, a smooth blend between, as
    transformers' _compute_llama3_parameters), from its four parameters or, from a GGUF file, the
    per-frequency divisors llama.cpp stores as rope_freqs.weight ("freq_factors"). Anything else is
    a ModelError: running it with plain RoPE would give wrong positions."""
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ModelError(f"config rope_scaling must be an object, got {type(rs).__name__}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "linear":
        return inv / _scaling_number(rs, "factor")
    if kind != "llama3":
        raise ModelError(f"config rope_scaling.rope_type {str(kind)[:40]!r} is not supported (supported: default, "
                         f"linear, llama3); refusing to run with wrong positions")
    if rs.get("freq_factors") is not None:
        ff = np.asarray(rs["freq_factors"], dtype=np.float64).reshape(-1)
        if ff.size != head_dim // 2 or not np.isfinite(ff).all() or (ff <= 0).any():
            raise ModelError(f"config rope_scaling.freq_factors must be {head_dim // 2} positive numbers "
                             f"(head_dim / 2), got {ff.size}")
        return inv / ff
    factor = _scaling_number(rs, "factor")
    lo, hi = _scaling_number(rs, "low_freq_factor"), _scaling_number(rs, "high_freq_factor")
    orig = _scaling_number(rs, "original_max_position_embeddings")
    if hi <= lo:
        raise ModelError(f"config rope_scaling.high_freq_factor={hi} must exceed low_freq_factor={lo}")
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen < orig / hi, inv, np.where(wavelen > orig / lo, inv / factor, blended))


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


# Layer field -> its tensor in models/spec.py (suffix after "model.layers.{i}."; a fusion group's target
# for the fields that hold one). The one link between this graph's fields and the checkpoint's names:
# the layer is built from it (load_layer) and named by it (layer_weights).
LAYER_FIELDS = (
    ("input_norm", "input_layernorm.weight"),
    ("qkv", "self_attn.qkv_proj.weight"),
    ("qkv_bias", "self_attn.qkv_proj.bias"),
    ("o_proj", "self_attn.o_proj.weight"),
    ("o_bias", "self_attn.o_proj.bias"),
    ("post_norm", "post_attention_layernorm.weight"),
    ("gate_up", "mlp.gate_up_proj.weight"),
    ("down", "mlp.down_proj.weight"),
)
_OPTIONAL = {"qkv_bias", "o_bias"}


def _proj(ws: list, x: np.ndarray, then=None) -> np.ndarray:
    """x @ [W1; W2; ...]^T; then: the weight multiplied next (ops.matmul's decode prefetch)."""
    if len(ws) == 1:
        return ops.matmul(ws[0], x, then=then)
    nxt = list(ws[1:]) + [then]                                           # only when formats differ
    return np.concatenate([ops.matmul(w, x, then=t) for w, t in zip(ws, nxt)], axis=-1)


# Forward calls of at most this many tokens run with the pool in hot mode (ops.hot): workers spin
# between the ~100 products of a decode step instead of futex-sleeping after each. Off by default
# (0): measured neutral to 7-9 % slower at 2 threads on the 7B file (docs/lab/decode-ab.md); set
# MIXQRT_HOT_MAX_T=16 (or this attribute) to turn it on.
HOT_MAX_T = tuning.value("MIXQRT_HOT_MAX_T")


class Step:
    """One batched decode step (Model.begin_batch): whose rows x holds. Rows 0..B-1 are one token of each
    decoding sequence (caches[b], at position pos[b]); rows B.. a prompt chunk of one more sequence
    (p_cache, from position p0), when the step carries one."""
    __slots__ = ("caches", "pos", "n_decode", "p_cache", "p0", "p_n", "att")

    def __init__(self, caches, pos, p_cache, p0, p_n, att):
        self.caches, self.pos, self.n_decode = caches, pos, len(caches)
        self.p_cache, self.p0, self.p_n, self.att = p_cache, p0, p_n, att

    @property
    def rows(self) -> int:
        return self.n_decode + self.p_n


class Model:
    """Decoder-only transformer. ``model(tokens, cache, pos0)`` -> logits.

    The public layer API (models/base.py describes the contract) is what every client uses: the
    forward, decode_batch, runtime/scheduler's runners, GPTQ calibration and the imatrix. There is
    one implementation of each layer, here."""

    args_class = ModelArgs
    layer_class = Layer                    # a subclass with more fields sets these three together
    layer_fields = LAYER_FIELDS
    optional_fields = frozenset(_OPTIONAL)
    # the KV cache's type (mixqrt.models.kv_cache.KV_TYPES): a bare graph computes exactly (f32); a Pipeline sets
    # its own (DEFAULT_KV_TYPE unless told otherwise), as does `mixqrt ppl --kv-type`
    kv_type = "f32"

    def __init__(self, args: ModelArgs, weights: dict, generation_config: dict | None = None):
        self._setup(args, generation_config)
        w = self.sanitize(dict(weights))
        self.embed_tokens = w.pop(spec.EMBED)                   # [V, D]
        self.norm = w.pop(spec.FINAL_NORM)                      # [D] float32
        self.lm_head = w.pop(spec.LM_HEAD)                      # [V, D]
        self.layers = [self._layer_from(i, w) for i in range(self.args.num_hidden_layers)]
        self.unused_weights = sorted(w)   # e.g. rotary inv_freq buffers; kept for inspection

    def _setup(self, args, generation_config) -> None:
        if not isinstance(args, ModelArgs):
            args = self.args_class.from_dict(args)
        self.args = args
        self.generation_config = dict(generation_config or {})
        self.n_q = args.num_attention_heads * args.head_dim         # width of q
        self.n_kv = args.num_key_value_heads * args.head_dim        # width of k and of v

    @classmethod
    def empty(cls, args) -> "Model":
        """A model with no weights yet (embedding, head and every layer None), filled tensor by tensor
        with load_layer / load_global: GPTQ calibration builds and runs it one layer at a time."""
        m = cls.__new__(cls)
        m._setup(args, None)
        m.embed_tokens = m.norm = m.lm_head = None
        m.layers = [None] * m.args.num_hidden_layers
        m.unused_weights = []
        return m

    # ------------------------------------------------------------------ load-time layout
    def _spec(self):
        a = self.args
        ms = spec.ModelSpec(vars(a), a.model_type)
        return ms, ms.shapes(with_lm_head=True)   # a tied .mxq holds its own lm_head copy

    def sanitize(self, w: dict) -> dict:
        """Checkpoint layout -> runtime layout, by models/spec.py: every tensor checked against the
        config's shape, each fusion group taken as stored (a .mxq stores it fused when spec.fuse
        allows, so loading stays zero-copy) or fused here with the same spec.fuse. A group that
        cannot be fused (formats differ, q5g) stays a list of parts: one matmul each."""
        ms, shapes = self._spec()
        out = {spec.EMBED: _take(w, spec.EMBED, shapes, ms)}
        if spec.LM_HEAD in w:
            out[spec.LM_HEAD] = _take(w, spec.LM_HEAD, shapes, ms)
        elif self.args.tie_word_embeddings:
            out[spec.LM_HEAD] = out[spec.EMBED]
        else:
            raise ModelError("missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        for i in range(self.args.num_hidden_layers):
            out.update(_sanitize_layer(i, w, ms, shapes))
        out[spec.FINAL_NORM] = _take(w, spec.FINAL_NORM, shapes, ms, vector=True)
        out.update(w)   # leftovers (ignored by the graph)
        return out

    def _layer_from(self, i: int, w: dict) -> Layer:
        """Layer i's fields from runtime-layout tensors (sanitize's output), popped from w."""
        p, kw = f"model.layers.{i}.", {}
        for fld, suffix in self.layer_fields:
            if fld in self.optional_fields:
                kw[fld] = w.pop(p + suffix, None)
            elif p + suffix not in w:
                raise ModelError(f"missing tensor {p + suffix!r}")
            else:
                kw[fld] = w.pop(p + suffix)
        return self.layer_class(**kw)

    def load_layer(self, i: int, weights: dict) -> None:
        """(Re)build layer i from HF-named tensors of that layer (fusion groups as parts or fused),
        checked and fused exactly as at load (sanitize)."""
        self._check_layer_index(i)
        ms, shapes = self._spec()
        w = dict(weights)
        out = _sanitize_layer(i, w, ms, shapes)
        if w:
            raise ModelError(f"tensor {sorted(w)[0]!r} is not part of layer {i}")
        self.layers[i] = self._layer_from(i, out)
        self.__dict__.pop("_fused", None)

    def unload_layer(self, i: int) -> None:
        """Drop layer i's weights (a model built piece by piece keeps one layer at a time)."""
        self._check_layer_index(i)
        self.layers[i] = None
        self.__dict__.pop("_fused", None)

    def load_global(self, name: str, tensor) -> None:
        """Set the embedding, final norm or lm_head (models/spec.py names), shape-checked."""
        ms, shapes = self._spec()
        attr = {spec.EMBED: "embed_tokens", spec.FINAL_NORM: "norm", spec.LM_HEAD: "lm_head"}.get(name)
        if attr is None:
            raise ModelError(f"{name!r} is not a global tensor of the model")
        setattr(self, attr, _take({name: tensor}, name, shapes, ms, vector=name == spec.FINAL_NORM))
        self.__dict__.pop("_fused", None)

    def _check_layer_index(self, i) -> None:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(self.layers):
            raise ModelError(f"layer index {i!r} outside 0..{len(self.layers) - 1}")

    # ------------------------------------------------------------------ names of the weights
    def layer_weights(self, i: int) -> dict:
        """Layer i's runtime tensors by name: a fused group under its target name (spec.FUSION_GROUPS),
        an unfused one as its parts, the rest under their HF names. The objects are the ones the
        graph multiplies (imatrix and calibration recognise a product by its weight object)."""
        self._check_layer_index(i)
        L, p, out = self.layers[i], f"model.layers.{i}.", {}
        if L is None:
            return out
        for fld, suffix in self.layer_fields:
            v = getattr(L, fld)
            if v is None:
                continue
            if isinstance(v, list):
                out.update(zip((p + suffix,) if len(v) == 1 else spec.parts_of(p + suffix), v))
            else:
                out[p + suffix] = v
        return out

    def named_weights(self) -> dict:
        """Every runtime tensor by name: embedding, the layers (layer_weights), final norm, lm_head (the
        embedding's object again when tied)."""
        out = {spec.EMBED: self.embed_tokens}
        for i in range(len(self.layers)):
            out.update(self.layer_weights(i))
        out[spec.FINAL_NORM] = self.norm
        out[spec.LM_HEAD] = self.lm_head
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def context_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def make_cache(self, max_len: int | None = None, kv_type: str | None = None, *, dtype=None):
        """A cache for max_len positions (default: the whole context; its pages become resident as
        positions are written) of kv_type (default: self.kv_type; mixqrt.models.kv_cache.KV_TYPES). dtype:
        the older spelling of the float types (np.float32 / np.float16)."""
        a = self.args
        if dtype is not None:
            kv_type = kv_type_of_dtype(dtype)
        return make_kv_cache(kv_type or self.kv_type, a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                             int(max_len or a.max_position_embeddings), windows=self.kv_windows())

    def kv_windows(self):
        """Per-layer sliding window of the attention (None: every layer sees the whole context)."""
        return None

    def kv_bytes_per_token(self, kv_type: str | None = None) -> float:
        """Steady-state KV bytes per cached token of kv_type (default self.kv_type), K and V, all layers."""
        from mixqrt.models.kv_cache import kv_bytes_per_token
        a = self.args
        return kv_bytes_per_token(kv_type or self.kv_type, a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                                  self.kv_windows())

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
            # the last chunk of a last_only call needs the last row only out of the last layer
            h = self.forward_hidden(ids[s:e], cache, pos0 + s, last_row=last_only and e == t)   # [t, D]
            if last_only:
                if e == t:
                    return self.head(h[-1:])[0]
            else:
                out[s:e] = self.head(h)
        return out

    def forward_hidden(self, ids: np.ndarray, cache: KVCache, pos0: int, last_row: bool = False) -> np.ndarray:
        """Hidden states [t, D] of checked ids at positions pos0..; writes the KV cache and advances it.
        A single token runs the fused native layers where the model has them (the same bits).
        last_row: only the last row of the result is wanted (the logits of a prompt's last position):
        the last layer's FFN then runs on that row alone (its attention still writes every row's K/V),
        as llama.cpp's prompt processing does; the other rows of the result are not final."""
        x = self.embed(ids)                                                     # [t, D]
        if ids.size == 1 and ops.FUSED_DECODE and (cache.dtype == np.float32 or getattr(cache, "fusable", False)):
            fused = self.fused_layers()
            if fused is not None:                      # one native call per layer, same bits
                if cache.dtype == np.float32:
                    ops.run_decode_layers(fused, x, cache.keys, cache.values, pos0)
                else:                                  # a packed cache without windowed layers
                    ops.run_decode_layers(fused, x, cache.kf, cache.vf, pos0, cache.pk, cache.bits)
                cache.advance(pos0 + 1)
                return x
        positions = self.positions(pos0, ids.size)
        n = len(self.layers)
        for li in range(n):
            if last_row and li == n - 1 and ids.size > 1:
                self.attn_stage(li, x, cache, pos0, positions)
                self.ffn_stage(li, x[-1:])                  # a view: the last row is updated in place
            else:
                self.layer_forward(li, x, cache, pos0, positions)
        cache.advance(pos0 + ids.size)
        return x

    @staticmethod
    def positions(pos0: int, t: int) -> np.ndarray:
        return np.arange(pos0, pos0 + t, dtype=np.int64)                       # [t]

    def fused_layers(self):
        """The layers as ops.decode_layer objects (single-token forward in one native call each), built
        on first use; None where a layer does not fit them (a projection left in parts because its
        formats differ): that model decodes op by op. An architecture without such a native layer
        returns None here and decodes op by op through layer_forward."""
        a = find_arch(self.args.model_type)
        if a is None or not a.native_decode or self.args.inv_freq is not None:
            return None                            # another graph, or scaled RoPE (not in the C layer)
        got = self.__dict__.get("_fused")
        if got is None:
            a, out = self.args, []
            for li, L in enumerate(self.layers):
                if L is None or len(L.qkv) != 1 or len(L.gate_up) != 1:
                    out = False
                    break
                out.append(ops.decode_layer((L.qkv[0], L.o_proj, L.gate_up[0], L.down), L.input_norm, L.post_norm,
                                            L.qkv_bias, L.o_bias, a.rms_norm_eps, a.rope_theta,
                                            a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                            self._next_weight(li)))
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
        ([B + 1, V]): the engine interleaves prefill with decode without a second weight sweep.

        The same as begin_batch, layer_batch for every layer, end_batch (what runtime/scheduler's
        RowSplitRunner runs, with its prefetcher between layers)."""
        x, st = self.begin_batch(tokens, caches, prefill)
        if st.rows <= HOT_MAX_T and not ops.is_hot():
            with ops.hot():
                return self._batch(x, st)
        return self._batch(x, st)

    def _batch(self, x, st):
        for li in range(len(self.layers)):
            self.layer_batch(li, x, st)
        return self.end_batch(x, st)

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
            if not isinstance(c, KV_CACHES):
                raise GenerationError(f"decode_batch: caches must be KVCache objects, got {type(c).__name__}")
            c.check_room(c.offset, 1)
        return ids, caches

    def begin_batch(self, tokens, caches, prefill=None) -> tuple[np.ndarray, Step]:
        """Check a decode step (decode_batch's arguments) -> (x [rows, D] embedded, its Step)."""
        ids, caches = self.check_batch(tokens, caches)
        pos = np.asarray([c.offset for c in caches], dtype=np.int64)           # [B]
        p_cache, p0, p_n = None, 0, 0
        if prefill is not None:
            p_ids, p_cache = prefill
            p_ids = self.check_tokens(p_ids)
            if not isinstance(p_cache, KV_CACHES) or any(p_cache is c for c in caches):
                raise GenerationError("decode_batch: prefill wants its own KVCache, not one of the decoding sequences'")
            p_cache.check_room(p_cache.offset, p_ids.size)
            p0, p_n = p_cache.offset, p_ids.size
            ids = np.concatenate([ids, p_ids])
            pos = np.concatenate([pos, self.positions(p0, p_n)])
        att = np.empty((ids.size, self.args.num_attention_heads, self.args.head_dim), dtype=np.float32)
        return self.embed(ids), Step(caches, pos, p_cache, p0, p_n, att)     # x [B (+P), D]

    def layer_batch(self, li: int, x: np.ndarray, st: Step) -> None:
        """Layer li over a decode step's rows (begin_batch), x updated in place: one product per weight
        for every row, attention per sequence on its own cache."""
        b_n, caches, pos, att = st.n_decode, st.caches, st.pos, st.att
        q, k, v = self.qkv(li, x, pos)                                         # row b at position pos[b]
        for b, c in enumerate(caches):
            c.write(li, k[b:b + 1], v[b:b + 1], int(pos[b]))
        self.attend_batch(li, q[:b_n], caches, pos[:b_n], att[:b_n])
        if st.p_cache is not None:
            st.p_cache.write(li, k[b_n:], v[b_n:], st.p0)
            att[b_n:] = self.attend(li, q[b_n:], st.p_cache, st.p0)
        self.attn_out(li, x, att)
        self.ffn_stage(li, x)

    def end_batch(self, x: np.ndarray, st: Step) -> np.ndarray:
        """Advance every cache of the step and return its logits ([B, V], or [B + 1, V] with a prompt chunk)."""
        b_n = st.n_decode
        for b, c in enumerate(st.caches):
            c.advance(int(st.pos[b]) + 1)
        if st.p_cache is None:
            return self.head(x)
        st.p_cache.advance(st.p0 + st.p_n)
        return self.head(x[np.r_[0:b_n, x.shape[0] - 1]])

    # ------------------------------------------------------------------ layer functions
    # The one layer graph: forward_hidden, decode_batch, the runners of runtime/scheduler.py (which
    # run "stage A" = attn_stage and "stage B" = ffn_stage of a layer on separate cores) and GPTQ
    # calibration call these. x [T, D] float32 is the residual stream, updated in place.
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return ops.embed(self.embed_tokens, ids)                                # [T, D]

    def layer_forward(self, li: int, x: np.ndarray, cache: KVCache, pos0: int, positions=None) -> None:
        """Layer li over T rows of one sequence at positions pos0.. (x [T, D], in place); writes
        layer li of the KV cache (the caller advances it after the last layer)."""
        self.attn_stage(li, x, cache, pos0, positions)
        self.ffn_stage(li, x)

    def _next_weight(self, li: int):
        """The weight multiplied after layer li's last product (ops.matmul's gap prefetch), or None."""
        if li + 1 < len(self.layers):
            nxt = self.layers[li + 1]
            return None if nxt is None else nxt.qkv[0]
        return self.lm_head

    def qkv(self, li: int, x: np.ndarray, positions: np.ndarray):
        """-> q [T, Hq, Dh], k [T, Hkv, Dh] (both rotated at positions [T]), v [T, Hkv, Dh]."""
        a, L, t = self.args, self.layers[li], x.shape[0]
        nq, nkv, hq, hkv, dh = self.n_q, self.n_kv, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = _proj(L.qkv, ops.rmsnorm(x, L.input_norm, a.rms_norm_eps), L.o_proj)   # [T, Nq+2Nkv]
        if L.qkv_bias is not None:
            qkv += L.qkv_bias
        qk = self.rope(li, qkv[:, :nq + nkv].reshape(t, hq + hkv, dh), positions)  # q, k heads in one call
        return qk[:, :hq], qk[:, hq:], qkv[:, nq + nkv:].reshape(t, hkv, dh)

    def rope(self, li: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """RoPE of layer li on heads x [T, H, Dh] (a new array): the C kernel at rope_theta, or the
        scaled inverse frequencies of config.rope_scaling (rope_inv_freq)."""
        a = self.args
        if a.inv_freq is None:
            return ops.rope(x, positions, a.rope_theta)
        return ops.rope_freqs(x, positions, a.inv_freq)

    def attn_out(self, li: int, x: np.ndarray, att: np.ndarray) -> None:
        """x += o_proj(att) (+ bias); att [T, Hq, Dh]."""
        L = self.layers[li]
        x += ops.matmul(L.o_proj, att.reshape(x.shape[0], self.n_q), then=L.gate_up[0])
        if L.o_bias is not None:
            x += L.o_bias

    def attn_stage(self, li: int, x: np.ndarray, cache: KVCache, pos0: int, positions=None) -> None:
        """Stage A of layer li: norm, qkv, rope, KV write at pos0.., attention, o_proj, residual."""
        if positions is None:
            positions = self.positions(pos0, x.shape[0])
        q, k, v = self.qkv(li, x, positions)
        cache.write(li, k, v, pos0)
        self.attn_out(li, x, self.attend(li, q, cache, pos0))

    def attend(self, li: int, q: np.ndarray, cache: KVCache, pos0: int, out=None) -> np.ndarray:
        """Layer li's attention of q [T, Hq, Dh] (positions pos0..) over its cache -> [T, Hq, Dh]."""
        if getattr(cache, "packed", False):
            return cache.attend(li, q, pos0, out)
        return ops.attention(q, cache.keys[li], cache.values[li], pos0, out)

    def attend_batch(self, li: int, q: np.ndarray, caches: list, pos: np.ndarray, out: np.ndarray) -> None:
        """Layer li's attention of one decode query per sequence (q [B, Hq, Dh], row b at pos[b] on
        caches[b]) into out [B, Hq, Dh]."""
        if getattr(caches[0], "packed", False):
            ops.kv_attention_batch(q, caches, li, pos, out=out)
            return
        ops.attention_batch(q, [c.keys[li] for c in caches], [c.values[li] for c in caches], pos, out=out)

    def ffn_in(self, li: int, x: np.ndarray) -> np.ndarray:
        """The FFN's input: post-attention norm of x."""
        return ops.rmsnorm(x, self.layers[li].post_norm, self.args.rms_norm_eps)

    def ffn_halves(self, li: int) -> tuple:
        """(gate, up) weights of layer li: row views of a fused gate_up (spec.row_slice), or its two
        parts (the scheduler's balanced split runs them on different cores; ffn_out joins them)."""
        gu = self.layers[li].gate_up
        if len(gu) == 1:
            inter = self.args.intermediate_size
            return spec.row_slice(gu[0], 0, inter), spec.row_slice(gu[0], inter, 2 * inter)
        return gu[0], gu[1]

    def ffn_out(self, li: int, x: np.ndarray, gate: np.ndarray, up: np.ndarray | None = None) -> None:
        """x += down(silu(gate) * up); up None: gate is the fused gate-up output [T, 2I], whose SiLU
        product the down projection makes row by row (ops.matmul silu: the same bits)."""
        nxt = self._next_weight(li)
        if up is None:
            x += ops.matmul(self.layers[li].down, gate, then=nxt, silu=True)
        else:
            x += ops.matmul(self.layers[li].down, ops.silu_mul(gate, up), then=nxt)

    def ffn_stage(self, li: int, x: np.ndarray) -> None:
        """Stage B of layer li: norm, gate_up, silu, down, residual."""
        gu = _proj(self.layers[li].gate_up, self.ffn_in(li, x), self.layers[li].down)   # [T, 2I]
        self.ffn_out(li, x, gu)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final norm of hidden states x [T, D] (a new array): what the head multiplies, and
        what embeddings pool (mixqrt.generation.embed)."""
        return ops.rmsnorm(x, self.norm, self.args.rms_norm_eps)

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm and lm_head: logits [T, V]."""
        first = self.layers[0].qkv[0] if self.layers and self.layers[0] is not None else None
        return ops.matmul(self.lm_head, self.final_norm(x), then=first)

    def logits(self, token_ids) -> np.ndarray:
        """Logits [T, vocab] float32 of every position, from position 0 with a fresh cache."""
        ids = np.asarray(token_ids)
        return self(ids, self.make_cache(max(1, ids.size)), 0, last_only=False)


def _take(w: dict, name: str, shapes: dict, ms, vector: bool = False):
    """Pop tensor `name` from w, its shape checked against the spec (a fused target's too); vectors and
    float matrices as float32 arrays, QTensors as they are."""
    if name not in w:
        raise ModelError(f"missing tensor {name!r}")
    t = w.pop(name)
    got, want = tensor_shape(t), shapes.get(name) or ms.fused_shape(name)
    if got != tuple(want):
        raise ModelError(f"tensor {name!r} has shape {got}, expected {tuple(want)}")
    return to_f32(t, name) if (vector or isinstance(t, np.ndarray)) else t


def _sanitize_layer(i: int, w: dict, ms, shapes: dict) -> dict:
    """Layer i's tensors popped from w in runtime layout: each fusion group under its target name
    (a vector fused, a matrix as [fused] or its parts), the other tensors under their own names."""
    out, grouped = {}, set()
    for target, parts in ms.groups(i):
        vector = len(ms.fused_shape(target)) == 1     # biases: float32, so they always fuse
        if target in w:                                # stored fused: the mmap view as is
            t = _take(w, target, shapes, ms, vector)
            out[target] = t if vector else [t]
        else:
            ts = [_take(w, p, shapes, ms, vector) for p in parts]
            fused = spec.fuse(ts)
            out[target] = fused if vector else ([fused] if fused is not None else ts)
        grouped.update(parts)
    for name, shape in ms.layer_shapes(i).items():
        if name not in grouped:
            out[name] = _take(w, name, shapes, ms, vector=len(shape) == 1)
    return out


def _gguf_config(m, cfg: dict) -> None:
    cfg["use_sliding_window"] = False


# Qwen2: q/k/v biases always (config.attention_bias ignored, as transformers does), no o_proj bias
ARCH = register(Arch("qwen2", "Qwen2ForCausalLM", qkv_bias="always", native_decode=True, gguf_rope_freqs=True,
                     gguf_config=_gguf_config, tiny={"rope_theta": 1e6}, tiny_tokenizer="qwen2"))
