"""Qwen2/Llama graph on synthetic float weights vs an independent float64 numpy forward (written here,
not reusing mixqrt.ops.ref), KV-cache decode vs full recompute, config and weight validation."""
import os

import numpy as np
import pytest

from mixqrt.errors import GenerationError, ModelError
from mixqrt.models import build_model, get_model_class
from mixqrt.models.qwen2 import ModelArgs


def tiny_config(arch="qwen2", tied=False, hq=4, hkv=2, dh=8, d=32, inter=48, layers=2, vocab=97):
    return {"model_type": arch, "hidden_size": d, "num_hidden_layers": layers, "intermediate_size": inter,
            "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": dh, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": tied, "some_unknown_key": [1, 2]}


def tiny_weights(cfg, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    d, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq = cfg["num_attention_heads"] * cfg["head_dim"]
    nkv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def m(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    w = {"model.embed_tokens.weight": m(v, d, s=1.0), "model.norm.weight": 1 + m(d, s=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = m(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + m(d, s=0.1), p + "post_attention_layernorm.weight": 1 + m(d, s=0.1),
                  p + "self_attn.q_proj.weight": m(nq, d), p + "self_attn.k_proj.weight": m(nkv, d),
                  p + "self_attn.v_proj.weight": m(nkv, d), p + "self_attn.o_proj.weight": m(d, nq),
                  p + "mlp.gate_proj.weight": m(inter, d), p + "mlp.up_proj.weight": m(inter, d),
                  p + "mlp.down_proj.weight": m(d, inter)})
        if bias:
            w.update({p + "self_attn.q_proj.bias": m(nq, s=0.5), p + "self_attn.k_proj.bias": m(nkv, s=0.5),
                      p + "self_attn.v_proj.bias": m(nkv, s=0.5)})
    return w


def ref_forward(cfg, w, ids):
    """Float64 HF forward, written from the transformers modeling code (rotate-half RoPE, GQA)."""
    class F64:  # float64 on demand, one tensor at a time (the real 0.5B model would not fit twice)
        def __getitem__(self, k):
            return np.asarray(w[k], dtype=np.float64)

        def get(self, k, default):
            return self[k] if k in w else default
    f = F64()
    d, hq, hkv, dh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    t = len(ids)

    def norm(x, g):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g

    inv_freq = theta ** -(np.arange(0, dh, 2) / dh)
    ang = np.arange(t)[:, None] * inv_freq[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))   # [T, Dh]

    def rope(x):  # x [H, T, Dh]
        rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
        return x * cos + rot * sin

    x = np.asarray(w["model.embed_tokens.weight"][np.asarray(ids)], dtype=np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, f[p + "input_layernorm.weight"])
        proj = {}
        for n in "qkv":
            proj[n] = h @ f[p + f"self_attn.{n}_proj.weight"].T + f.get(p + f"self_attn.{n}_proj.bias", 0.0)
        q = rope(proj["q"].reshape(t, hq, dh).transpose(1, 0, 2))
        k = rope(proj["k"].reshape(t, hkv, dh).transpose(1, 0, 2))
        v = proj["v"].reshape(t, hkv, dh).transpose(1, 0, 2)
        k, v = np.repeat(k, hq // hkv, 0), np.repeat(v, hq // hkv, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(dh) + np.triu(np.full((t, t), -np.inf), 1)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + (pr @ v).transpose(1, 0, 2).reshape(t, hq * dh) @ f[p + "self_attn.o_proj.weight"].T
        h = norm(x, f[p + "post_attention_layernorm.weight"])
        g = h @ f[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ f[p + "mlp.up_proj.weight"].T)) @ f[p + "mlp.down_proj.weight"].T
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    x = norm(x, f["model.norm.weight"])
    return np.concatenate([x @ np.asarray(head[i:i + 16384], dtype=np.float64).T
                           for i in range(0, head.shape[0], 16384)], axis=1)


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


CASES = [("qwen2", False, 4, 2), ("qwen2", True, 4, 1), ("llama", False, 4, 4), ("llama", True, 6, 2)]


@pytest.mark.parametrize("arch,tied,hq,hkv", CASES)
def test_forward_matches_float64_reference(arch, tied, hq, hkv):
    cfg = tiny_config(arch, tied, hq=hq, hkv=hkv)
    w = tiny_weights(cfg, seed=hq + hkv, bias=(arch == "qwen2"))
    model = build_model(cfg, w)
    assert model.layers[0].qkv_bias is not None if arch == "qwen2" else model.layers[0].qkv_bias is None
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    got = model.logits(ids)
    assert got.shape == (len(ids), cfg["vocab_size"]) and got.dtype == np.float32
    assert rel_err(got, ref_forward(cfg, w, ids)) < 1e-5


@pytest.mark.parametrize("arch,tied,hq,hkv", CASES[:2])
def test_incremental_decode_equals_full_recompute(arch, tied, hq, hkv):
    cfg = tiny_config(arch, tied, hq=hq, hkv=hkv)
    model = build_model(cfg, tiny_weights(cfg, seed=7, bias=(arch == "qwen2")))
    ids = np.array([5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], dtype=np.int64)
    full = model.logits(ids)
    # prefill 5 then one token at a time
    cache = model.make_cache(len(ids))
    last = model(ids[:5], cache, last_only=True)
    assert cache.offset == 5
    np.testing.assert_allclose(last, full[4], rtol=0, atol=1e-5 * np.abs(full).max())
    for i in range(5, len(ids)):
        step = model(ids[i:i + 1], cache, last_only=True)
        np.testing.assert_allclose(step, full[i], rtol=0, atol=1e-5 * np.abs(full).max())
    assert cache.offset == len(ids)
    # chunked prefill with small chunks, all positions
    for chunk in (1, 3, 4):
        got = model(ids, model.make_cache(len(ids)), 0, chunk_size=chunk)
        np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * np.abs(full).max())
        got_last = model(ids, model.make_cache(len(ids)), 0, last_only=True, chunk_size=chunk)
        np.testing.assert_allclose(got_last, full[-1], rtol=0, atol=1e-5 * np.abs(full).max())


def test_decode_steps_run_hot_and_restore(monkeypatch):
    """Off by default; with HOT_MAX_T set, decode-sized forward calls switch the pool to hot mode
    for the step and restore it after; long prompts do not; an error inside the step still restores it."""
    from mixqrt import ops
    from mixqrt.models import qwen2
    cfg = tiny_config()
    model = build_model(cfg, tiny_weights(cfg))
    seen = []
    real = qwen2.ops.matmul

    def spy(w, x, *a, **k):
        seen.append(ops.is_hot())
        return real(w, x, *a, **k)

    monkeypatch.setattr(qwen2.ops, "matmul", spy)
    assert not ops.is_hot()
    cache = model.make_cache(64)
    model(np.array([2]), cache, last_only=True)                             # default: off
    assert seen and not any(seen)
    seen.clear()
    monkeypatch.setattr(qwen2, "HOT_MAX_T", 16)
    model(np.arange(1, 1 + qwen2.HOT_MAX_T + 1), cache, last_only=True)     # prefill: cold
    assert seen and not any(seen) and not ops.is_hot()
    seen.clear()
    model(np.array([3]), cache, last_only=True)                             # decode: hot
    assert seen and all(seen) and not ops.is_hot()
    with ops.hot():                                                          # caller's hot mode kept
        model(np.array([4]), cache, last_only=True)
        assert ops.is_hot()
    assert not ops.is_hot()

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(qwen2.ops, "matmul", boom)
    with pytest.raises(RuntimeError):
        model(np.array([5]), cache, last_only=True)
    assert not ops.is_hot()


def test_cache_trim_and_overflow():
    cfg = tiny_config()
    model = build_model(cfg, tiny_weights(cfg))
    ids = np.array([1, 2, 3, 4, 5, 6])
    full = model.logits(ids)
    cache = model.make_cache(6)
    model(ids, cache)
    assert cache.trim(2) == 2 and cache.offset == 4
    again = model(ids[4:], cache, last_only=True)          # recompute the trimmed positions
    np.testing.assert_allclose(again, full[-1], atol=1e-5 * np.abs(full).max(), rtol=0)
    with pytest.raises(GenerationError, match="overflow"):
        model(ids[:1], cache)
    cache.reset()
    assert cache.offset == 0 and cache.nbytes == 2 * 2 * 2 * 6 * 8 * 4
    with pytest.raises(GenerationError):
        model(np.array([cfg["vocab_size"]]), model.make_cache(4))
    with pytest.raises(GenerationError):
        model(np.array([], dtype=np.int64), model.make_cache(4))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_kv_cache_pages_resident_only_when_written():
    """Caches sized for a long context cost only the rows written, even after caches were freed
    (np.zeros through glibc's heap zeroed whole arrays there: a serving process with its prompt
    cache of idle caches grew by gigabytes)."""
    from mixqrt.models.kv_cache import KVCache
    for _ in range(3):                                       # churn: raises glibc's mmap threshold
        KVCache(24, 2, 64, 2048).keys[0][:, :4] = 1.0
    r0, keep = _rss(), []
    for _ in range(30):                                      # 30 x 48 MiB virtual, 4 rows written
        c = KVCache(24, 2, 64, 2048)
        for a in c.keys + c.values:
            a[:, :4] = 1.0
        keep.append(c)
    grown = _rss() - r0
    assert grown < 80 << 20, f"{grown >> 20} MiB resident for 30 caches of 4 rows"
    assert all(float(c.values[23][1, 3, 0]) == 1.0 and float(c.keys[5][0, 4, 0]) == 0.0 for c in keep)


def test_unfused_fallback_when_formats_differ(monkeypatch):
    """A q/k/v set that cannot be fused (here: mixed types) runs as separate matmuls, same result."""
    import mixqrt.models.qwen2 as q2
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=3)
    ids = [1, 7, 9, 2]
    want = build_model(cfg, w).logits(ids)
    monkeypatch.setattr(q2.spec, "fuse", lambda parts: None if not isinstance(parts[0], np.ndarray) or parts[0].ndim == 2
                        else np.concatenate(parts))
    m = build_model(cfg, w)
    assert len(m.layers[0].qkv) == 3 and len(m.layers[0].gate_up) == 2
    np.testing.assert_allclose(m.logits(ids), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_prefused_tensors_accepted():
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=4)
    want = build_model(cfg, w).logits([1, 2, 3])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = np.concatenate([w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        w[p + "self_attn.qkv_proj.bias"] = np.concatenate([w.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        w[p + "mlp.gate_up_proj.weight"] = np.concatenate([w.pop(p + "mlp.gate_proj.weight"),
                                                           w.pop(p + "mlp.up_proj.weight")])
    np.testing.assert_allclose(build_model(cfg, w).logits([1, 2, 3]), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_qtensor_fusion_is_byte_concatenation():
    pytest.importorskip("mixqrt.formats.codec")
    from mixqrt.models.spec import fuse
    from mixqrt.formats.codec import quantize
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 40)).astype(np.float32) for n in (8, 4, 4)]
    for fmt in ("q8", "q6", "q4", "q3p", "f32"):
        qs = [quantize(p, fmt) for p in parts]
        fused = fuse(qs)
        assert fused is not None and fused.shape == (16, 40) and fused.fmt == fmt
        np.testing.assert_array_equal(fused.dequantize(), np.concatenate([q.dequantize() for q in qs]))
    assert fuse([quantize(parts[0], "q8"), quantize(parts[1], "q6")]) is None


# ---------------------------------------------------------------------------- validation
def test_model_args_validation():
    a = ModelArgs.from_dict(tiny_config())
    assert a.head_dim == 8 and a.attention_bias and a.extra["some_unknown_key"] == [1, 2]
    assert not ModelArgs.from_dict(tiny_config("llama")).attention_bias
    cfg = tiny_config()
    del cfg["head_dim"]
    assert ModelArgs.from_dict(cfg).head_dim == 8
    bad = [({"hidden_size": 30, "head_dim": None}, "does not divide hidden_size"),
           ({"num_key_value_heads": 3}, "does not divide num_attention_heads"),
           ({"vocab_size": None}, "missing required key.*vocab_size"),
           ({"num_hidden_layers": 0}, "num_hidden_layers"),
           ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
           ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
           ({"hidden_size": "32"}, "hidden_size")]
    for patch, msg in bad:
        cfg = tiny_config()
        cfg.update(patch)
        with pytest.raises(ModelError, match=msg):
            ModelArgs.from_dict(cfg)
    with pytest.raises(ModelError, match="unknown architecture"):
        get_model_class("gpt2")
    with pytest.raises(ModelError):
        ModelArgs.from_dict([1, 2])


def test_missing_and_misshaped_tensors():
    cfg = tiny_config()
    w = tiny_weights(cfg)
    del w["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ModelError, match="model.layers.1.self_attn.k_proj.bias"):
        build_model(cfg, w)
    w = tiny_weights(cfg)
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"].T
    with pytest.raises(ModelError, match="down_proj.*shape"):
        build_model(cfg, w)
    w = tiny_weights(cfg)
    del w["lm_head.weight"]
    with pytest.raises(ModelError, match="lm_head.weight"):
        build_model(cfg, w)
    # tied: lm_head present wins over the embedding (a higher-bit copy of a tied table)
    cfg = tiny_config(tied=True)
    w = tiny_weights(cfg)
    w["lm_head.weight"] = w["model.embed_tokens.weight"] * 2
    m = build_model(cfg, w)
    assert m.lm_head is not m.embed_tokens
    np.testing.assert_array_equal(m.lm_head, w["lm_head.weight"])


def test_float16_kv_cache_close_to_float32():
    cfg = tiny_config()
    model = build_model(cfg, tiny_weights(cfg, seed=5))
    ids = np.array([4, 8, 15, 16, 23, 42])
    full = model.logits(ids)
    cache = model.make_cache(len(ids), dtype=np.float16)
    assert cache.keys[0].dtype == np.float16 and cache.nbytes == 2 * 2 * 2 * 6 * 8 * 2
    model(ids[:3], cache)
    got = np.stack([model(ids[i:i + 1], cache, last_only=True) for i in range(3, 6)])
    assert rel_err(got, full[3:]) < 3e-3
    with pytest.raises(GenerationError, match="dtype"):
        model.make_cache(4, dtype=np.int8)
