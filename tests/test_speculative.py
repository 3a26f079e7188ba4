"""Speculative decoding (mixqrt.generation.speculative, Engine._step_speculative) on the tiny model.

With f32 weights, and with packed weights (the kernels give every row of a multi-row product as the
single-row product, tests/test_rows_exact.py), a forward of k+1 rows gives the logits of k+1 single
steps bit for bit, so the output with prompt lookup or a draft model must be the plain output token
for token, greedy and seeded sampling alike. The acceptance walk's distribution is checked on its own with a
chi-square test; drafters against brute-force references.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixqrt.generation.engine import Engine
from mixqrt.errors import GenerationError, ModelError
from mixqrt.pipeline import LoadedModel
from mixqrt.quantize.convert import quantize_model
from mixqrt.generation.speculative import MAX_DRAFT, ModelDrafter, NgramDrafter, check_compatible, make_drafter
from tinymodel import make_tiny_hf_model

NO_EOS = {"eos_token_ids": []}
# a prompt that repeats itself, so that prompt lookup finds drafts
REPEAT = "def quicksort(xs):\n    return xs\ndef quicksort(xs):\n    return xs\ndef quicksort("


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("spec")
    out = {}
    for name, seed in (("target", 0), ("other", 1)):
        hf = make_tiny_hf_model(base / name, arch="qwen2", tied=True, seed=seed)
        mxq = base / f"{name}.mxq"
        quantize_model(str(hf), "f32", mxq, progress=False)
        out[name] = LoadedModel(mxq)
    hf = make_tiny_hf_model(base / "packed", arch="qwen2", tied=True, seed=0)
    quantize_model(str(hf), "2356t", base / "packed.mxq", progress=False)
    out["packed"] = LoadedModel(base / "packed.mxq")           # the target's weights as 2356t
    return out


def _run(lm, prompt, drafter=None, n=24, **kw):
    with Engine(lm, speculative=drafter) as eng:
        pieces = list(eng.submit(lm.tokenizer.encode(prompt), max_new_tokens=n, **NO_EOS, **kw))
        stats = eng.stats()
    return [p.token for p in pieces if p.token is not None], pieces[-1], stats


# ============================================================================ drafters
def _ngram_ref(h, k, max_n, min_n):
    h = list(h)
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        tail = h[-n:]
        for i in range(len(h) - n - 1, -1, -1):
            if h[i:i + n] == tail:
                return h[i + n:i + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 4),
       st.integers(1, 4))
def test_ngram_drafter_matches_brute_force(h, k, max_n, min_n):
    d = NgramDrafter(k, max_ngram=max_n, min_ngram=min(min_n, max_n))
    assert d.propose(None, np.array(h), k) == _ngram_ref(h, k, max_n, min(min_n, max_n))


def test_ngram_drafter_caps_and_windows():
    assert NgramDrafter(10 ** 6).k == MAX_DRAFT
    with pytest.raises(GenerationError):
        NgramDrafter(0)
    h = np.array([1, 2, 3, 9, 9, 9, 1, 2])
    assert NgramDrafter(4).propose(None, h, 4) == [3, 9, 9, 9]
    assert NgramDrafter(4, window=3).propose(None, h, 4) == []


# ============================================================================ lossless
@pytest.mark.parametrize("kind", ["lookup", "draft-self", "draft-other"])
def test_greedy_output_is_plain_output(models, kind):
    lm = models["target"]
    drafter = {"lookup": lambda: NgramDrafter(6),
               "draft-self": lambda: ModelDrafter(lm.model, 4),
               "draft-other": lambda: ModelDrafter(models["other"].model, 3)}[kind]()
    kw = dict(temperature=0, repetition_penalty=1.0)    # the draft is a plain argmax
    want, _, _ = _run(lm, REPEAT, **kw)
    got, last, stats = _run(lm, REPEAT, drafter, **kw)
    assert got == want
    assert stats["verify_steps"] > 0 and stats["draft_tokens"] > 0
    assert last.draft_tokens == stats["draft_tokens"]
    assert last.accepted_draft_tokens == stats["accepted_draft_tokens"]
    if kind == "draft-self":          # the target drafting for itself: every draft is right
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]


@pytest.mark.parametrize("kind", ["lookup", "draft-self", "draft-f32"])
def test_greedy_output_is_plain_output_packed(models, kind):
    """A 2356t target: the verify forward's rows are the single steps' rows bit for bit on every tier,
    so speculative output is plain output here too."""
    lm = models["packed"]
    drafter = {"lookup": lambda: NgramDrafter(6),
               "draft-self": lambda: ModelDrafter(lm.model, 4),
               "draft-f32": lambda: ModelDrafter(models["target"].model, 5)}[kind]()
    kw = dict(temperature=0, repetition_penalty=1.0)
    want, _, _ = _run(lm, REPEAT, **kw)
    got, _, stats = _run(lm, REPEAT, drafter, **kw)
    assert got == want
    assert stats["verify_steps"] > 0
    if kind == "draft-self":
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_sampling_is_plain_sampling(models, seed):
    """Each emitted token is one draw of the slot's own sampler from the target's row, in the
    plain order: with the same seed the sampled text is the same."""
    lm = models["target"]
    kw = dict(temperature=1.0, top_p=0.95, seed=seed)
    want, _, _ = _run(lm, REPEAT, **kw)
    got, _, _ = _run(lm, REPEAT, NgramDrafter(4), **kw)
    assert got == want


def test_walk_distribution_chi_square():
    """The acceptance walk's first emitted token is distributed as the target's p whatever the
    draft: sample x ~ p, keep going only when x equals the draft. 40k draws catch a 2 % bias."""
    rng = np.random.default_rng(7)
    p = np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
    n = 40_000
    for draft in (0, 3):
        first = np.empty(n, dtype=np.int64)
        for i in range(n):
            x = int(rng.choice(p.size, p=p))
            first[i] = x                 # emitted; accepted when x == draft, else the correction
        counts = np.bincount(first, minlength=p.size)
        chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
        assert chi2 < 20.5, chi2          # p < 0.001 at 5 degrees of freedom
    # and a 2 % shift of mass is caught at this n
    biased = np.bincount(rng.choice(p.size, size=n, p=p + np.array([0.02, -0.02, 0, 0, 0, 0])), minlength=p.size)
    assert float((((biased - n * p) ** 2) / (n * p)).sum()) > 20.5


# ============================================================================ engine behaviour
def test_speculation_only_for_a_lone_sequence(models):
    lm = models["target"]
    with Engine(lm, speculative=NgramDrafter(4), max_slots=4) as eng:
        ids = lm.tokenizer.encode(REPEAT)
        reqs = [eng.submit(ids, max_new_tokens=8, temperature=0, **NO_EOS) for _ in range(3)]
        outs = [[p.token for p in r if p.token is not None] for r in reqs]
    assert outs[0] == outs[1] == outs[2]


def test_draft_k_per_request_capped_and_zero_turns_it_off(models):
    lm = models["target"]
    with Engine(lm, speculative=NgramDrafter(4)) as eng:
        ids = lm.tokenizer.encode(REPEAT)
        r = eng.submit(ids, max_new_tokens=8, temperature=0, draft_k=10 ** 6, **NO_EOS)
        assert r.draft_k == MAX_DRAFT
        list(r)
        r0 = eng.submit(ids, max_new_tokens=8, temperature=0, draft_k=0, **NO_EOS)
        last = list(r0)[-1]
        assert last.draft_tokens == 0
        with pytest.raises(GenerationError):
            eng.submit(ids, draft_k=-1)


def test_budget_and_context_bound_the_drafts(models):
    lm = models["target"]
    got, last, _ = _run(lm, REPEAT, NgramDrafter(8), n=3, temperature=0)
    assert len(got) == 3 and last.finish_reason == "length"


def test_cancel_mid_stream_leaves_the_cache_consistent(models):
    """A request cancelled between verification steps leaves its KV, in the prompt cache, holding
    exactly the history but its last token; the next request reuses it and matches a cold run."""
    lm = models["target"]
    ids = lm.tokenizer.encode(REPEAT)
    with Engine(lm, speculative=NgramDrafter(6)) as eng:
        r = eng.submit(ids, max_new_tokens=40, temperature=0, buffer=1, **NO_EOS)
        it = iter(r)
        first = [next(it).token for _ in range(3)]
        r.cancel()
        list(it)
        pieces = list(eng.submit(ids, max_new_tokens=12, temperature=0, **NO_EOS))
        again = [p.token for p in pieces if p.token is not None]
    cold, _, _ = _run(lm, REPEAT, n=12, temperature=0)
    assert again == cold and first == cold[:3]
    assert pieces[-1].cached_tokens > 0          # the cancelled request's KV was reused


# ============================================================================ hostile drafts
def test_draft_with_another_vocabulary_is_refused(models):
    lm = models["target"]

    class Fake:
        class args:
            vocab_size = lm.model.args.vocab_size + 1
    with pytest.raises(ModelError, match="vocabulary"):
        check_compatible(Fake, None, lm.model, None)


def test_draft_with_another_tokenizer_is_refused(models):
    lm = models["target"]

    class Tok:
        def __init__(self, vocab):
            self.backend = self
            self._v = vocab

        def get_vocab(self):
            return self._v
    v = lm.tokenizer.backend.get_vocab()
    swapped = dict(v)
    a, b = sorted(v)[:2]
    swapped[a], swapped[b] = v[b], v[a]
    with pytest.raises(ModelError, match="tokenizer"):
        check_compatible(lm.model, Tok(swapped), lm.model, lm.tokenizer)
    check_compatible(lm.model, Tok(dict(v)), lm.model, lm.tokenizer)      # the same vocabulary passes
    with pytest.raises(GenerationError):
        make_drafter(4, models["other"])
    with pytest.raises(GenerationError):
        Engine(lm, speculative="lookup")


def test_server_reports_drafts_in_usage_and_metrics(models):
    """The server with prompt lookup: usage carries OpenAI's predicted-output counts, /metrics the
    engine's totals."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from mixqrt.serving.server.app import create_app

    lm = models["target"]

    class Pipe:                       # what create_app needs of a Pipeline
        model, tokenizer, max_context, path = lm.model, lm.tokenizer, 256, lm.path
        drafter = NgramDrafter(6)

        def configure_engine(self, **kw):
            self.engine = Engine(lm, speculative=self.drafter, **kw)
            return self.engine
    app = create_app(Pipe(), model="tiny")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": REPEAT, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        d = u["completion_tokens_details"]
        assert d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] > 0
        m = c.get("/metrics").text
        assert "mixqrt_draft_tokens" in m and "mixqrt_accepted_draft_tokens" in m


