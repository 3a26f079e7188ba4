"""The real models (mixqrt.testing) through the product path: quantize with 2356, load the .mxq, generate."""
import re

import pytest

import mixqrt
from mixqrt.quantize.convert import quantize_model


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


def test_qwen_2356_engine_batched_and_cached_match_single(qwen_2356):
    """The engine on the real model: 4 requests decoded in one batch and a second chat turn served
    from the prompt cache give the single-sequence greedy tokens. 2356 quantizes activations to
    int8, so a last-bit difference (another batch, another chunk) can move one rounding step:
    every token must be the argmax of a teacher-forced recompute up to 0.05 (real margins are
    larger almost everywhere; exact agreement is counted, not required)."""
    import numpy as np

    from mixqrt.generation.engine import Engine
    from mixqrt.generation.generate import stream_generate

    out, _ = qwen_2356
    pipe = mixqrt.Pipeline(out, progress=False)
    tok, model = pipe.tokenizer, pipe.model

    def ids(content, history=()):
        msgs = list(history) + [{"role": "user", "content": content}]
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))

    def check(prompt, got):
        logits = model.logits(np.asarray(prompt + got))[len(prompt) - 1:-1]
        for t, row in zip(got, logits):
            assert row[t] >= row.max() - 0.05

    prompts = [ids(q) for q in ("Write quicksort in Python.", "What is a hash map?", "Explain TCP briefly.",
                                "Reverse a string in C.")]
    kw = dict(max_new_tokens=12, temperature=0.0, eos_token_ids=[])
    with Engine(pipe, max_slots=4, prefill_chunk=64) as eng:
        reqs = [eng.submit(p, **kw) for p in prompts]
        got = [[r.token for r in q] for q in reqs]
        assert eng.stats()["max_batch"] == 4
        same = 0
        for p, g in zip(prompts, got):
            check(p, g)
            same += g == [r.token for r in stream_generate(model, tok, p, **kw)]
        assert same >= 3
        # a second turn reuses the first turn's KV
        first = [r for r in eng.submit(prompts[0], max_new_tokens=16, temperature=0.0)]
        answer = "".join(r.text for r in first)
        hist = [{"role": "user", "content": "Write quicksort in Python."}, {"role": "assistant", "content": answer}]
        turn2 = ids("Now in Go.", hist)
        second = list(eng.submit(turn2, **kw))
    assert second[-1].cached_tokens >= len(prompts[0]) and second[-1].prompt_tokens == len(turn2)
    check(turn2, [r.token for r in second])


def test_qwen_2356_fused_decode_is_bit_identical(qwen_2356, monkeypatch):
    """The real 2356 model (q2c embedding, rotated interleaved FFN, q6x attention, q5g norms) decodes
    the same logits through the fused layers as op by op, at the default thread count."""
    import numpy as np

    from mixqrt import ops
    out, _ = qwen_2356
    model = mixqrt.load(out).model
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(ops, "FUSED_DECODE", fused)
        cache = model.make_cache(64)
        logits = [model(np.arange(1000, 1024), cache, last_only=True)]
        for _ in range(8):
            logits.append(model(np.array([int(np.argmax(logits[-1]))]), cache, last_only=True))
        runs.append(np.stack(logits))
    assert model.fused_layers() is not None
    np.testing.assert_array_equal(runs[0], runs[1])
