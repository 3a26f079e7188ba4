"""Embeddings: a model's hidden states pooled into one vector per input, as llama.cpp's embedding mode.

    from mixqrt.generation.embed import Embedder
    emb = Embedder(model, info=loaded.meta.get("embedding"))      # or Pipeline.embed(texts)
    vecs = emb.embed([[1, 2, 3], [4, 5]])                         # float32 [2, D'] (D' = dense out)

What is computed (llama.cpp's graph, src/llama-graph.cpp build_pooling / build_dense_out):
  hidden    the final norm's output for every token (``result_norm``), the LM head never runs;
  pooling   ``last`` (the last token: Qwen3-Embedding), ``mean`` (over the input's tokens),
            ``cls`` (the first token), ``none`` (every token's vector: a [n, D] array per input);
  dense     the dense projections a sentence-transformers model carries after pooling
            (EmbeddingGemma's 2_Dense / 3_Dense; GGUF ``dense_2`` / ``dense_3``), in order;
  normalize L2 (llama.cpp's default, embd_normalize 2; a sentence-transformers Normalize module).
Attention is causal, or bidirectional where the model says so (EmbeddingGemma: GGUF architecture
``gemma-embedding`` / HF ``use_bidirectional_attention``), with Gemma's sliding layers then seeing a
symmetric window of half the sliding window each side (llama.cpp's LLAMA_SWA_TYPE_SYMMETRIC).

Where the settings come from: the .mxq's ``embedding`` entry, written at conversion from GGUF
``<arch>.pooling_type`` / ``<arch>.attention.causal`` or an HF folder's sentence-transformers
``modules.json`` + ``1_Pooling/config.json`` (``embedding_info``); a model that names none gets
last-token pooling (a causal decoder's only summary of the whole input) and L2 normalization. Every
setting has an explicit override (``Embedder(pooling=..., normalize=...)``).

Batching: inputs are packed into forwards of at most ``batch_tokens`` tokens (one product per
weight for the whole pack, attention per input on its own rows, positions from 0 in each); no K/V is
kept. So a thousand short inputs run at prefill throughput, not one forward each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mixqrt.errors import GenerationError, ModelError

POOLINGS = ("none", "mean", "cls", "last")
# llama.cpp's enum llama_pooling_type (include/llama.h): -1 unspecified, 0 none, 1 mean, 2 cls, 3 last, 4 rank
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}
DEFAULT_BATCH_TOKENS = 2048
_ATT_BLOCK = 256                # query rows per block of the bidirectional attention


@dataclass
class EmbeddingInfo:
    pooling: str | None = None          # None: the model did not say (last-token is used)
    normalize: bool = True
    causal: bool = True
    dense: list = field(default_factory=list)    # [(name of weight, name of bias or None, activation)]
    matryoshka: bool = False            # `dimensions` may truncate (the model was trained for it)

    @classmethod
    def from_meta(cls, d) -> "EmbeddingInfo":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ModelError(f"the model file's embedding entry must be an object, got {type(d).__name__}")
        pooling = d.get("pooling")
        if pooling is not None and pooling not in POOLINGS:
            raise ModelError(f"embedding pooling {str(pooling)[:40]!r} is not supported (supported: {', '.join(POOLINGS)})")
        dense = d.get("dense") or []
        if not isinstance(dense, list) or not all(isinstance(x, (list, tuple)) and len(x) == 3 for x in dense):
            raise ModelError("the model file's embedding.dense must be a list of [weight, bias, activation]")
        return cls(pooling, bool(d.get("normalize", True)), bool(d.get("causal", True)),
                   [tuple(x) for x in dense], bool(d.get("matryoshka", False)))

    def to_meta(self) -> dict:
        return {"pooling": self.pooling, "normalize": self.normalize, "causal": self.causal,
                "dense": [list(x) for x in self.dense], "matryoshka": self.matryoshka}


def dense_name(i: int, part: str = "weight") -> str:
    """The .mxq name of an embedding model's i-th dense projection after pooling."""
    return f"embedding.dense.{int(i)}.{part}"


def _check_pooling(p):
    if p is not None and p not in POOLINGS:
        raise GenerationError(f"pooling must be one of {', '.join(POOLINGS)}, got {str(p)[:40]!r}")
    return p


class _Rows:
    """A one-layer stand-in for a KVCache: the model's attend() reads .keys[li] / .values[li]."""
    __slots__ = ("keys", "values")

    def __init__(self, li, k, v):
        self.keys, self.values = {li: k}, {li: v}


def bidirectional_attention(q, k, v, window: int | None = None) -> np.ndarray:
    """Every query sees every key (window: only keys within window // 2 positions either side,
    llama.cpp's symmetric sliding window). q [T, Hq, Dh], k / v [T, Hkv, Dh] -> [T, Hq, Dh]."""
    from mixqrt.ops.attention import block_attention
    t = q.shape[0]
    out = np.empty_like(q, dtype=np.float32)
    pos = np.arange(t)
    half = None if window is None else int(window) // 2
    for s0 in range(0, t, _ATT_BLOCK):
        s1 = min(t, s0 + _ATT_BLOCK)
        lo, hi = (0, t) if half is None else (max(0, s0 - half), min(t, s1 + half))
        mask = None
        if half is not None:
            d = pos[lo:hi][None, :] - pos[s0:s1, None]
            mask = (d < -half) | (d > half)
        block_attention(q[s0:s1], k[lo:hi].transpose(1, 0, 2), v[lo:hi].transpose(1, 0, 2), mask, out[s0:s1])
    return out


