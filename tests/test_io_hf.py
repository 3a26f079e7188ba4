"""HF folder sources: the tiny model loads exactly; every malformed file gets a typed, named error."""
import json
import struct

import numpy as np
import pytest
from tinymodel import HIDDEN, VOCAB, make_tiny_hf_model, tiny_weights, write_safetensors

from mixqrt.errors import FormatError, ModelError
from mixqrt.io import open_source
from mixqrt.io.hf import HFSource, SafetensorsFile


def _bf16_round(a):
    u = a.astype(np.float32).view(np.uint32)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_tiny_model_roundtrip(tmp_path, arch, dtype):
    d = make_tiny_hf_model(tmp_path / "m", arch=arch, dtype=dtype)
    ref = tiny_weights(arch)
    with open_source(d) as src:
        assert src.arch == arch
        assert src.config["hidden_size"] == HIDDEN and src.config["vocab_size"] == VOCAB
        assert set(src.tensor_names()) == set(ref)
        assert "lm_head.weight" not in src
        assert src.tensor_info("model.layers.0.mlp.down_proj.weight") == ((HIDDEN, 128), dtype.upper())
        for name, want in ref.items():
            got = src.get(name)
            assert got.dtype == np.float32 and got.shape == want.shape
            if dtype == "f32":
                np.testing.assert_array_equal(got, want)
            elif dtype == "bf16":
                np.testing.assert_array_equal(got, _bf16_round(want))
            else:
                np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
        assert ("model.layers.0.self_attn.q_proj.bias" in src) == (arch == "qwen2")
        assert src.generation_config["top_k"] == 20
        assert src.tokenizer.eos_token_ids == {0, 2}


def test_untied_and_sharded(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m", tied=False, sharded=True)
    assert not (d / "model.safetensors").exists()
    with open_source(d) as src:
        assert src.config["tie_word_embeddings"] is False
        assert src.tensor_info("lm_head.weight")[0] == (VOCAB, HIDDEN)
        np.testing.assert_array_equal(src.get("lm_head.weight"),
                                      _bf16_round(tiny_weights(tied=False)["lm_head.weight"]))


def test_open_by_config_or_weights_file(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    for p in (d / "config.json", d / "model.safetensors", str(d)):
        with open_source(p) as src:
            assert isinstance(src, HFSource)


def test_bf16_is_exact_bit_shift(tmp_path):
    bits = np.array([0x3F80, 0xBF80, 0x7F7F, 0x0001, 0x4049], dtype="<u2")   # 1, -1, max, tiny, ~3.14
    h = json.dumps({"x": {"dtype": "BF16", "shape": [5], "data_offsets": [0, 10]}}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + bits.tobytes())
    sf = SafetensorsFile(p)
    got = sf.read("x")
    sf.close()
    np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


# -- malformed safetensors, each from hand-made bytes ------------------------------------------

def _raw(tmp_path, header, data=b"", length=None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return p


def _short(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x01\x02")
    return p


BAD_FILES = {
    "short": (lambda t: _short(t), "truncated"),
    "huge header": (lambda t: _raw(t, b"{}", length=1 << 40), "limit"),
    "header past end": (lambda t: _raw(t, b"{}", length=100), "truncated"),
    "not json": (lambda t: _raw(t, b"{nope"), "JSON"),
    "not object": (lambda t: _raw(t, b"[1, 2]"), "object"),
    "bad dtype": (lambda t: _raw(t, {"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "'w'"),
    "negative dim": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
                     "shape"),
    "span != shape x dtype": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
                                            b"\0" * 20), "'w'"),
    "offsets past end": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                                       b"\0" * 8), "past the end"),
    "gap": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gap"),
    "overlap": (lambda t: _raw(t, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
                "overlaps"),
    "trailing bytes": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12),
                       "cover"),
    "reversed offsets": (lambda t: _raw(t, {"w": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4),
                         "data_offsets"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_safetensors(tmp_path, case):
    make, words = BAD_FILES[case]
    p = make(tmp_path)
    with pytest.raises(FormatError, match=words) as e:
        SafetensorsFile(p)
    assert "bad.safetensors" in str(e.value)


def test_truncated_model_file(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m", dtype="f32")
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(FormatError, match="model.safetensors"):
        open_source(d)


def _rewrite(d, mutate, dtype="BF16"):
    w = tiny_weights()
    mutate(w)
    write_safetensors(d / "model.safetensors", w, dtype)


def test_missing_tensor(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    _rewrite(d, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        open_source(d)


def test_shape_disagrees_with_config(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    _rewrite(d, lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((HIDDEN, HIDDEN))}))
    with pytest.raises(ModelError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\)"):
        open_source(d)


def test_nan_found_on_get(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")

    def poison(w):
        w["model.layers.0.mlp.gate_proj.weight"][3, 5] = np.nan
        w["model.norm.weight"][0] = np.inf
    _rewrite(d, poison)
    with open_source(d) as src:
        src.get("model.layers.0.mlp.up_proj.weight")            # clean tensors still load
        with pytest.raises(FormatError, match="'model.layers.0.mlp.gate_proj.weight' holds 1 NaN"):
            src.get("model.layers.0.mlp.gate_proj.weight")
        with pytest.raises(FormatError, match="model.norm.weight"):
            src.get("model.norm.weight")


def test_unknown_architecture(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unknown architecture mamba"):
        open_source(d)


def test_bad_config_value(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="num_key_value_heads"):
        open_source(d)


def test_sharded_index_lies(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m", sharded=True)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(n for n, f in idx["weight_map"].items() if f.startswith("model-00001"))
    idx["weight_map"][name] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match=name.replace(".", r"\.")):
        open_source(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        open_source(d)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_refused(tmp_path, name):
    d = make_tiny_hf_model(tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / name).write_bytes(b"\x80\x04K\x01.")                  # a valid pickle: must never be loaded
    with pytest.raises(FormatError, match="pickle"):
        open_source(d)
    with pytest.raises(FormatError, match="pickle"):
        open_source(d / name)


def test_not_a_model(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        open_source(tmp_path)
    with pytest.raises(ModelError, match="no such file"):
        open_source(tmp_path / "nope.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FormatError, match="notes.txt"):
        open_source(tmp_path / "notes.txt")
