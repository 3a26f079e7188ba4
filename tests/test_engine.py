"""mixqrt.generation.engine: continuous batching, chunked prefill, prompt cache, backpressure, cancellation.

On the tiny model (tests/tinymodel.py). With the f32 recipe a batched, chunked or cached run
computes the same numbers as a single one, so outputs must match exactly. Packed formats with
int8 activations (q8) can differ by one activation rounding step when only the last bits of an
input differ (another chunk boundary, another batch), and the tiny random model has near-ties,
so there every token must be the greedy choice of a teacher-forced recompute up to a tolerance.
Loops are bounded; nothing asserts on wall-clock time.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from mixqrt.quantize.convert import quantize_model
from mixqrt.generation.engine import Engine, EngineBusy
from mixqrt.errors import GenerationError
from mixqrt.generation.generate import stream_generate
from mixqrt.pipeline import LoadedModel
from tinymodel import make_tiny_hf_model

NO_EOS = {"eos_token_ids": []}     # run to max_new_tokens: the tiny model emits eos at random


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)


@pytest.fixture(scope="module", params=["f32", "q8"])
def lm(request, tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mxq") / f"{request.param}.mxq"
    quantize_model(str(tiny_dir), request.param, out, progress=False)
    m = LoadedModel(out)
    m.loaded_recipe = request.param
    return m


@pytest.fixture(scope="module")
def lm32(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mxq32") / "f32.mxq"
    quantize_model(str(tiny_dir), "f32", out, progress=False)
    return LoadedModel(out)


def prompts(lm, n):
    texts = ["def quicksort(xs):", "The quick brown fox", "for i in range(10):", "Language models predict",
             "class Model:", "Quantization stores weights", "hello world", "print(i, i * i)"]
    return [lm.tokenizer.encode(texts[i % len(texts)] * (1 + i // len(texts))) for i in range(n)]


def tokens(req):
    out = list(req)
    assert out[-1].finish_reason is not None and all(r.finish_reason is None for r in out[:-1])
    return [r.token for r in out if r.token is not None], out


def sequential(lm, ids, **kw):
    return [r.token for r in stream_generate(lm.model, lm.tokenizer, ids, **kw)]


def check_greedy(lm, prompt, got, want):
    """f32: exactly the sequential tokens; packed: each token is the argmax up to rounding noise."""
    if lm.loaded_recipe == "f32":
        assert got == want
        return
    logits = lm.model.logits(np.asarray(prompt + got))[len(prompt) - 1:-1]
    for i, (t, row) in enumerate(zip(got, logits)):
        assert row[t] >= row.max() - 0.1, (i, t, int(row.argmax()), float(row.max() - row[t]))


def wait_for(cond, n=2000):
    for _ in range(n):
        if cond():
            return True
        time.sleep(0.005)
    return False


# ============================================================================ batching
def test_batched_greedy_equals_sequential(lm):
    ps = prompts(lm, 6)
    with Engine(lm, max_slots=4, prefill_chunk=7) as eng:
        reqs = [eng.submit(p, max_new_tokens=12, temperature=0.0, **NO_EOS) for p in ps]
        got = [tokens(r)[0] for r in reqs]
        st = eng.stats()
    for p, g in zip(ps, got):
        check_greedy(lm, p, g, sequential(lm, p, max_new_tokens=12, temperature=0.0, **NO_EOS))
    assert st["max_batch"] >= 2 and st["decode_tokens"] == st["tokens_generated"] - len(ps)
    assert st["running"] == 0 and st["finished"] == len(ps)


def test_gemm_cache_batched_greedy(lm):
    """With the GEMM tile cache on, batched steps read cached tiles (q8: built on AVX-512) and the
    tokens are still the greedy ones; the budget is process-wide and reported in stats."""
    from mixqrt import ops
    from mixqrt.platform import isa
    ps = prompts(lm, 4)
    old = ops.set_gemm_cache(0)
    try:
        with Engine(lm, max_slots=4, gemm_cache_bytes=64 << 20) as eng:
            got = [tokens(r)[0] for r in [eng.submit(p, max_new_tokens=10, temperature=0.0, **NO_EOS) for p in ps]]
            st = eng.stats()
        for p, g in zip(ps, got):
            check_greedy(lm, p, g, sequential(lm, p, max_new_tokens=10, temperature=0.0, **NO_EOS))
        packed = lm.loaded_recipe != "f32" and isa.current() == "avx512"
        assert (st["gemm_cache_bytes_used"] > 0) == packed
        assert ops.gemm_cache_info()["budget"] == 64 << 20
        with pytest.raises(GenerationError, match="gemm_cache_bytes"):
            Engine(lm, gemm_cache_bytes=-1)
    finally:
        ops.set_gemm_cache(old)


def test_seed_reproducible_whatever_the_neighbours(lm):
    p = prompts(lm, 1)[0]
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=0, seed=1234, **NO_EOS)
    with Engine(lm, max_slots=4) as eng:
        alone = tokens(eng.submit(p, **kw))[0]
        crowd = [eng.submit(q, max_new_tokens=20, temperature=1.0, seed=i, **NO_EOS)
                 for i, q in enumerate(prompts(lm, 3))]
        mine = eng.submit(p, **kw)
        again = tokens(mine)[0]
        for r in crowd:
            tokens(r)
    assert alone == sequential(lm, p, **kw)        # alone: the same path as stream_generate
    if lm.loaded_recipe == "f32":
        assert again == alone
    else:                                        # the prefill is the same computation; later, one
        assert again[0] == alone[0]              # rounding flip may change a draw (see the top)


def test_stop_strings_and_text_match_sequential(lm32):
    p = prompts(lm32, 1)[0]
    full = "".join(r.text for r in stream_generate(lm32.model, lm32.tokenizer, p, max_new_tokens=20,
                                                   temperature=0.0, **NO_EOS))
    stop = full[5:8] if len(full) > 8 else None
    with Engine(lm32) as eng:
        _, out = tokens(eng.submit(p, max_new_tokens=20, temperature=0.0, stop=stop, **NO_EOS))
    ref = list(stream_generate(lm32.model, lm32.tokenizer, p, max_new_tokens=20, temperature=0.0, stop=stop,
                               **NO_EOS))
    assert "".join(r.text for r in out) == "".join(r.text for r in ref)
    assert out[-1].finish_reason == ref[-1].finish_reason
    if stop:
        assert stop not in "".join(r.text for r in out)


def test_chunked_prefill_interleaves_with_decode(lm32):
    short, long_ = [1, 2, 3], prompts(lm32, 1)[0] * 6            # ~40+ tokens: several 8-token chunks
    with Engine(lm32, max_slots=2, prefill_chunk=8) as eng:
        steps = []
        orig = eng._step

        def spy(prefill, decode):
            steps.append((prefill.req.id if prefill else None, [s.req.id for s in decode]))
            return orig(prefill, decode)

        eng._step = spy
        a = eng.submit(short, max_new_tokens=200, temperature=0.0, buffer=1000, **NO_EOS)
        next(a)                                                    # A is decoding
        b = eng.submit(long_, max_new_tokens=2, temperature=0.0, **NO_EOS)
        tokens(b)
        a.cancel()
        tokens(a)
    b_chunks = [d for p, d in steps if p == b.id]
    assert len(b_chunks) == -(-len(long_) // 8)                    # one chunk of at most 8 per step
    assert sum(a.id in d for d in b_chunks) >= len(b_chunks) - 1   # A decoded alongside B's chunks


# ============================================================================ cancellation, backpressure
def test_cancel_frees_the_slot(lm32):
    with Engine(lm32, max_slots=1) as eng:
        a = eng.submit([5, 6, 7], max_new_tokens=200, temperature=0.0, buffer=2, **NO_EOS)
        first = next(a)
        assert first.finish_reason is None
        a.cancel()
        rest = list(a)
        assert rest[-1].finish_reason == "cancelled"
        b = eng.submit([5, 6, 7], max_new_tokens=3, temperature=0.0, **NO_EOS)
        toks, out = tokens(b)
        assert out[-1].finish_reason == "length" and len(toks) == 3
        assert wait_for(lambda: eng.stats()["running"] == 0)
        assert eng.stats()["cancelled"] == 1


def test_queue_full_raises_engine_busy(lm32):
    with Engine(lm32, max_slots=1, max_queue=1) as eng:
        a = eng.submit([1, 2], max_new_tokens=100, buffer=1, **NO_EOS)    # holds the slot (never read)
        assert wait_for(lambda: eng.stats()["running"] == 1)
        b = eng.submit([1, 2], max_new_tokens=2, **NO_EOS)                # waits in the queue
        with pytest.raises(EngineBusy, match="busy"):
            eng.submit([1, 2], max_new_tokens=2)
        assert isinstance(EngineBusy("x"), GenerationError)
        a.cancel()
        assert tokens(b)[1][-1].finish_reason == "length"
        eng.submit([1, 2], max_new_tokens=1)                               # room again


def test_stalled_consumer_is_skipped_then_cancelled(lm32):
    with Engine(lm32, max_slots=2, stall_timeout=0.3) as eng:
        slow = eng.submit([1, 2, 3], max_new_tokens=200, buffer=2, temperature=0.0, **NO_EOS)
        fast = eng.submit([4, 5, 6], max_new_tokens=60, temperature=0.0, **NO_EOS)
        toks, out = tokens(fast)                     # completes although `slow` is never read
        assert len(toks) == 60 and out[-1].finish_reason == "length"
        assert wait_for(lambda: eng.stats()["stalled"] == 1)
        got = list(slow)
        assert [r.finish_reason for r in got] == [None, None, "cancelled"]   # the buffer, then the end
        assert eng.stats()["running"] == 0


def test_async_iteration(lm32):
    ps = prompts(lm32, 3)

    async def run(eng):
        async def one(p):
            return [r.token async for r in eng.submit(p, max_new_tokens=8, temperature=0.0, **NO_EOS)]
        ticks = 0

        async def ticker():                          # the event loop keeps running meanwhile
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        t = asyncio.ensure_future(ticker())
        out = await asyncio.gather(*(one(p) for p in ps))
        t.cancel()
        return out, ticks

    with Engine(lm32, max_slots=4) as eng:
        got, ticks = asyncio.run(run(eng))
    assert got == [sequential(lm32, p, max_new_tokens=8, temperature=0.0, **NO_EOS) for p in ps]
    assert ticks > 0


# ============================================================================ prompt cache
def test_prompt_cache_hit_matches_cold_run(lm):
    turn1 = prompts(lm, 1)[0] * 3
    with Engine(lm, kv_cache_bytes=0) as cold, Engine(lm) as warm:
        t1 = tokens(warm.submit(turn1, max_new_tokens=10, temperature=0.0, **NO_EOS))[0]
        turn2 = turn1 + t1 + prompts(lm, 2)[1]
        toks, out = tokens(warm.submit(turn2, max_new_tokens=10, temperature=0.0, **NO_EOS))
        ref, ref_out = tokens(cold.submit(turn2, max_new_tokens=10, temperature=0.0, **NO_EOS))
        st, st_cold = warm.stats(), cold.stats()
    check_greedy(lm, turn2, toks, ref)
    # the first turn's prompt and all its answer but the last token (never fed) were reused
    assert out[-1].cached_tokens == len(turn1) + len(t1) - 1 and ref_out[-1].cached_tokens == 0
    assert st["cache_hits"] == 1 and st["cache_misses"] == 1 and st["cached_tokens"] == out[-1].cached_tokens
    assert st_cold["cache_hits"] == 0 and st_cold["idle_caches"] == 0
    assert st["prefill_tokens"] == len(turn1) + len(turn2) - out[-1].cached_tokens


def test_prompt_cache_diverging_prefix_copies_and_identical_prompt(lm32):
    base = prompts(lm32, 1)[0] * 2
    with Engine(lm32) as eng:
        tokens(eng.submit(base + [10, 11], max_new_tokens=4, temperature=0.0, **NO_EOS))
        a, out = tokens(eng.submit(base + [12, 13], max_new_tokens=4, temperature=0.0, **NO_EOS))
        assert out[-1].cached_tokens == len(base)            # shared system-prompt-like prefix: copied
        assert eng.stats()["idle_caches"] == 2
        b, out = tokens(eng.submit(base + [12, 13], max_new_tokens=4, temperature=0.0, **NO_EOS))
        assert a == b and out[-1].cached_tokens == len(base) + 1   # all but the last prompt token
    assert a == sequential(lm32, base + [12, 13], max_new_tokens=4, temperature=0.0, **NO_EOS)


def test_prompt_cache_lru_eviction_bounded(lm32):
    from mixqrt.generation.prompt_cache import NODE_OVERHEAD, SALT_OVERHEAD
    with Engine(lm32) as probe:
        row = probe._cache.row_bytes
        running = probe.model.make_cache(probe.max_context).resident_bytes(25)   # pages a request touches
    node = 25 * row + 25 * 4 + NODE_OVERHEAD                          # 20 + 5 rows each, int32 tokens
    cap = running + SALT_OVERHEAD + 2 * node + node // 2               # one running + two cached, or three cached
    ps = [[i + 1] * 20 for i in range(4)]
    with Engine(lm32, kv_cache_bytes=cap) as eng:
        for p in ps:
            tokens(eng.submit(p, max_new_tokens=6, temperature=0.0, **NO_EOS))
            assert eng.stats()["kv_cache_bytes_used"] <= cap
        st = eng.stats()
        assert st["cache_evictions"] == 1 and st["idle_caches"] == 3     # the 4th request made room
        # the oldest was evicted (a miss), the newest is still there (a hit)
        tokens(eng.submit(ps[0] + [9], max_new_tokens=2, **NO_EOS))
        tokens(eng.submit(ps[3] + [9], max_new_tokens=2, **NO_EOS))
        st = eng.stats()
        assert st["cache_misses"] == 5 and st["cache_hits"] == 1


# ============================================================================ input, lifecycle
def test_bad_requests_fail_at_submit(lm32):
    with Engine(lm32) as eng:
        with pytest.raises(GenerationError, match="empty"):
            eng.submit([])
        with pytest.raises(GenerationError, match="token ids"):
            eng.submit([10 ** 6])
        with pytest.raises(GenerationError, match="context"):
            eng.submit([1] * (eng.max_context + 1))
        with pytest.raises(GenerationError, match="temperature"):
            eng.submit([1], temperature=float("nan"))
        with pytest.raises(GenerationError, match="buffer"):
            eng.submit([1], buffer=0)
    with pytest.raises(GenerationError, match="closed"):
        eng.submit([1])
    with pytest.raises(GenerationError, match="max_slots"):
        Engine(lm32, max_slots=0)
    with pytest.raises(GenerationError, match="Engine needs"):
        Engine("model.mxq")


def test_close_cancels_running_and_queued(lm32):
    eng = Engine(lm32, max_slots=1)
    a = eng.submit([1, 2], max_new_tokens=200, buffer=1, **NO_EOS)
    b = eng.submit([1, 2], max_new_tokens=200, **NO_EOS)
    eng.close()
    assert list(a)[-1].finish_reason == "cancelled" and list(b)[-1].finish_reason == "cancelled"
    assert not eng.stats()["alive"]


def test_model_error_reaches_the_request_only(lm32, monkeypatch):
    with Engine(lm32, max_slots=2) as eng:
        def boom(*a, **k):
            raise RuntimeError("kernel exploded")
        monkeypatch.setattr(eng, "_forward", boom)
        r = eng.submit([1, 2, 3], max_new_tokens=5, **NO_EOS)
        with pytest.raises(RuntimeError, match="exploded"):
            list(r)
        monkeypatch.undo()
        assert tokens(eng.submit([1, 2, 3], max_new_tokens=3, **NO_EOS))[1][-1].finish_reason == "length"
        assert eng.stats()["failed"] == 1


def test_consumers_on_threads(lm32):
    ps = prompts(lm32, 6)
    results = [None] * len(ps)
    with Engine(lm32, max_slots=3) as eng:
        def run(i):
            results[i] = tokens(eng.submit(ps[i], max_new_tokens=6, temperature=0.0, **NO_EOS))[0]
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert results == [sequential(lm32, p, max_new_tokens=6, temperature=0.0, **NO_EOS) for p in ps]


def test_pipeline_and_api_go_through_the_engine(tiny_dir, tmp_path, monkeypatch):
    import mixqrt
    from mixqrt.serving.api import create_chat_completion
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    pipe = mixqrt.Pipeline(str(tiny_dir), recipe="f32", progress=False)
    pipe("hello", max_new_tokens=3, do_sample=False)
    assert pipe.engine.stats()["requests"] == 1
    for _ in pipe.stream("hello", max_new_tokens=50, do_sample=False, stop_strings=None):
        break                                                     # leaving the loop cancels
    assert wait_for(lambda: pipe.engine.stats()["running"] == 0)
    msgs = [{"role": "user", "content": "hi"}]
    out = create_chat_completion(pipe, msgs, max_tokens=4, temperature=0.0)
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    msgs2 = msgs + [out["choices"][0]["message"], {"role": "user", "content": "more"}]
    out2 = create_chat_completion(pipe, msgs2, max_tokens=4, temperature=0.0)
    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert pipe.engine.stats()["requests"] == 4
    # a subnormal temperature decodes greedily (it used to draw the last token of the vocabulary)
    greedy = create_chat_completion(pipe, msgs, max_tokens=6, temperature=0.0)["choices"][0]["message"]
    tiny_t = create_chat_completion(pipe, msgs, max_tokens=6, temperature=5e-324)["choices"][0]["message"]
    assert tiny_t == greedy
    pipe.close()
    assert pipe("hello", max_new_tokens=2, do_sample=False)          # a new engine on demand
    pipe.close()
