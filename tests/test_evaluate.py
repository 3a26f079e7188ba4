"""Perplexity exactly as llama-perplexity scores it, and the KL machinery."""
import math

import numpy as np
import pytest

from mixqrt.errors import FormatError, GenerationError
from mixqrt.commands.evaluate import log_softmax, perplexity


def _fake_model(vocab=11, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    return lambda ids: table[np.asarray(ids)]          # logits of position j depend on token j


def test_scores_second_half_of_each_chunk_like_llama_perplexity():
    fn = _fake_model()
    toks = np.random.default_rng(1).integers(0, 11, size=100)
    ctx = 16
    r = perplexity(fn, toks, ctx=ctx, progress=False)
    nll, n = 0.0, 0
    for c in range(100 // ctx):                       # 6 full chunks; the tail is dropped
        chunk = toks[c * ctx:(c + 1) * ctx]
        lp = log_softmax(fn(chunk))
        for j in range(ctx // 2, ctx - 1):            # positions first .. ctx-2 predict the next token
            nll -= lp[j, chunk[j + 1]]
            n += 1
    assert r.tokens == n == 6 * (ctx // 2 - 1) and r.chunks == 6
    assert r.ppl == pytest.approx(math.exp(nll / n), rel=1e-12)
    assert r.ppl_err > 0


def test_chunks_limit_bos_and_errors():
    fn = _fake_model()
    toks = np.arange(64) % 11
    seen = []
    r = perplexity(lambda ids: (seen.append(ids[0]), fn(ids))[1], toks, ctx=16, chunks=2, bos_id=7, progress=False)
    assert r.chunks == 2 and seen == [7, 7]
    with pytest.raises(GenerationError):
        perplexity(fn, toks[:10], ctx=16, progress=False)
    with pytest.raises(GenerationError):
        perplexity(fn, toks, ctx=15, progress=False)


def test_kl_against_saved_base(tmp_path):
    toks = np.random.default_rng(2).integers(0, 11, size=80)
    base = tmp_path / "base.logits"
    r0 = perplexity(_fake_model(seed=0), toks, ctx=16, save_logits=str(base), progress=False)
    same = perplexity(_fake_model(seed=0), toks, ctx=16, kl_base=str(base), progress=False)
    assert same.kld_mean == pytest.approx(0.0, abs=1e-3) and same.same_top_pct == 100.0
    other = perplexity(_fake_model(seed=3), toks, ctx=16, kl_base=str(base), progress=False)
    assert other.kld_mean > 0.1 and other.kld_p99 >= other.kld_mean
    assert r0.to_dict()["ppl"] == r0.ppl
    # a base with fewer positions than this run needs, and a file that is not ours
    with pytest.raises(FormatError):
        perplexity(_fake_model(), np.concatenate([toks, toks]), ctx=16, kl_base=str(base), progress=False)
    bad = tmp_path / "bad.logits"
    bad.write_bytes(b"garbage" * 10)
    with pytest.raises(FormatError):
        perplexity(_fake_model(), toks, ctx=16, kl_base=str(bad), progress=False)
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob(".*.tmp"))


def test_ppl_encodes_the_text_as_text_unless_asked(tmp_path, monkeypatch, capsys):
    """`mixqrt ppl` reads special-token text in the evaluation file as text, as llama-perplexity
    does (WikiText's "<unk>" is five characters, not Gemma's unknown token); --parse-special reads
    it as the tokens (issue 39, item 7)."""
    import json

    from mixqrt.cli import main
    from mixqrt.testing.tiny import make_tiny_hf_model
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    hf = make_tiny_hf_model(tmp_path / "hf")
    text = tmp_path / "t.txt"
    text.write_text("<|endoftext|>" * 64)
    out = {}
    for flag in ([], ["--parse-special"]):
        main(["ppl", str(hf), "--recipe", "f32", "--text", str(text), "--ctx", "16", "--json", "-q", "--offline", *flag])
        out[bool(flag)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out[True]["chunks"] == 4                      # 64 special tokens: 4 chunks of 16
    assert out[False]["chunks"] > 4 * 4                  # the text: several tokens per "<|endoftext|>"