class Embedder:
    """Pooled (or per-token) embeddings of token-id sequences through a model's layer graph."""

    def __init__(self, model, info=None, *, tensors: dict | None = None, pooling: str | None = None,
                 normalize: bool | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS):
        self.model = model
        self.info = info if isinstance(info, EmbeddingInfo) else EmbeddingInfo.from_meta(info)
        self.pooling = _check_pooling(pooling) or self.info.pooling or "last"
        self.normalize = self.info.normalize if normalize is None else bool(normalize)
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, (int, np.integer)) or batch_tokens < 1:
            raise GenerationError(f"batch_tokens must be a positive integer, got {batch_tokens!r}")
        self.batch_tokens = int(batch_tokens)
        self.causal = self.info.causal and not getattr(model.args, "extra", {}).get("use_bidirectional_attention")
        self.dense = []
        d = model.args.hidden_size
        for wname, bname, act in self.info.dense:
            if act not in (None, "identity", "torch.nn.modules.linear.Identity"):
                raise ModelError(f"embedding dense layer {wname}: activation {str(act)[:60]!r} is not supported")
            w = _f32((tensors or {}).get(wname), wname)
            b = None if bname is None else _f32((tensors or {}).get(bname), bname)
            if w.ndim != 2 or w.shape[1] != d or (b is not None and b.shape != (w.shape[0],)):
                raise ModelError(f"embedding dense layer {wname}: shape {w.shape} does not take a {d}-vector")
            self.dense.append((w, b))
            d = w.shape[0]
        self.dim = d if self.pooling != "none" or not self.dense else model.args.hidden_size

    # ------------------------------------------------------------------ forward
    def hidden(self, seqs: list[np.ndarray], rows: str = "all") -> list[np.ndarray]:
        """Final-norm hidden states of one pack of sequences -> one [n_i, D] array each (rows
        "last" / "first": only those rows are final, and only they are returned, [1, D] each)."""
        m = self.model
        lens = [int(s.size) for s in seqs]
        ends = np.cumsum(lens)
        starts = ends - np.asarray(lens)
        ids = np.concatenate(seqs).astype(np.int64)
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        x = m.embed(ids)
        a = m.args
        att = np.empty((ids.size, a.num_attention_heads, a.head_dim), dtype=np.float32)
        n_layers = len(m.layers)
        window_of = getattr(m, "_window", lambda li: None)
        for li in range(n_layers):
            q, k, v = m.qkv(li, x, positions)
            for s, e in zip(starts, ends):
                if self.causal:
                    kt = np.ascontiguousarray(k[s:e].transpose(1, 0, 2))
                    vt = np.ascontiguousarray(v[s:e].transpose(1, 0, 2))
                    att[s:e] = m.attend(li, q[s:e], _Rows(li, kt, vt), 0)
                else:
                    att[s:e] = bidirectional_attention(q[s:e], k[s:e], v[s:e], window_of(li))
            m.attn_out(li, x, att)
            if li == n_layers - 1 and rows != "all":      # only the pooled rows need the last FFN
                pick = ends - 1 if rows == "last" else starts
                xr = np.ascontiguousarray(x[pick])
                m.ffn_stage(li, xr)
                return [r[None] for r in m.final_norm(xr)]
            m.ffn_stage(li, x)
        h = m.final_norm(x)
        return [h[s:e] for s, e in zip(starts, ends)]

    def _packs(self, seqs):
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].size)   # similar lengths pack together
        pack, n = [], 0
        for i in order:
            if pack and n + seqs[i].size > self.batch_tokens:
                yield pack
                pack, n = [], 0
            pack.append(i)
            n += seqs[i].size
        if pack:
            yield pack

    def rows(self) -> str:
        """Which rows the pooling reads: "last", "first" or "all"."""
        return {"last": "last", "cls": "first"}.get(self.pooling, "all")

    def embed(self, seqs, progress: bool = False):
        """Token-id sequences -> float32 [N, dim] (pooling none: a list of [n_i, hidden] arrays),
        on the calling thread (Engine.embed runs the same packs on the engine's thread)."""
        seqs = [self.model.check_tokens(s) for s in seqs]
        out: list = [None] * len(seqs)
        from tqdm.auto import tqdm
        bar = tqdm(total=len(seqs), desc="embedding", unit="input", disable=not progress)
        for pack in self._packs(seqs):
            for i, h in zip(pack, self.hidden([seqs[i] for i in pack], self.rows())):
                out[i] = h
            bar.update(len(pack))
        bar.close()
        return self.pool(out)

    def pool(self, out: list):
        """Per-input hidden rows (hidden()'s arrays) -> the pooled, projected, normalized vectors."""
        if not out:
            return [] if self.pooling == "none" else np.zeros((0, self.dim), dtype=np.float32)
        if self.pooling == "none":
            return [self._finish(h) for h in out]
        pooled = np.stack([h.mean(axis=0) if self.pooling == "mean" else h[-1 if self.pooling == "last" else 0]
                           for h in out]).astype(np.float32)
        return self._finish(pooled)

    def _finish(self, x: np.ndarray) -> np.ndarray:
        if self.pooling != "none":
            for w, b in self.dense:
                x = x @ w.T
                if b is not None:
                    x = x + b
        if self.normalize:
            n = np.linalg.norm(x, axis=-1, keepdims=True)
            x = x / np.maximum(n, np.float32(1e-12))
        return np.ascontiguousarray(x, dtype=np.float32)


