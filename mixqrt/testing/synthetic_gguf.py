"""Random-weight GGUF files in llama.cpp's own tensor names and metadata, for checking an architecture
against llama.cpp without downloading a model.

One small configuration per architecture (`SPECS`), weights drawn from numpy's default_rng(seed), all
tensors F32, a 512-token byte-level BPE vocabulary ("gpt2", which both llama.cpp and mixqrt's GGUF
reader accept). The same name and seed give a byte-identical file, so a stored sha256 proves that a
rebuilt file is the model a stored reference was computed on.

    from mixqrt.testing.synthetic_gguf import write_synthetic_gguf, token_ids
    path = write_synthetic_gguf("qwen3", "/tmp/qwen3.gguf")          # seed = SPECS["qwen3"]["seed"]
    ids = token_ids("qwen3")                                         # 128 fixed token ids

Tensors are laid out as llama.cpp reads them. A GGUF tensor with ggml dims {ne0, ne1, ne2} is a numpy
array of shape (ne2, ne1, ne0): a matrix is [out, in] like Hugging Face's, routed experts are stacked
[expert, out, in]. For the `llama` architecture the converter permutes q/k rows for llama.cpp's
adjacent-pair RoPE; random weights have no HF original, so the file *is* the model and a reader
undoes the permutation as it would for a converted file. Gemma 3 norm weights are stored as llama.cpp's
converter stores them, already shifted by +1 (the multiplier itself, HF's weight + 1).

The configurations (what each one exercises):
  qwen2      q/k/v biases, GQA, untied output
  llama      plain Llama (no rope scaling): no biases, tied embeddings (as SmolLM2, Llama 3.2 1B/3B)
  llama3     Llama 3.x: rope_freqs.weight (the "llama3" rope_scaling frequency factors, as the
             converter writes them: no rope.scaling.* keys), tied embeddings. original context 64, so
             the scaled frequencies matter within the 128 tokens of a check
  qwen3      q/k RMSNorm per head, head_dim 32 with hidden 64 / 4 heads, tied embeddings
  qwen2moe   softmax router, 8 experts top-2 (weights not renormalised), shared expert with its
             sigmoid gate (ffn_gate_inp_shexp), q/k/v biases
  qwen3moe   8 experts top-2, top-k weights renormalised (llama.cpp always does for qwen3moe:
             norm_topk_prob), no shared expert, q/k norms
  gemma3     embedding x sqrt(hidden), pre/post norms around attention and FFN, q/k norms, GeGLU
             (tanh GELU), sliding window 16 on layers 0-4 and a global layer 5 (llama.cpp's default
             pattern 6), RoPE base 1e6 global / 10000 local (llama.cpp's default when the file has no
             rope.freq_base_swa, as converted Gemma 3 files have none), tied embeddings
"""
from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import numpy as np

from mixqrt.errors import ModelError

VOCAB = 512
N_TOKENS = 128
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")   # the last ids of the vocabulary

_BASE = {"n_layer": 2, "hidden": 64, "n_head": 4, "n_head_kv": 2, "head_dim": 16, "ff": 128,
         "vocab": VOCAB, "context": 4096, "rms_eps": 1e-6, "rope_base": 10000.0, "qkv_bias": False,
         "qk_norm": False, "tied": False}

SPECS: dict[str, dict] = {
    "qwen2": {**_BASE, "arch": "qwen2", "seed": 2, "rope_base": 1e6, "qkv_bias": True},
    "llama": {**_BASE, "arch": "llama", "seed": 3, "tied": True},
    "llama3": {**_BASE, "arch": "llama", "seed": 4, "hidden": 128, "head_dim": 32, "rope_base": 500000.0,
               "tied": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen3": {**_BASE, "arch": "qwen3", "seed": 5, "head_dim": 32, "rope_base": 1e6, "qk_norm": True,
              "tied": True},
    "qwen2moe": {**_BASE, "arch": "qwen2moe", "seed": 6, "n_head_kv": 4, "rope_base": 1e6, "qkv_bias": True,
                 "n_expert": 8, "n_expert_used": 2, "expert_ff": 32, "shared_ff": 96, "norm_topk_prob": False},
    "qwen3moe": {**_BASE, "arch": "qwen3moe", "seed": 7, "head_dim": 32, "rope_base": 1e6, "qk_norm": True,
                 "n_expert": 8, "n_expert_used": 2, "expert_ff": 32, "norm_topk_prob": True},
    "gemma3": {**_BASE, "arch": "gemma3", "seed": 8, "n_layer": 6, "n_head_kv": 1, "head_dim": 32,
               "rope_base": 1e6, "rope_base_swa": 10000.0, "sliding_window": 16, "swa_pattern": 6,
               "qk_norm": True, "tied": True, "embed_scale": 8.0},
}

