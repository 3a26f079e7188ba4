"""Calibration text: the model's own sampled text, text files, and mixes of them (quantize/calibtext.py)."""
import json

import numpy as np
import pytest

from mixqrt.cli import main as cli_main
from mixqrt.quantize.convert import quantize_model
from mixqrt.errors import QuantError
from mixqrt.io import open_source
from mixqrt.io.mxq import MxqFile
from mixqrt.quantize.calibtext import (PROMPTS_V1, Generated, GeneratedSource, TextSource, calibration_set,
                                    generate_samples, generate_source, memory_model)
from tinymodel import make_tiny_hf_model

TEXT = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n" * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)


@pytest.fixture(scope="module")
def src(tiny):
    return open_source(str(tiny), progress=False)


@pytest.fixture(scope="module")
def model(src):
    return memory_model(src, "q8", progress=False)


def _ids(samples):
    return [ids.tolist() for _, _, ids in samples]


def test_generation_is_deterministic_per_seed_and_fills_the_budget(src, model):
    a = generate_samples(model, src.tokenizer, 200, 64, seed=3, progress=False)
    b = generate_samples(model, src.tokenizer, 200, 64, seed=3, progress=False)
    c = generate_samples(model, src.tokenizer, 200, 64, seed=4, progress=False)
    assert _ids(a) == _ids(b) and _ids(a) != _ids(c)
    assert sum(ids.size for _, _, ids in a) == 200
    assert all(2 <= ids.size <= 64 for _, _, ids in a)
    # sample i continues prompt i (in order, cycling), its prompt tokens first
    for k, (j, n_p, ids) in enumerate(a):
        assert j == k % len(PROMPTS_V1) and 1 <= n_p <= ids.size


def test_chat_prompts_go_through_the_chat_template(src, model):
    tok = src.tokenizer
    samples = generate_samples(model, tok, 3 * 256, 256, seed=0, progress=False)
    j, n_p, ids = samples[2]
    assert PROMPTS_V1[j][0] == "chat"
    want = tok.encode_chat([{"role": "user", "content": PROMPTS_V1[j][1]}], add_generation_prompt=True)
    assert ids[:n_p].tolist() == list(want) and n_p < ids.size
    assert "<|im_start|>assistant" in tok.decode(ids[:n_p].tolist())


def test_a_shorter_budget_is_a_prefix_of_a_longer_one(src):
    """Generated.take(n) == generating n tokens afresh: one generation serves several quantizations."""
    big = generate_source(src, GeneratedSource(seed=1), 300, 64, progress=False)
    for n in (2, 50, 64, 65, 150, 300):
        fresh = generate_source(src, GeneratedSource(seed=1), n, 64, progress=False)
        assert _same(fresh.take(n), big.take(n)), n


def _same(x, y):
    (cx, rx), (cy, ry) = x, y
    return rx == ry and [c.tolist() for c in cx] == [c.tolist() for c in cy]


def test_mixed_sources_share_the_budget_and_are_recorded(src, tmp_path):
    chunks, rec = calibration_set(src, [GeneratedSource(seed=0, save=str(tmp_path / "self.txt")),
                                        TextSource(TEXT, "qs.txt")], 201, 64, progress=False)
    assert rec["text"] == "self + qs.txt" and rec["tokens"] == 201 == sum(c.size for c in chunks)
    (gen, txt) = rec["sources"]
    assert (gen["text"], gen["tokens"], txt["text"], txt["tokens"]) == ("self", 101, "qs.txt", 100)
    g = gen["generated"]
    assert g["seed"] == 0 and g["temperature"] == 0.9 and g["prompts"][0] == list(PROMPTS_V1[0])
    assert sum(n for _, _, n in g["samples"]) == 101 and len(g["ids_sha256"]) == 64
    assert "sample 0 (prompt 0" in (tmp_path / "self.txt").read_text(encoding="utf-8")
    json.dumps(rec)     # goes into the JSON header as is
    # a plain text keeps today's record (no "sources")
    _, rec1 = calibration_set(src, TEXT, 100, 64, progress=False)
    assert rec1 == {"text": "text", "tokens": 100}


def test_bad_calibration_arguments_raise(src):
    for bad in ([], [3], None):
        with pytest.raises(QuantError, match="calibrate wants"):
            calibration_set(src, bad, 100, 64, progress=False)
    with pytest.raises(QuantError, match="tokens >= 2"):
        calibration_set(src, GeneratedSource(), 1, 64, progress=False)


def test_cli_calibrate_self_mixed_with_a_file(tiny, tmp_path, capsys):
    text = tmp_path / "qs.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "m.mxq"
    cli_main(["quantize", str(tiny), "--calibrate", "self", "--calibrate", str(text), "--calib-tokens", "160",
              "--calib-seed", "5", "--calib-save", str(tmp_path / "s.txt"), "-q", "-o", str(out)])
    rec = MxqFile(str(out)).meta["recipe"]["calibration"]
    assert rec["method"] == "gptq" and rec["text"] == "self + qs.txt" and rec["tokens"] == 160
    assert rec["sources"][0]["generated"]["seed"] == 5 and (tmp_path / "s.txt").exists()
    with pytest.raises(SystemExit, match="calib-save"):
        cli_main(["quantize", str(tiny), "--calibrate", str(text), "--calib-save", str(tmp_path / "x.txt"),
                  "-q", "-o", str(tmp_path / "x.mxq")])


def test_quantize_model_accepts_stored_samples(tiny, src, tmp_path):
    gen = generate_source(src, GeneratedSource(seed=2), 128, 64, progress=False)
    assert isinstance(gen, Generated)
    a = quantize_model(str(tiny), "2356", tmp_path / "a.mxq", progress=False, calibrate=[gen],
                       calib_tokens=128, calib_ctx=64)
    b = quantize_model(str(tiny), "2356", tmp_path / "b.mxq", progress=False, calibrate=[GeneratedSource(seed=2)],
                       calib_tokens=128, calib_ctx=64)
    assert a.calibration == b.calibration
    fa, fb = MxqFile(str(tmp_path / "a.mxq")), MxqFile(str(tmp_path / "b.mxq"))
    for name, qt in fa.tensors.items():
        assert np.array_equal(qt.raw, fb.tensors[name].raw), name