def _f32(t, name):
    if t is None:
        raise ModelError(f"the model file lacks the embedding tensor {name!r} its embedding entry names")
    if isinstance(t, np.ndarray):
        return np.asarray(t, dtype=np.float32)
    from mixqrt.models.base import to_f32
    return to_f32(t, name)


def truncate(vecs: np.ndarray, dims: int, normalize: bool) -> np.ndarray:
    """Matryoshka truncation: the first `dims` components, renormalized when the vectors were."""
    v = np.ascontiguousarray(vecs[:, :dims])
    if normalize:
        v = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), np.float32(1e-12))
    return v.astype(np.float32)



MAX_INPUTS = 2048               # OpenAI's bound on inputs per embeddings request
MAX_INPUT_TOKENS = 300_000      # and on their tokens together
CHARS_PER_TOKEN = 64            # a string longer than this many characters per context token is refused untokenized


def encode_inputs(tokenizer, texts, field: str = "input", max_tokens: int | None = None) -> list[list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> token ids per
    input; RequestError naming the field for anything else, past the bounds above, or an input
    longer than max_tokens (the context)."""
    from mixqrt.errors import RequestError
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, (list, tuple)) or not texts:
        raise RequestError(field, f"{field} must be a string, a list of strings or token ids, not empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in texts):
        texts = [list(texts)]                        # one input given as token ids
    if len(texts) > MAX_INPUTS:
        raise RequestError(field, f"{field} has {len(texts)} inputs; at most {MAX_INPUTS}")
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    max_chars = CHARS_PER_TOKEN * (max_tokens or MAX_INPUT_TOKENS)
    out, total = [], 0
    for i, t in enumerate(texts):
        if isinstance(t, str):
            if len(t) > max_chars:
                raise RequestError(field, f"{field}[{i}] has {len(t)} characters; at most {max_chars} "
                                          f"({CHARS_PER_TOKEN} per token of the {max_tokens}-token context)")
            if not t:
                raise RequestError(field, f"{field}[{i}] is empty")
            if tokenizer is None:
                raise RequestError(field, "text input needs the model's tokenizer; pass token ids")
            from mixqrt.generation.tokenizer import with_bos
            ids = with_bos(tokenizer, tokenizer.encode(t, parse_special=False))
        elif isinstance(t, (list, tuple)) and t and all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            if len(t) > MAX_INPUT_TOKENS:
                raise RequestError(field, f"{field}[{i}] has {len(t)} tokens; at most {MAX_INPUT_TOKENS}")
            ids = list(t)
            bad = [x for x in ids if x < 0 or (vocab is not None and x >= vocab)]
            if bad:
                raise RequestError(field, f"{field}[{i}] holds token id {bad[0]} outside the vocabulary "
                                          f"[0, {vocab})")
        else:
            raise RequestError(field, f"{field}[{i}] must be a non-empty string or a non-empty list of token ids")
        if max_tokens is not None and len(ids) > max_tokens:
            raise RequestError(field, f"{field}[{i}] has {len(ids)} tokens; the context holds {max_tokens}")
        total += len(ids)
        if total > MAX_INPUT_TOKENS:
            raise RequestError(field, f"{field} has more than {MAX_INPUT_TOKENS} tokens in all")
        out.append(ids)
    return out


def check_dimensions(emb: "Embedder", dimensions) -> int | None:
    """The `dimensions` to truncate to (None: keep all); RequestError where the model does not allow it."""
    from mixqrt.errors import RequestError
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or dimensions < 1:
        raise RequestError("dimensions", f"dimensions must be a positive integer, got {dimensions!r}")
    if emb.pooling == "none":
        raise RequestError("dimensions", "dimensions needs pooled embeddings (this model pools 'none')")
    if dimensions == emb.dim:
        return None
    if dimensions > emb.dim:
        raise RequestError("dimensions", f"dimensions={dimensions} exceeds the model's {emb.dim}")
    if not emb.info.matryoshka:
        raise RequestError("dimensions", f"this model's embeddings are not trained to be truncated (Matryoshka); "
                                         f"dimensions must be {emb.dim}")
    return int(dimensions)
