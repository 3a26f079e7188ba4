"""GGUF sources: real files load with the right config; tiny conversions round-trip exactly
(names, llama q/k un-permute); malformed files get a typed error naming the file/tensor."""
import struct

import numpy as np
import pytest
from tinymodel import HEADS, KV_HEADS, make_tiny_gguf, make_tiny_hf_model, tiny_weights

from mixqrt.errors import FormatError, ModelError
from mixqrt.io import open_source
from mixqrt.io.gguf import GGUFSource, permute_qk, unpermute_qk


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    with open_source(qwen_gguf_path) as src:
        yield src


@pytest.fixture(scope="module")
def smol(smol_gguf_path):
    with open_source(smol_gguf_path) as src:
        yield src


# -- real models -----------------------------------------------------------------------------

@pytest.mark.realmodel
def test_qwen_config(qwen):
    c = qwen.config
    assert qwen.arch == "qwen2"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (896, 4864, 24)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (14, 2, 64)
    assert c["vocab_size"] == 151936 and c["max_position_embeddings"] == 32768
    assert c["rope_theta"] == 1e6 and c["rms_norm_eps"] == pytest.approx(1e-6)
    assert c["tie_word_embeddings"] is False                    # this file carries output.weight
    assert qwen.tensor_info("model.layers.0.self_attn.k_proj.weight") == ((128, 896), "Q5_0")
    assert qwen.tensor_info("model.layers.0.self_attn.q_proj.bias") == ((896,), "F32")
    assert qwen.tensor_info("lm_head.weight")[0] == (151936, 896)
    assert len(qwen.tensor_names()) == 291 and not qwen.unmapped
    assert set(qwen.generation_config["eos_token_id"]) == {151643, 151645}


@pytest.mark.realmodel
def test_qwen_tensors(qwen):
    for name, std in [("model.layers.0.self_attn.q_proj.weight", (0.01, 0.5)),
                      ("model.layers.23.mlp.down_proj.weight", (0.005, 0.5)),     # Q6_K
                      ("model.layers.5.mlp.gate_proj.weight", (0.005, 0.5)),      # Q4_K or Q5_0
                      ("model.layers.0.self_attn.k_proj.bias", (0.01, 100))]:
        w = qwen.get(name)
        assert w.dtype == np.float32 and w.shape == qwen.tensor_info(name)[0]
        assert np.isfinite(w).all() and std[0] < w.std() < std[1], name



@pytest.mark.realmodel
def test_gemma3_opens(gemma_gguf_path):
    """The real Gemma 3 270M GGUF (Q4_K_M): its config from the metadata, its tensors under the HF
    text model's names (norms back to HF's weight: the file holds 1 + it), its SentencePiece
    vocabulary as llama.cpp tokenizes it."""
    with open_source(gemma_gguf_path) as src:
        c = src.config
        assert src.arch == "gemma3" and (c["hidden_size"], c["num_hidden_layers"], c["head_dim"]) == (640, 18, 256)
        assert (c["sliding_window"], c["sliding_window_pattern"], c["query_pre_attn_scalar"]) == (512, 6, 256)
        assert c["vocab_size"] == 262144 and c["tie_word_embeddings"] and not src.unmapped
        n = src.get("model.layers.0.post_feedforward_layernorm.weight")
        assert n.shape == (640,) and np.isfinite(n).all()
        tok = src.tokenizer
        assert tok.encode("Hello world") == [9259, 1902] and tok.bos_token_id == 2 and tok.add_bos_token
        assert tok.decode(tok.encode("naïve café  😀")) == "naïve café  😀"


@pytest.mark.realmodel
def test_smol_config(smol):
    c = smol.config
    assert smol.arch == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (9, 3)
    assert c["vocab_size"] == 49152 and c["rope_theta"] == 1e5 and c["max_position_embeddings"] == 8192
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in smol
    q = smol.get("model.layers.0.self_attn.q_proj.weight")
    k = smol.get("model.layers.0.self_attn.k_proj.weight")
    assert q.shape == (576, 576) and k.shape == (192, 576) and np.isfinite(q).all()
    # q/k come back un-permuted (HF rotate-half order); other tensors are the plain dequantization
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    for name, n_head, perm in (("model.layers.0.self_attn.k_proj.weight", 3, True),
                               ("model.layers.0.self_attn.q_proj.weight", 9, True),
                               ("model.layers.0.self_attn.v_proj.weight", 3, False)):
        raw, qtype = smol.raw(name)
        deq = dequantize(raw.reshape(smol.tensor_info(name)[0][0], -1), GGMLQuantizationType[qtype])
        want = unpermute_qk(deq, n_head) if perm else deq
        np.testing.assert_array_equal(smol.get(name), want)


# -- tiny conversions: exact round trips -----------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_gguf_matches_hf(tmp_path, arch):
    d = make_tiny_hf_model(tmp_path / "hf", arch=arch, dtype="f32", tied=(arch == "qwen2"))
    g = make_tiny_gguf(d, tmp_path / "m.gguf", "F32")
    with open_source(d) as hf, open_source(g) as gg:
        assert isinstance(gg, GGUFSource) and gg.arch == arch
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
            assert gg.config[k] == hf.config[k], k
        assert gg.config["rope_theta"] == hf.config["rope_theta"]
        assert gg.config["rms_norm_eps"] == pytest.approx(hf.config["rms_norm_eps"])
        assert set(gg.tensor_names()) == set(hf.tensor_names())
        for name in hf.tensor_names():               # llama q/k come back un-permuted, bit for bit
            np.testing.assert_array_equal(gg.get(name), hf.get(name), err_msg=name)