# embedding models (mixqrt.generation.embed; tests/test_embed_oracle.py, benchmarks/oracle_embeddings.py): one per
# pooling type, in llama.cpp's GGUF keys ({arch}.pooling_type: 0 none, 1 mean, 2 cls, 3 last)
EMBED_SPECS: dict[str, dict] = {
    "qwen3-last": {**SPECS["qwen3"], "seed": 21, "pooling": 3},              # Qwen3-Embedding
    "qwen2-mean": {**SPECS["qwen2"], "seed": 22, "pooling": 1},
    "llama-cls": {**SPECS["llama"], "seed": 23, "pooling": 2},
    "qwen2-none": {**SPECS["qwen2"], "seed": 24, "pooling": 0},
    # EmbeddingGemma: gemma-embedding (bidirectional, symmetric sliding window), mean pooling, and the
    # sentence-transformers dense projections dense_2 (64 -> 96) and dense_3 (96 -> 64)
    "gemma-embed": {**SPECS["gemma3"], "arch": "gemma-embedding", "seed": 25, "pooling": 1,
                    "dense": (96, 64)},
}
GEMMA_ARCHS = ("gemma3", "gemma-embedding")


def spec(name: str) -> dict:
    """A copy of the configuration `name` (ModelError naming the known ones otherwise)."""
    table = SPECS if name in SPECS else EMBED_SPECS
    if name not in table:
        raise ModelError(f"no synthetic configuration {name!r}; known: {', '.join([*SPECS, *EMBED_SPECS])}")
    return copy.deepcopy(table[name])


def token_ids(name: str, n: int = N_TOKENS, seed: int | None = None) -> np.ndarray:
    """`n` fixed token ids (int32) for configuration `name`, from default_rng(seed + 1000)."""
    cfg = spec(name)
    rng = np.random.default_rng((cfg["seed"] if seed is None else seed) + 1000)
    return rng.integers(0, cfg["vocab"] - len(_SPECIALS), size=n).astype(np.int32)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp applies for rope_scaling type "llama3" (rope_freqs.weight):
    1 for short wavelengths, `factor` for long ones, a smooth blend in between."""
    rs, dim = cfg["rope_scaling"], cfg["head_dim"]
    freqs = 1.0 / cfg["rope_base"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    orig = rs["original_max_position_embeddings"]
    lo_wl, hi_wl = orig / rs["low_freq_factor"], orig / rs["high_freq_factor"]
    smooth = (orig / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    blend = 1.0 / ((1 - smooth) / rs["factor"] + smooth)
    out = np.where(wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, rs["factor"], blend))
    return out.astype(np.float32)


def _vocabulary(n: int):
    """(tokens, token types, merges): GPT-2 byte-level tokens, merges of lower-case letter pairs,
    and the special tokens last."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    byte_tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    n_merges = n - 256 - len(_SPECIALS)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(a, b) for a in letters for b in letters][:n_merges]
    tokens = byte_tokens + [a + b for a, b in pairs] + list(_SPECIALS)
    types = [1] * (n - len(_SPECIALS)) + [3] * len(_SPECIALS)           # NORMAL, then CONTROL
    return tokens, types, [f"{a} {b}" for a, b in pairs]