def test_server_takes_openais_prediction_field(models):
    """A chat request with OpenAI's `prediction` on a server without a drafter: the copy drafter
    drafts from it (usage's predicted-output counts), the reply is the plain one; a malformed
    prediction is a 400 naming the field."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from mixqrt.serving.server.app import create_app

    lm = models["target"]

    class Pipe:
        model, tokenizer, max_context, path = lm.model, lm.tokenizer, 256, lm.path
        drafter = None

        def configure_engine(self, **kw):
            self.engine = Engine(lm, **kw)
            return self.engine
    msgs = [{"role": "user", "content": REPEAT}]
    with TestClient(create_app(Pipe(), model="tiny")) as c:
        body = {"messages": msgs, "max_tokens": 24, "temperature": 0}
        plain = c.post("/v1/chat/completions", json=body).json()
        text = plain["choices"][0]["message"]["content"]
        for pred in ({"type": "content", "content": text}, {"type": "content", "content": [{"type": "text", "text": text}]}):
            r = c.post("/v1/chat/completions", json={**body, "prediction": pred})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == text
            assert r.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        r = c.post("/v1/chat/completions", json={**body, "prediction": {"type": "image", "content": "x"}})
        assert r.status_code == 400 and "prediction" in r.text


def test_adaptive_k_follows_acceptance():
    from mixqrt.generation.speculative import Speculation, expected_tokens
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    sp = Speculation(NgramDrafter(8), 64)
    for _ in range(20):
        sp.record(8, 8)                  # every draft right: draft the most the few-row kernels verify
    assert sp.next_k() >= 7
    for _ in range(30):
        sp.record(4, 0)                  # never right: stop drafting, probe (one draft) every 16 plain steps
    ks = [sp.next_k() for _ in range(32)]
    assert ks.count(0) == 30 and ks.count(1) == 2


def test_a_draft_models_measured_cost_lowers_k():
    """A draft model whose drafted token costs as much as a target step stops paying: k falls to 0
    even at a high acceptance; a cheap one keeps drafting."""
    from mixqrt.generation.speculative import Speculation, row_cost
    lm_like = type("M", (), {"kind": "draft", "k": 8, "new_state": lambda self, n: None})()
    sp = Speculation(lm_like, 64)
    for _ in range(20):
        sp.record(4, 3)                  # 75 % accepted
    assert sp.next_k() > 0
    for _ in range(20):
        sp.record_times(4, 4 * 1.0, 5, row_cost(5))   # a draft token costs a whole target step
    assert sp.draft_cost > 0.9 and sp.next_k() == 0
    for _ in range(20):
        sp.record_times(4, 4 * 0.05, 5, row_cost(5))  # ... or a twentieth of one
    assert sp.draft_cost < 0.1 and sp.next_k() >= 3


def test_draft_prefill_runs_with_the_targets_prefill(models):
    """A draft model reads the prompt during the prefill step (its cost lands in the time to first
    token): when its first drafting step comes, only the last prompt token and the first generated
    one are left to feed."""
    lm = models["target"]
    d = ModelDrafter(models["other"].model, 3)
    ids = lm.tokenizer.encode(REPEAT)
    st = d.new_state(64)
    d.prime(st, ids)
    assert st.fed == ids[:-1] and st.cache.offset == len(ids) - 1
    d.prime(st, ids)                                   # idempotent
    assert st.fed == ids[:-1] and st.cache.offset == len(ids) - 1
    primed = []
    real = d.prime

    def prime(state, prompt):
        primed.append((list(prompt), state.cache.offset))
        real(state, prompt)
        primed[-1] += (state.cache.offset,)
    d.prime = prime
    plain, _, _ = _run(lm, REPEAT, None, n=8, temperature=0)
    got, last, _ = _run(lm, REPEAT, d, n=8, temperature=0)
    assert got == plain and last.draft_tokens > 0
    assert primed == [(ids, 0, len(ids) - 1)]           # once, at the prefill, the whole prompt but its last token


def test_a_drafter_that_cannot_start_leaves_plain_decoding(models):
    """A drafter whose per-sequence state cannot be made (out of memory) costs the request its
    speculation, never the request: it decodes plainly, and the engine goes on."""
    lm = models["target"]

    class Broken(NgramDrafter):
        def new_state(self, max_len):
            raise MemoryError("no room for the draft cache")

    plain, _, _ = _run(lm, REPEAT, None, n=6, temperature=0)
    got, last, _ = _run(lm, REPEAT, Broken(4), n=6, temperature=0)
    assert got == plain and last.draft_tokens == 0


# ============================================================================ the copy drafter (fast apply)
def _edit_target(rng, n=300, vocab=(10, 3000), x=5, y=(900, 901), every=23):
    """A source of n random tokens with token x every `every` positions, and its edited copy (x -> y)."""
    src = [int(t) for t in rng.integers(*vocab, n)]
    for i in range(0, n, every):
        src[i] = x
    out = [t for s in src for t in (y if s == x else (s,))]
    return src, out


def _simulate(drafter, prompt, target, source=None):
    """Greedy speculative decoding against a known output: -> (verify steps, Speculation)."""
    from mixqrt.generation.speculative import Speculation
    sp = Speculation(drafter, 1 << 16, None, source=source)
    hist, n, steps = list(prompt), 0, 0
    while n < len(target):
        k = sp.next_k()
        d = drafter.propose(sp.state, np.asarray(hist), k)[:k] if k else []
        d = d[:sp.length(len(d))]
        a = 0
        while a < len(d) and n + a < len(target) and d[a] == target[n + a]:
            a += 1
        emit = target[n:n + a + 1]
        hist += emit
        n += len(emit)
        steps += 1
        if d:
            sp.record(len(d), a)
    return steps, sp


def test_copy_drafter_learns_a_rename_and_drafts_long():
    """The output is the prompt's text with every x renamed y (two tokens): after the first
    occurrence the substitution is learned, later ones are drafted, and the drafts grow past the
    few-row sizes: far fewer verifies than plain prompt lookup needs."""
    from mixqrt.generation.speculative import CopyDrafter
    src, out = _edit_target(np.random.default_rng(0))
    prompt = [1, 2, 3] + src + [4]
    steps, sp = _simulate(CopyDrafter(8), prompt, out)
    assert ((5,), (900, 901)) in sp.state.subs.get(5, [])
    ngram_steps, _ = _simulate(NgramDrafter(8), prompt, out)
    assert steps * 2.5 < ngram_steps and len(out) / steps > 8
    steps_src, sp2 = _simulate(CopyDrafter(8), [1, 2, 3], out, source=src)   # the text only as a source
    assert len(out) / steps_src > 8 and sp2.state.subs


def test_copy_drafter_refused_substitution_is_not_drafted_again():
    """Where the model keeps X although X -> Y was learned, the copy follows it plainly there."""
    from mixqrt.generation.speculative import CopyDrafter
    d = CopyDrafter(8)
    src = list(range(100, 140))
    st = d.new_state(0, source=src)
    d._learn(st, (110,), (999,))
    hist = [1, 2] + src[:5]
    assert d.propose(st, np.asarray(hist), 8)[5:6] == [999]      # src[5:] with 110 -> 999
    hist += src[5:11]                                            # ... but the model wrote 110
    got = d.propose(st, np.asarray(hist), 8)
    assert got == src[11:19] and st.blocked == {10}              # the source's position of 110


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=2, max_size=80), st.lists(st.integers(0, 12), max_size=30),
       st.integers(1, 64), st.lists(st.integers(0, 12), min_size=0, max_size=40))
def test_copy_drafter_drafts_only_copies(hist, source, k, later):
    """Whatever the history and source, a proposal has at most k tokens, and without learned
    substitutions it is a contiguous run of the source or the history (never past its end)."""
    from mixqrt.generation.speculative import CopyDrafter
    d = CopyDrafter(8)
    stt = d.new_state(0, source=source or None)
    for h in (hist, hist + later):
        got = d.propose(stt, np.asarray(h), k)
        assert len(got) <= k
        if got and not stt.subs:
            corpus = list(source) + [-1] + list(h) if source else list(h)
            assert any(corpus[i:i + len(got)] == got for i in range(len(corpus)))


class _Oracle(NgramDrafter):
    """Drafts the known plain output (with a wrong token every `wrong` drafts), as long as asked: a
    verify of up to 64 drafts, accepted or rejected in the middle."""

    long_k = 64

    def __init__(self, plain, prompt_len, wrong=0):
        super().__init__(8)
        self.plain, self.prompt_len, self.wrong = plain, prompt_len, wrong

    def new_state(self, max_len, source=None):
        return type("S", (), {"run": 10 ** 6})()

    def propose(self, state, history, k):
        n = len(history) - self.prompt_len
        got = list(self.plain[n:n + k])
        if self.wrong and len(got) > self.wrong:
            got[self.wrong] = (got[self.wrong] + 1) % 64
        return got


@pytest.mark.parametrize("name", ["target", "packed", "q8"])
@pytest.mark.parametrize("wrong", [0, 20])
def test_long_verifies_are_plain_decoding(models, tmp_path, name, wrong):
    """Verifies of up to 65 rows (17 where row formats would reach the GEMM, speculative.exact_rows)
    give the plain greedy tokens, whether the whole draft is accepted or rejected past row 17."""
    from mixqrt.generation.speculative import exact_rows
    if name == "q8":
        hf = make_tiny_hf_model(tmp_path / "q8", arch="qwen2", tied=True, seed=0)
        quantize_model(str(hf), "q8", tmp_path / "q8.mxq", progress=False)
        lm = LoadedModel(tmp_path / "q8.mxq")
    else:
        lm = models[name]
    assert exact_rows(lm.model) == (17 if name == "q8" else exact_rows(lm.model))
    if name == "target":
        assert exact_rows(lm.model) == 65
    ids = lm.tokenizer.encode(REPEAT)
    want, _, _ = _run(lm, REPEAT, n=150, temperature=0)
    got, last, stats = _run(lm, REPEAT, _Oracle(want, len(ids), wrong), n=150, temperature=0)
    assert got == want
    assert stats["verify_steps"] >= 2
    rows = exact_rows(lm.model)
    if not wrong:
        assert stats["verify_steps"] <= -(-len(want) // rows) + 1


def test_prediction_drafts_without_a_drafter(models):
    """An engine without a drafter copies from a request's prediction: drafts are made, and the
    output is the plain output."""
    lm = models["target"]
    want, _, _ = _run(lm, REPEAT, n=40, temperature=0)
    text = lm.tokenizer.decode(want)
    for pred in (want, text, {"type": "content", "content": text},
                 {"type": "content", "content": [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]}):
        got, last, stats = _run(lm, REPEAT, n=40, temperature=0, prediction=pred)
        assert got == want
        assert last.draft_tokens > 0 and stats["verify_steps"] > 0
    got, last, _ = _run(lm, REPEAT, n=40, temperature=0, prediction=want, draft_k=0)
    assert got == want and last.draft_tokens == 0


@pytest.mark.parametrize("bad", [{"type": "image", "content": "x"}, {"content": 3}, {"type": "content", "content": [{"type": "image"}]},
                                 3.5, [1, -1], [10 ** 9], ["a"], "x" * 300000, {"type": "content", "content": "x", "extra": 1}])
def test_bad_prediction_is_a_request_error(models, bad):
    from mixqrt.errors import RequestError
    lm = models["target"]
    with Engine(lm) as eng:
        with pytest.raises(RequestError) as e:
            eng.submit(lm.tokenizer.encode(REPEAT), max_new_tokens=4, prediction=bad)
        assert e.value.field == "prediction"


@pytest.mark.parametrize("seed", [0, 3])
def test_copy_drafter_sampling_is_plain_sampling(models, seed):
    """Seeded sampling with the copy drafter and a prediction: the plain draw, token for token."""
    from mixqrt.generation.speculative import CopyDrafter
    lm = models["target"]
    kw = dict(temperature=0.8, seed=seed)
    want, _, _ = _run(lm, REPEAT, n=40, **kw)
    got, _, _ = _run(lm, REPEAT, CopyDrafter(4), n=40, **kw)
    assert got == want
    got, _, _ = _run(lm, REPEAT, CopyDrafter(4), n=40, prediction=want[:20] + want[22:], **kw)
    assert got == want


def test_prediction_on_a_draft_model_engine_copies(models):
    """A request with a prediction drafts by copying even where the engine drafts with a model."""
    lm = models["target"]
    want, _, _ = _run(lm, REPEAT, n=30, temperature=0)
    got, last, _ = _run(lm, REPEAT, ModelDrafter(models["other"].model, 3), n=30, temperature=0, prediction=want)
    assert got == want and last.accepted_draft_tokens >= 20


def test_api_and_pipeline_take_prediction(models):
    """mixqrt.serving.api (OpenAI's spelling) and Pipeline (a keyword) pass a prediction to the engine."""
    from mixqrt.serving import api
    from mixqrt.pipeline import Pipeline
    lm = models["target"]
    pipe = Pipeline(str(lm.path), progress=False)
    try:
        msgs = [{"role": "user", "content": REPEAT}]
        plain = pipe(msgs, max_new_tokens=20, temperature=0)[0]["generated_text"][-1]["content"]
        got = pipe(msgs, max_new_tokens=20, temperature=0, prediction=plain)[0]["generated_text"][-1]["content"]
        assert got == plain
        r = api.create_chat_completion(pipe, msgs, max_tokens=20, temperature=0,
                                       prediction={"type": "content", "content": plain})
        assert r["choices"][0]["message"]["content"] == plain
        assert r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    finally:
        pipe.close()
