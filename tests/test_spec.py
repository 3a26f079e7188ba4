"""models/spec.py: one model contract (names, shapes, roles, fusion groups) and one fuse(), checked
over every pair of formats a fusion group's parts can have."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mixqrt import ops
from mixqrt.errors import ModelError
from mixqrt.models import build_model, spec
from mixqrt.formats import FORMATS, quantize
from tinymodel import make_tiny_hf_model

ALL = sorted(FORMATS)
PAIRS = list(itertools.product(ALL, ALL))


def _cfg(arch="qwen2", **kw):
    c = {"model_type": arch, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "tie_word_embeddings": True}
    c.update(kw)
    return c


# ----------------------------------------------------------------------------- the contract
def test_shapes_roles_and_groups_from_the_config():
    s = spec.ModelSpec(_cfg(), "qwen2")
    shapes = s.shapes()
    assert list(shapes)[0] == spec.EMBED and list(shapes)[-1] == spec.FINAL_NORM      # tied: no lm_head
    assert list(s.shapes(with_lm_head=True))[-1] == spec.LM_HEAD
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert s.fused_shape("model.layers.0.self_attn.qkv_proj.weight") == (128, 64)
    assert s.fused_shape("model.layers.0.mlp.gate_up_proj.weight") == (192, 64)
    assert [t for t, _ in s.groups(0)] == ["model.layers.0.self_attn.qkv_proj.weight",
                                           "model.layers.0.self_attn.qkv_proj.bias",
                                           "model.layers.0.mlp.gate_up_proj.weight"]
    for name in shapes:
        assert spec.role_of(name) in spec.ROLES
    assert spec.role_of("model.layers.3.mlp.gate_up_proj.weight") == "ffn_gate_up"
    with pytest.raises(ModelError, match="no known role"):
        spec.role_of("model.layers.0.mlp.experts.0.weight")
    # llama: biases only with attention_bias, then o_proj's too
    assert not any(n.endswith(".bias") for n in spec.ModelSpec(_cfg("llama"), "llama").shapes())
    lb = spec.ModelSpec(_cfg("llama", attention_bias=True), "llama").shapes()
    assert "model.layers.0.self_attn.o_proj.bias" in lb and "model.layers.0.self_attn.q_proj.bias" in lb


@pytest.mark.parametrize("key,bad", [("hidden_size", "64"), ("num_hidden_layers", 0), ("head_dim", -8),
                                     ("vocab_size", True), ("num_key_value_heads", 1.5)])
def test_config_sizes_must_be_positive_ints(key, bad):
    with pytest.raises(ModelError, match=key):
        spec.ModelSpec(_cfg(**{key: bad}), "qwen2")
    with pytest.raises(ModelError, match="unknown architecture"):
        spec.ModelSpec(_cfg(), "gpt2")


def test_check_names_missing_misshapen_and_extra_tensors():
    s = spec.ModelSpec(_cfg(), "qwen2")
    good = dict(s.shapes())
    s.check(good, "x")
    s.check(dict(good, **{"model.layers.0.self_attn.rotary_emb.inv_freq": (8,), spec.LM_HEAD: (50, 64)}), "x")
    with pytest.raises(ModelError, match="missing tensor 'model.norm.weight'"):
        s.check({k: v for k, v in good.items() if k != spec.FINAL_NORM}, "x")
    with pytest.raises(ModelError, match="config says"):
        s.check(dict(good, **{spec.FINAL_NORM: (65,)}), "x")
    # a tensor the graph has no place for would be dropped silently: refused (here: o_proj bias on qwen2)
    with pytest.raises(ModelError, match="not part of the qwen2 graph"):
        s.check(dict(good, **{"model.layers.0.self_attn.o_proj.bias": (64,)}), "x")


# ----------------------------------------------------------------------------- fuse, every pair
@pytest.mark.parametrize("f1,f2", PAIRS)
def test_fuse_every_format_pair_matches_the_unfused_product(f1, f2):
    rng = np.random.default_rng(hash((f1, f2)) % 2**32)
    k = 96                                                      # not a multiple of q2c's 128 group
    a, b = (rng.standard_normal((n, k)).astype(np.float32) for n in (40, 24))
    x = rng.standard_normal((5, k)).astype(np.float32)
    parts = [quantize(a, f1), quantize(b, f2)]
    want = np.concatenate([ops.matmul(p, x) for p in parts], axis=-1)
    reason = spec.fuse_refusal([f1, f2], [a.shape, b.shape], [p.meta for p in parts])
    fused = spec.fuse(parts)
    assert (fused is None) == (reason is not None)
    if f1 != f2 or f1 == "q5g":
        assert fused is None                                    # refused up front, never half-built
        return
    assert fused.fmt == f1 and fused.shape == (64, k)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    np.testing.assert_allclose(ops.matmul(fused, x), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # row_slice is fuse's inverse
    back = spec.row_slice(fused, 40, 64)
    np.testing.assert_array_equal(back.raw, parts[1].raw)


def test_fuse_vectors_and_mixed_kinds():
    v = [np.ones(3, np.float32), np.zeros(2, np.float32)]
    assert spec.fuse(v).shape == (5,)
    q = [quantize(np.ones(32, np.float32), "q8"), quantize(np.ones(32, np.float32), "q8")]
    assert spec.fuse(q) is None and "padded" in spec.fuse_refusal(["q8", "q8"], [(32,), (32,)])
    assert spec.fuse([quantize(np.ones(32, np.float32), "f16")] * 2).shape == (64,)
    assert spec.fuse([np.ones((2, 32), np.float32), quantize(np.ones((2, 32), np.float32), "q8")]) is None
    with pytest.raises(Exception, match="row views"):
        spec.row_slice(quantize(np.ones((4, 32), np.float32), "q5g"), 0, 2)


# ----------------------------------------------------------------------------- write, load, run
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from mixqrt.io import open_source
    return open_source(str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True)))


def _split_reference(path):
    """The model from `path` with every fused group split back into its parts (row views), run one
    matmul per part: the unfused reference."""
    from mixqrt.io.mxq import MxqFile
    f = MxqFile(path)
    w = dict(f.tensors)
    cfg = dict(f.meta["config"])
    ms = spec.ModelSpec(cfg, f.meta["arch"])
    shapes = ms.shapes(with_lm_head=True)
    for i in range(cfg["num_hidden_layers"]):
        for target, parts in ms.groups(i):
            if target in w and len(shapes[parts[0]]) == 2:
                t, r0 = w.pop(target), 0
                for p in parts:
                    w[p] = spec.row_slice(t, r0, r0 + shapes[p][0])
                    r0 += shapes[p][0]
    return f, cfg, w


@pytest.mark.parametrize("f1,f2", PAIRS)
def test_every_format_pair_quantizes_writes_loads_and_runs(tiny_src, tmp_path, monkeypatch, f1, f2):
    """gate/up of layer 0 and q/k/v of layer 1 in (f1, f2[, f1]): convert fuses what spec.fuse allows,
    the loaded model's logits equal the unfused reference (one matmul per part)."""
    import mixqrt
    from mixqrt.quantize.convert import quantize_model
    out = tmp_path / "m.mxq"
    ov = [rf"layers\.0\.mlp\.gate_proj=" + f1, rf"layers\.0\.mlp\.up_proj=" + f2,
          rf"layers\.1\.self_attn\.[qv]_proj\.weight=" + f1, rf"layers\.1\.self_attn\.k_proj\.weight=" + f2]
    quantize_model(tiny_src, "2356", out, overrides=ov, progress=False)
    m = mixqrt.load(out)
    one = f1 == f2 and f1 != "q5g"
    assert len(m.model.layers[0].gate_up) == (1 if one else 2)
    assert len(m.model.layers[1].qkv) == (1 if one else 3)
    if one:                              # stored fused: the model runs on the file's mapping, no copy
        assert m.model.layers[0].gate_up[0].raw is m.file.tensors["model.layers.0.mlp.gate_up_proj.weight"].raw
    ids = [3, 17, 42, 5, 99]
    got = m.logits(ids)
    f, cfg, w = _split_reference(out)
    monkeypatch.setattr(spec, "fuse", lambda parts: np.concatenate(parts) if isinstance(parts[0], np.ndarray) and parts[0].ndim == 1
                        else None)
    ref = build_model(cfg, w, arch=f.meta["arch"])
    assert all(len(L.gate_up) == 2 and len(L.qkv) == 3 for L in ref.layers)
    want = ref.logits(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    f.close()
    m.close()
