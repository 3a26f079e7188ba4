"""Acceptance on the real Qwen2.5-Coder-0.5B GGUF: all tensors dequantized to float32, the graph's
logits vs an independent float64 forward (tests/test_model.py::ref_forward), then a short greedy
generation that should read like code."""
import numpy as np
import pytest

from mixqrt.generation.generate import stream_generate
from mixqrt.io import open_source
from mixqrt.models import build_model

from test_model import ref_forward

PROMPT = "def quicksort(arr):"


@pytest.fixture(scope="module")
def qwen_f32(qwen_gguf_path):
    src = open_source(qwen_gguf_path)
    weights = {n: src.get(n) for n in src.tensor_names()}
    model = build_model(src.config, weights, arch=src.arch, generation_config=src.generation_config)
    return src, weights, model


def test_real_qwen_logits_match_float64_reference(qwen_f32):
    src, weights, model = qwen_f32
    ids = src.tokenizer.encode(PROMPT + "\n    if len(arr)")[:8]
    assert len(ids) == 8
    got = model.logits(ids)
    want = ref_forward(src.config, weights, ids)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"max|diff|/max|logit| = {err:.2e}")
    assert err < 1e-4
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_real_qwen_greedy_quicksort(qwen_f32):
    src, _, model = qwen_f32
    rs = list(stream_generate(model, src.tokenizer, PROMPT, max_new_tokens=8, temperature=0.0))
    text = "".join(r.text for r in rs)
    print(repr(PROMPT + text), f"{rs[-1].generation_tps:.1f} tok/s, ttft {rs[-1].ttft_s:.2f}s")
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == 8
    assert text.startswith("\n") and ("if" in text or "return" in text or "len" in text)


def test_real_qwen_engine_logprobs_equal_the_ppl_log_softmax(qwen_f32):
    """logprobs (issue 31): the engine's per-token logprobs and top_logprobs are a log-softmax of the
    model's logits for the same tokens, computed as `mixqrt ppl` does (a full forward, then
    evaluate.log_softmax), within 1e-4."""
    from mixqrt.generation.engine import Engine
    from mixqrt.commands.evaluate import log_softmax

    src, _, model = qwen_f32
    ids = src.tokenizer.encode(PROMPT)
    with Engine(model, tokenizer=src.tokenizer, max_context=64) as eng:
        out = list(eng.submit(ids, max_new_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=5,
                              eos_token_ids=[]))
    toks = [r.token for r in out]
    want = log_softmax(model.logits(ids + toks)[len(ids) - 1:-1])
    err = max(abs(r.logprobs.logprob - row[t]) for r, t, row in zip(out, toks, want))
    top_err = max(abs(v - row[i]) for r, row in zip(out, want) for i, v in r.logprobs.top)
    print(f"max |logprob - ppl log-softmax| = {err:.2e} (top-5: {top_err:.2e})")
    assert err < 1e-4 and top_err < 1e-4
    for r, row in zip(out, want):
        assert [i for i, _ in r.logprobs.top][0] == int(row.argmax())
