"""OpenAI's sampling surface in the Engine (tiny f32 model): logprobs / top_logprobs, n choices
sharing one prefill, presence/frequency penalties, logit_bias, per-request seeds under batching.
Each is checked against a teacher-forced reference (a full forward of prompt + tokens)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixqrt.generation.engine import Engine
from mixqrt.errors import RequestError
from mixqrt.commands.evaluate import log_softmax
from mixqrt.pipeline import LoadedModel
from mixqrt.generation.sampling import make_logit_bias, make_presence_frequency_penalty, token_logprobs

NO_EOS = {"eos_token_ids": [], "repetition_penalty": 1.0}   # no eos; the config's 1.05 penalty off


@pytest.fixture(scope="module")
def lm(tiny_f32_path):
    return LoadedModel(tiny_f32_path)


@pytest.fixture(scope="module")
def eng(lm):
    with Engine(lm, max_slots=8, max_context=128) as e:
        yield e


def run(eng, ids, **kw):
    out = list(eng.submit(ids, **kw))
    assert out[-1].finish_reason is not None
    return out


def by_choice(out, n):
    return [[r for r in out if r.index == i and r.token is not None] for i in range(n)]


def reference(lm, ids, steps, edit):
    """Greedy decoding by full forwards, with `edit(generated, logits)` applied to each row."""
    gen = []
    for _ in range(steps):
        row = lm.model.logits(np.asarray(ids + gen))[-1].astype(np.float64)
        gen.append(int(np.argmax(edit(gen, row))))
    return gen


# ============================================================================ logprobs
def test_logprobs_are_the_models_log_softmax(lm, eng):
    ids = lm.tokenizer.encode("def quicksort(xs):")
    out = run(eng, ids, max_new_tokens=8, temperature=1.0, seed=4, logprobs=True, top_logprobs=5,
              presence_penalty=1.0, logit_bias={7: 3.0}, eos_token_ids=[], repetition_penalty=1.3)
    toks = [r.token for r in out]
    want = log_softmax(lm.model.logits(np.asarray(ids + toks))[len(ids) - 1:-1])
    for r, row in zip(out, want):
        lp = r.logprobs
        assert lp.token == r.token and abs(lp.logprob - row[r.token]) < 1e-5     # raw: before the processors
        assert [t for t, _ in lp.top] == list(np.argsort(-row, kind="stable")[:5])
        assert np.allclose([v for _, v in lp.top], np.sort(row)[::-1][:5], atol=1e-5)
    assert all(r.logprobs is None for r in run(eng, ids, max_new_tokens=2))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=2, max_size=50), st.integers(0, 60), st.data())
def test_token_logprobs_property(row, k, data):
    x = np.asarray(row, dtype=np.float32)
    t = data.draw(st.integers(0, x.size - 1))
    lp, top = token_logprobs(x, t, k)
    ref = log_softmax(x)
    assert abs(lp - ref[t]) < 1e-9 and len(top) == min(k, x.size)
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True) and all(abs(v - ref[i]) < 1e-9 for i, v in top)


def test_masked_logits_report_openais_floor_not_minus_infinity():
    lp, top = token_logprobs(np.asarray([0.0, -np.inf, 1.0], np.float32), 1, 3)
    assert lp == -9999.0 and [t for t, _ in top] == [2, 0, 1] and top[-1][1] == -9999.0


# ============================================================================ n
def test_n_choices_share_one_prefill_and_decode_as_a_batch(lm, eng):
    ids = lm.tokenizer.encode("The quick brown fox jumps")
    before = eng.stats()
    out = run(eng, ids, max_new_tokens=6, temperature=0.0, n=4, **NO_EOS)
    after = eng.stats()
    assert after["prefill_tokens"] - before["prefill_tokens"] <= len(ids)         # one prefill for 4 choices
    assert after["max_batch"] >= 4
    ch = by_choice(out, 4)
    assert all(len(c) == 6 and c[-1].finish_reason == "length" for c in ch)
    assert len({tuple(r.token for r in c) for c in ch}) == 1                       # greedy: all equal
    single = [r.token for r in run(eng, ids, max_new_tokens=6, temperature=0.0, **NO_EOS)]
    assert [r.token for r in ch[0]] == single


def test_n_seeded_sampling(lm, eng):
    ids = lm.tokenizer.encode("for i in range(10):")
    kw = dict(max_new_tokens=8, temperature=1.5, seed=123, **NO_EOS)
    out = run(eng, ids, n=3, **kw)
    ch = [[r.token for r in c] for c in by_choice(out, 3)]
    assert ch[0] == [r.token for r in run(eng, ids, **kw)]          # choice 0 is the n=1 reply
    assert len(set(map(tuple, ch))) > 1                               # the others draw on their own
    assert ch == [[r.token for r in c] for c in by_choice(run(eng, ids, n=3, **kw), 3)]   # reproducible


def test_n_bounds(eng, lm):
    ids = lm.tokenizer.encode("x")
    for n in (0, 9, True, 2.5):
        with pytest.raises(RequestError) as e:
            eng.submit(ids, n=n)
        assert e.value.field == "n"
    with Engine(lm, max_slots=2, max_context=64) as small, pytest.raises(RequestError, match="max_slots"):
        small.submit(ids, n=3)


def test_cancelling_an_n_request_frees_every_slot(lm, eng):
    req = eng.submit(lm.tokenizer.encode("hello"), max_new_tokens=100, n=3, **NO_EOS)
    next(iter(req))
    req.cancel()
    rest = list(req)
    assert {r.index for r in rest if r.finish_reason == "cancelled"} <= {0, 1, 2}
    assert req.done
    for _ in range(400):
        if eng.stats()["running"] == 0:
            break
        threading.Event().wait(0.005)
    assert eng.stats()["running"] == 0


# ============================================================================ seed
def test_seed_is_reproducible_when_batched_with_other_requests(lm, eng):
    ids = lm.tokenizer.encode("Language models predict")
    kw = dict(max_new_tokens=10, temperature=1.2, top_p=0.95, seed=77, **NO_EOS)
    alone = [r.token for r in run(eng, ids, **kw)]
    others = [eng.submit(lm.tokenizer.encode(p), max_new_tokens=12, temperature=1.0, **NO_EOS)
              for p in ("class Model:", "hello world", "print(i)")]
    mine = eng.submit(ids, **kw)
    batched = [r.token for r in mine]
    for o in others:
        list(o)
    assert batched == alone
    assert [r.token for r in run(eng, ids, **{**kw, "seed": 78})] != alone


# ============================================================================ penalties and bias
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=20), st.integers(0, 5), st.floats(-2, 2), st.floats(-2, 2))
def test_presence_frequency_penalty_property(tokens, start, presence, frequency):
    logits = np.linspace(-1, 1, 10).astype(np.float32)
    got = make_presence_frequency_penalty(presence, frequency, start)(np.asarray(tokens), logits.copy())
    counts = np.bincount(np.asarray(tokens[start:], dtype=np.int64), minlength=10)
    want = logits - (frequency * counts + presence * (counts > 0))
    assert np.allclose(got, want, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(0, 9), st.floats(-100, 100), max_size=10))
def test_logit_bias_property(bias):
    logits = np.zeros(10, np.float32)
    got = make_logit_bias(bias, 10)(np.asarray([]), logits)
    assert np.allclose(got, [bias.get(i, 0.0) for i in range(10)], atol=1e-4)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                {"presence_penalty": -1.0, "frequency_penalty": 0.7}])
def test_penalties_in_the_engine_match_a_reference(lm, eng, kw):
    ids = lm.tokenizer.encode("print(i, i * i)")
    got = [r.token for r in run(eng, ids, max_new_tokens=10, temperature=0.0, **kw, **NO_EOS)]

    def edit(gen, row):
        c = np.bincount(np.asarray(gen, dtype=np.int64), minlength=row.size)
        return row - (kw.get("frequency_penalty", 0.0) * c + kw.get("presence_penalty", 0.0) * (c > 0))

    assert got == reference(lm, ids, 10, edit)
    assert got != [r.token for r in run(eng, ids, max_new_tokens=10, temperature=0.0, **NO_EOS)] or \
        kw.get("presence_penalty", 0) < 0


def test_logit_bias_in_the_engine(lm, eng):
    ids = lm.tokenizer.encode("hello world")
    greedy = [r.token for r in run(eng, ids, max_new_tokens=5, temperature=0.0, **NO_EOS)]
    forced = [r.token for r in run(eng, ids, max_new_tokens=5, temperature=0.0, logit_bias={"11": 100}, **NO_EOS)]
    assert forced == [11] * 5
    banned = [r.token for r in run(eng, ids, max_new_tokens=5, temperature=0.0, logit_bias={greedy[0]: -100},
                                   **NO_EOS)]
    assert greedy[0] not in banned
    assert banned == reference(lm, ids, 5, lambda g, row: row + np.where(np.arange(row.size) == greedy[0], -100, 0))
    vocab = lm.model.args.vocab_size
    for bad in ({vocab: 1}, {-1: 1}, {"x": 1}, {5: 101}, {5: float("nan")}):
        with pytest.raises(RequestError) as e:
            eng.submit(ids, logit_bias=bad)
        assert e.value.field == "logit_bias"