def test_tiny_gguf_quantized(tmp_path):
    d = make_tiny_hf_model(tmp_path / "hf", arch="llama", dtype="f32")
    ref = tiny_weights("llama")
    for qtype, tol in (("F16", 1e-3), ("Q8_0", 2e-2)):
        with open_source(make_tiny_gguf(d, tmp_path / f"{qtype}.gguf", qtype)) as src:
            name = "model.layers.1.self_attn.q_proj.weight"
            assert src.tensor_info(name)[1] == qtype
            w = src.get(name)
            assert np.abs(w - ref[name]).max() < tol * np.abs(ref[name]).max()


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((KV_HEADS * 16, 8)).astype(np.float32)
    p = permute_qk(w, KV_HEADS)
    np.testing.assert_array_equal(unpermute_qk(p, KV_HEADS), w)
    # llama.cpp rotates adjacent pairs (2i, 2i+1) of the permuted rows; HF rotates (i, i + d/2)
    np.testing.assert_array_equal(p[0::2][:8], w[:8])
    np.testing.assert_array_equal(p[1::2][:8], w[8:16])
    b = rng.standard_normal(HEADS * 16)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, HEADS), HEADS), b)


# -- malformed files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    t = tmp_path_factory.mktemp("gguf")
    return make_tiny_gguf(make_tiny_hf_model(t / "hf", arch="llama", dtype="f32"), t / "good.gguf", "Q8_0")


def test_truncated_anywhere(tmp_path, good_gguf):
    data = good_gguf.read_bytes()
    cuts = sorted({0, 3, 4, 8, 20, 24, 60, 200, 1000, 4000, len(data) // 2, len(data) - 1000, len(data) - 1})
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(FormatError, match=f"cut{cut}.gguf"):
            GGUFSource(p)


def _gguf(kvs=(), tensors=(), data=b"", version=3, magic=b"GGUF", align=32):
    """Hand-built GGUF bytes: kvs [(key, type, packed value bytes)], tensors [(name, dims, type, off)]."""
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = magic + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, raw in kvs:
        out += s(key) + struct.pack("<I", vtype) + raw
    for name, dims, ttype, off in tensors:
        out += s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, off)
    out += b"\0" * (-len(out) % align)
    return out + data


def _str(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


LLAMA_KVS = [("general.architecture", 8, _str("llama"))]


@pytest.mark.parametrize("case,blob,words", [
    ("magic", _gguf(magic=b"GGML"), "not a GGUF"),
    ("version1", _gguf(version=1), "version 1"),
    ("bigendian", _gguf(version=3 << 24), "big-endian"),
    ("past-end", _gguf(LLAMA_KVS, [("blk.0.attn_norm.weight", [64], 0, 0)], b"\0" * 100), "blk.0.attn_norm.weight"),
    ("offset", _gguf(LLAMA_KVS, [("w", [8], 0, 1 << 40)], b"\0" * 32), "'w' spans"),
    ("ggml-type", _gguf(LLAMA_KVS, [("w", [8], 99, 0)], b"\0" * 32), "unknown ggml type 99"),
    ("block", _gguf(LLAMA_KVS, [("w", [33, 2], 8, 0)], b"\0" * 128), "Q8_0 blocks"),
    ("rank", _gguf(LLAMA_KVS, [("w", [1] * 5, 0, 0)], b"\0" * 32), "rank 5"),
    ("value-type", _gguf([("x", 77, b"")]), "unknown value type 77"),
    ("huge-count", _gguf()[:8] + struct.pack("<QQ", 1 << 60, 0), "truncated"),
    ("huge-string", _gguf([("x", 8, struct.pack("<Q", 1 << 50))]), "x"),
])
def test_bad_gguf_bytes(tmp_path, case, blob, words):
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(blob)
    with pytest.raises(FormatError, match=words) as e:
        GGUFSource(p)
    assert p.name in str(e.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(FormatError, match="empty"):
        open_source(p)


def test_unknown_architecture(tmp_path):
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    with pytest.raises(ModelError, match="unknown architecture mamba"):
        GGUFSource(make_tiny_gguf(d, tmp_path / "m.gguf", arch="mamba"))


def test_missing_and_misshaped_tensor(tmp_path):
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    p = make_tiny_gguf(d, tmp_path / "a.gguf", edit=lambda w: w.pop("model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(ModelError, match="missing tensor 'model.layers.1.self_attn.v_proj.bias'"):
        GGUFSource(p)
    p = make_tiny_gguf(d, tmp_path / "b.gguf",
                       edit=lambda w: w.update({"model.layers.0.mlp.up_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(ModelError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(64, 64\)"):
        GGUFSource(p)


def test_nan_weight(tmp_path):
    d = make_tiny_hf_model(tmp_path / "hf", dtype="f32")

    def poison(w):
        w["model.layers.1.mlp.down_proj.weight"][0, 0] = np.nan
    with GGUFSource(make_tiny_gguf(d, tmp_path / "nan.gguf", edit=poison)) as src:
        src.get("model.layers.0.mlp.down_proj.weight")
        with pytest.raises(FormatError, match="'model.layers.1.mlp.down_proj.weight' holds 1 NaN"):
            src.get("model.layers.1.mlp.down_proj.weight")
