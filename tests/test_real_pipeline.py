"""The real models from fetch.sh through the product path: quantize with 2356, load the .mxq, generate."""
import re

import pytest

import mixqrt
from mixqrt.convert import quantize_model


@pytest.fixture(scope="module")
def qwen_2356(qwen_gguf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "qwen-2356.mxq"
    rep = quantize_model(str(qwen_gguf_path), "2356", out, progress=False)
    return out, rep


def test_qwen_2356_size_and_bits(qwen_2356):
    out, rep = qwen_2356
    by = rep.by_role()
    assert by["embed"]["formats"] == ["q2c"] and by["ffn_down"]["formats"] == ["q3p"]
    assert by["attn_q"]["formats"] == ["q6"] and by["norm"]["formats"] == ["q5g"]
    # llama.cpp's Q2_K file of this model is 415,182,720 bytes; 2356 must not be larger
    assert out.stat().st_size < 415_182_720
    assert 3.0 < rep.bits_per_weight < 5.0
    assert rep.peak_rss_bytes > 0


def test_qwen_2356_generates_plausible_code(qwen_2356):
    out, _ = qwen_2356
    pipe = mixqrt.Pipeline(out, progress=False)
    text = pipe("def quicksort(arr):", max_new_tokens=40, do_sample=False)[0]["generated_text"]
    print(text)
    body = text[len("def quicksort(arr):"):]
    assert re.search(r"\b(if|return|for|pivot|len)\b", body), text
    assert "arr" in body


def test_qwen_2356_chat_template_and_stream(qwen_2356):
    out, _ = qwen_2356
    pipe = mixqrt.Pipeline(out, progress=False)
    msgs = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
    pieces = list(pipe.stream(msgs, max_new_tokens=12, do_sample=False))
    text = "".join(p.text for p in pieces)
    assert "<|im_end|>" not in text and "<|im_start|>" not in text
    assert pieces[-1].finish_reason in ("stop", "length") and pieces[0].ttft_s > 0
    assert "4" in text, text


def test_smollm_llama_arch_generates(smol_gguf_path, tmp_path):
    out = tmp_path / "smol.mxq"
    quantize_model(str(smol_gguf_path), "2356", out, progress=False)
    pipe = mixqrt.Pipeline(out, progress=False)
    text = pipe("The capital of France is", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    print(text)
    assert len(text) > len("The capital of France is")