def synthetic_tensors(cfg: dict) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (numpy shape = reversed ggml dims), in write order, from cfg['seed']."""
    rng = np.random.default_rng(cfg["seed"])
    h, nh, nkv, hd, ff, v = (cfg[k] for k in ("hidden", "n_head", "n_head_kv", "head_dim", "ff", "vocab"))

    def mat(rows, cols, *lead):
        return (rng.standard_normal((*lead, rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {}
    emb_std = 1.0 / cfg["embed_scale"] if cfg.get("embed_scale") else 1.0
    t["token_embd.weight"] = (emb_std * rng.standard_normal((v, h))).astype(np.float32)
    if cfg.get("rope_scaling"):
        t["rope_freqs.weight"] = llama3_rope_factors(cfg)
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(h)
        t[p + "attn_q.weight"] = mat(nh * hd, h)
        t[p + "attn_k.weight"] = mat(nkv * hd, h)
        t[p + "attn_v.weight"] = mat(nkv * hd, h)
        if cfg["qkv_bias"]:
            t[p + "attn_q.bias"], t[p + "attn_k.bias"], t[p + "attn_v.bias"] = \
                bias(nh * hd), bias(nkv * hd), bias(nkv * hd)
        if cfg["qk_norm"]:
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(hd), norm(hd)
        t[p + "attn_output.weight"] = mat(h, nh * hd)
        if cfg["arch"] in GEMMA_ARCHS:
            t[p + "post_attention_norm.weight"] = norm(h)
        t[p + "ffn_norm.weight"] = norm(h)
        if cfg.get("n_expert"):
            ne, ef = cfg["n_expert"], cfg["expert_ff"]
            t[p + "ffn_gate_inp.weight"] = mat(ne, h)
            t[p + "ffn_gate_exps.weight"] = mat(ef, h, ne)
            t[p + "ffn_up_exps.weight"] = mat(ef, h, ne)
            t[p + "ffn_down_exps.weight"] = mat(h, ef, ne)
            if cfg.get("shared_ff"):
                sf = cfg["shared_ff"]
                t[p + "ffn_gate_inp_shexp.weight"] = mat(1, h)[0]
                t[p + "ffn_gate_shexp.weight"] = mat(sf, h)
                t[p + "ffn_up_shexp.weight"] = mat(sf, h)
                t[p + "ffn_down_shexp.weight"] = mat(h, sf)
        else:
            t[p + "ffn_gate.weight"] = mat(ff, h)
            t[p + "ffn_up.weight"] = mat(ff, h)
            t[p + "ffn_down.weight"] = mat(h, ff)
        if cfg["arch"] in GEMMA_ARCHS:
            t[p + "post_ffw_norm.weight"] = norm(h)
    t["output_norm.weight"] = norm(h)
    if not cfg["tied"]:
        t["output.weight"] = mat(v, h)
    if cfg.get("dense"):
        mid, out = cfg["dense"]
        t["dense_2.weight"] = mat(mid, h)
        t["dense_3.weight"] = mat(out, mid)
    return t


def _add_metadata(w, cfg: dict) -> None:
    arch, h, nh = cfg["arch"], cfg["hidden"], cfg["n_head"]
    w.add_name(f"mixqrt synthetic {arch}")
    w.add_file_type(0)                                       # ALL_F32
    w.add_context_length(cfg["context"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["n_layer"])
    w.add_feed_forward_length(cfg["ff"])
    w.add_head_count(nh)
    w.add_head_count_kv(cfg["n_head_kv"])
    if cfg["head_dim"] != h // nh or arch in ("qwen3", "qwen3moe", *GEMMA_ARCHS):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
        w.add_vocab_size(cfg["vocab"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_layer_norm_rms_eps(cfg["rms_eps"])
    if cfg.get("n_expert"):
        w.add_expert_count(cfg["n_expert"])
        w.add_expert_used_count(cfg["n_expert_used"])
        w.add_expert_feed_forward_length(cfg["expert_ff"])
        if cfg.get("shared_ff"):
            w.add_expert_shared_feed_forward_length(cfg["shared_ff"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("pooling") is not None:
        w.add_uint32(f"{arch}.pooling_type", cfg["pooling"])
    if cfg.get("dense"):
        mid, out = cfg["dense"]
        for k, v in (("dense_2_feat_in", h), ("dense_2_feat_out", mid), ("dense_3_feat_in", mid),
                     ("dense_3_feat_out", out)):
            w.add_uint32(f"{arch}.{k}", v)
    tokens, types, merges = _vocabulary(cfg["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_add_bos_token(False)


def write_synthetic_gguf(name: str, path, seed: int | None = None) -> Path:
    """Write configuration `name` (weights from `seed`, default its own) to `path`, atomically."""
    import gguf

    from mixqrt.io.atomic import mkstemp_for

    cfg = spec(name)
    if seed is not None:
        cfg["seed"] = int(seed)
    path = Path(path)
    fd, tmp = mkstemp_for(path)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, cfg["arch"])
        _add_metadata(w, cfg)
        for tname, arr in synthetic_tensors(cfg).items():
            w.add_tensor(tname, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- numpy reference
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float, pairs: str, factors=None) -> np.ndarray:
    """x [T, H, D]. pairs='adjacent': (x[2i], x[2i+1]) rotate (llama.cpp's NORM mode, the llama
    architecture); 'halves': (x[i], x[i + D/2]) (NEOX mode, every other architecture here)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        inv = inv / np.asarray(factors, dtype=np.float64)
    ang = pos[:, None, None].astype(np.float64) * inv[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    if pairs == "adjacent":
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(name: str, ids, seed: int | None = None) -> np.ndarray:
    """Float64 numpy forward of configuration `name` over token ids at positions 0.., with llama.cpp's
    semantics (the specification the stored oracle logits are checked against). Returns float32
    [len(ids), vocab]."""
    cfg = spec(name)
    if seed is not None:
        cfg["seed"] = int(seed)
    t = {k: v.astype(np.float64) for k, v in synthetic_tensors(cfg).items()}
    arch, eps = cfg["arch"], cfg["rms_eps"]
    nh, nkv, hd = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    pos = np.arange(n)
    pairs = "adjacent" if arch == "llama" else "halves"
    factors = t.get("rope_freqs.weight")
    x = t["token_embd.weight"][ids]
    if cfg.get("embed_scale"):
        x = x * np.sqrt(cfg["hidden"])
    dist = pos[:, None] - pos[None, :]                          # query i, key j: i - j
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        a = _rms(x, t[p + "attn_norm.weight"], eps)
        q, k, v = (a @ t[p + f"attn_{c}.weight"].T for c in "qkv")
        if cfg["qkv_bias"]:
            q, k, v = q + t[p + "attn_q.bias"], k + t[p + "attn_k.bias"], v + t[p + "attn_v.bias"]
        q, k, v = q.reshape(n, nh, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
        if cfg["qk_norm"]:
            q, k = _rms(q, t[p + "attn_q_norm.weight"], eps), _rms(k, t[p + "attn_k_norm.weight"], eps)
        base = cfg["rope_base"]
        window = None
        if cfg.get("sliding_window") and i % cfg["swa_pattern"] < cfg["swa_pattern"] - 1:
            base, window = cfg["rope_base_swa"], cfg["sliding_window"]
        q, k = _rope(q, pos, base, pairs, factors), _rope(k, pos, base, pairs, factors)
        mask = dist < 0 if window is None else (dist < 0) | (dist >= window)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
        s = np.where(mask[None], -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", s, v).reshape(n, nh * hd) @ t[p + "attn_output.weight"].T
        if arch == "gemma3":
            o = _rms(o, t[p + "post_attention_norm.weight"], eps)
        x = x + o
        f = _rms(x, t[p + "ffn_norm.weight"], eps)
        act = _gelu_tanh if arch == "gemma3" else _silu
        if cfg.get("n_expert"):
            probs = np.exp(f @ t[p + "ffn_gate_inp.weight"].T)
            probs /= probs.sum(-1, keepdims=True)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg["n_expert_used"]]
            w = np.take_along_axis(probs, top, axis=-1)
            if cfg["norm_topk_prob"]:
                w = w / w.sum(-1, keepdims=True)
            out = np.zeros_like(f)
            g_e, u_e, d_e = (t[p + f"ffn_{c}_exps.weight"] for c in ("gate", "up", "down"))
            for r in range(n):
                for e, we in zip(top[r], w[r]):
                    out[r] += we * (d_e[e] @ (act(g_e[e] @ f[r]) * (u_e[e] @ f[r])))
            if cfg.get("shared_ff"):
                gate = 1.0 / (1.0 + np.exp(-(f @ t[p + "ffn_gate_inp_shexp.weight"])))
                sh = (act(f @ t[p + "ffn_gate_shexp.weight"].T) * (f @ t[p + "ffn_up_shexp.weight"].T)) \
                    @ t[p + "ffn_down_shexp.weight"].T
                out = out + gate[:, None] * sh
        else:
            out = (act(f @ t[p + "ffn_gate.weight"].T) * (f @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        if arch == "gemma3":
            out = _rms(out, t[p + "post_ffw_norm.weight"], eps)
        x = x + out
    x = _rms(x, t["output_norm.weight"], eps)
    head = t.get("output.weight", t["token_embd.weight"])
    return (x @ head.T).astype(np.float32)
