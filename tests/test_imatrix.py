"""Importance matrix: collection through the model's forward, the JSON file, and its use by the
streaming quantizer (tiny random model)."""
import json

import numpy as np
import pytest

import mixqrt
from mixqrt.cli import main as cli_main
from mixqrt.quantize.convert import quantize_model
from mixqrt.errors import QuantError
from mixqrt.quantize.imatrix import collect, importance_for, load_imatrix, save

from tinymodel import make_tiny_hf_model

TEXT = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n" * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))


def test_collect_matches_a_manual_forward(tiny, tmp_path):
    doc = collect(mixqrt.load(str(tiny), "f32", progress=False), TEXT, chunks=2, ctx=16, progress=False)
    assert doc["format"] == "mixqrt-imatrix" and doc["chunks"] == 2 and doc["tokens"] == 32
    t = doc["tensors"]
    cfg = json.loads((tiny / "config.json").read_text())
    L, D, inter = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    names = {f"model.layers.{i}.{s}.weight" for i in range(L) for s in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | {"lm_head.weight"}
    assert set(t) == names
    assert len(t["model.layers.0.mlp.down_proj.weight"]["values"]) == inter
    assert len(t["model.layers.0.self_attn.q_proj.weight"]["values"]) == D
    # q/k/v (and gate/up) see the same input
    assert t["model.layers.1.self_attn.q_proj.weight"] == t["model.layers.1.self_attn.v_proj.weight"]
    # layer 0's attention input is rmsnorm(embedding) * input_layernorm: recompute it by hand
    m = mixqrt.load(str(tiny), "f32", progress=False)
    toks = m.tokenizer.encode(TEXT, add_special_tokens=False)[:32]
    from mixqrt import ops
    x = ops.embed(m.model.embed_tokens, np.asarray(toks))
    h = ops.rmsnorm(x, m.model.layers[0].input_norm, m.model.args.rms_norm_eps)
    want = (h.astype(np.float64) ** 2).mean(0)
    np.testing.assert_allclose(t["model.layers.0.self_attn.q_proj.weight"]["values"], want, rtol=1e-5)
    # the matmul hook is removed afterwards
    assert ops.matmul.__name__ == "matmul" and ops.matmul.__module__ != "mixqrt.quantize.imatrix"


def test_file_round_trip_and_validation(tiny, tmp_path):
    doc = collect(mixqrt.load(str(tiny), "f32", progress=False), TEXT, chunks=1, ctx=16, progress=False)
    save(doc, tmp_path / "im.json")
    im = load_imatrix(tmp_path / "im.json")
    assert all(v.dtype == np.float32 for v in im.values())
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(QuantError, match="not a mixqrt imatrix"):
        load_imatrix(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text(json.dumps({"format": "mixqrt-imatrix", "tensors": {"a": {"values": [1, -1]}}}))
    with pytest.raises(QuantError, match="finite"):
        load_imatrix(tmp_path / "nan.json")
    with pytest.raises(QuantError, match="columns"):
        importance_for({"x": np.ones(3, np.float32)}, "x", 4)
    assert importance_for({}, "x", 4) is None


def test_quantize_model_with_imatrix_changes_only_covered_search_formats(tiny, tmp_path):
    doc = collect(mixqrt.load(str(tiny), "f32", progress=False), TEXT, chunks=2, ctx=16, progress=False)
    save(doc, tmp_path / "im.json")
    a = quantize_model(str(tiny), "2356-norot", tmp_path / "a.mxq", progress=False)
    b = quantize_model(str(tiny), "2356-norot", tmp_path / "b.mxq", progress=False, imatrix=tmp_path / "im.json")
    assert a.total_bytes == b.total_bytes                       # same layouts
    fa, fb = mixqrt.io.mxq.MxqFile(tmp_path / "a.mxq"), mixqrt.io.mxq.MxqFile(tmp_path / "b.mxq")
    same_embed = fa.tensors["model.embed_tokens.weight"].raw.tobytes() == fb.tensors["model.embed_tokens.weight"].raw.tobytes()
    assert same_embed                                           # q2c lookup table: no imatrix
    assert fa.tensors["model.layers.0.mlp.down_proj.weight"].raw.tobytes() != \
        fb.tensors["model.layers.0.mlp.down_proj.weight"].raw.tobytes()
    m = mixqrt.load(tmp_path / "b.mxq")
    assert np.isfinite(m.logits(m.tokenizer.encode("def f(x):"))).all()
    fa.close(), fb.close(), m.close()


def test_cli_imatrix_and_quantize(tiny, tmp_path, capsys):
    (tmp_path / "calib.txt").write_text(TEXT)
    assert cli_main(["imatrix", str(tiny), "--recipe", "f32", "--text", str(tmp_path / "calib.txt"), "--chunks", "1",
                     "--ctx", "16", "-o", str(tmp_path / "im.json"), "-q"]) == 0
    assert cli_main(["quantize", str(tiny), "--recipe", "2356", "--imatrix", str(tmp_path / "im.json"),
                     "-o", str(tmp_path / "m.mxq"), "-q"]) == 0
    assert (tmp_path / "m.mxq").exists()


def test_imatrix_skips_rotated_tensors_and_says_so(tiny, tmp_path):
    """The importance is per input column, which a rotation mixes: rotated tensors (the 2356 default's
    FFN) quantize as without it, and the user is warned."""
    doc = collect(mixqrt.load(str(tiny), "f32", progress=False), TEXT, chunks=2, ctx=16, progress=False)
    save(doc, tmp_path / "im.json")
    a = quantize_model(str(tiny), "2356", tmp_path / "a.mxq", progress=False)
    with pytest.warns(UserWarning, match="rotated"):
        quantize_model(str(tiny), "2356", tmp_path / "b.mxq", progress=False, imatrix=tmp_path / "im.json")
    with mixqrt.io.mxq.MxqFile(tmp_path / "a.mxq") as fa, mixqrt.io.mxq.MxqFile(tmp_path / "b.mxq") as fb:
        n = "model.layers.0.mlp.down_proj.weight"
        assert fa.info[n].rot and fa.tensors[n].raw.tobytes() == fb.tensors[n].raw.tobytes()
