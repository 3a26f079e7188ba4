"""Long context (issue 41): kv_type plumbing (Pipeline, Engine, generate, ppl, bench, inspect, the
CLI), the model's whole context as the default, the KV byte bound (a prompt that cannot fit is a
RequestError naming the sizes, a request waits for room, the budget is cut to what fits), long
windows of `ppl` scored in pieces, `bench --depth`, and callers of a cache whose trim drops more
than asked (a packed cache drops down to a block start). Nothing asserts on time."""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.cache import DEFAULT_KV_TYPE, KV_TYPES, KVCache, check_kv_type, kv_bytes_per_token, make_kv_cache
from mixqrt.engine import Engine
from mixqrt.errors import GenerationError, MixqrtError, RequestError

# the tiny model (mixqrt.testing.tiny): 2 layers, 2 KV heads of 16, context 256
ROW_F32 = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def lm(tiny_f32_path):
    from mixqrt.pipeline import LoadedModel
    return LoadedModel(tiny_f32_path)


def greedy(eng, prompt, n=6, **kw):
    out = list(eng.submit(prompt, max_new_tokens=n, temperature=0.0, eos_token_ids=[], **kw))
    return [r.token for r in out if r.token is not None], out[-1]


# ------------------------------------------------------------------ kv types
def test_kv_types_checked_and_sized():
    assert DEFAULT_KV_TYPE in KV_TYPES and check_kv_type(None) == DEFAULT_KV_TYPE
    assert check_kv_type("F16") == "f16"
    for bad in ("q5", "", 16, "float32"):
        with pytest.raises(GenerationError, match="kv_type must be one of"):
            check_kv_type(bad)
    assert kv_bytes_per_token("f32", 24, 2, 64) == 24576          # Qwen2.5-0.5B: 24 KiB per token
    assert kv_bytes_per_token("f16", 24, 2, 64) == 12288
    c = make_kv_cache("f16", 2, 2, 16, 64)
    assert isinstance(c, KVCache) and c.keys[0].dtype == np.float16 and c.offset == 0
    for t in KV_TYPES:           # every type is made, or refused with a typed error naming it
        try:
            c = make_kv_cache(t, 2, 2, 16, 128)
        except MixqrtError as e:
            assert t in str(e)
            continue
        assert c.max_len == 128 and c.offset == 0


def test_model_make_cache_kv_type(lm):
    m = lm.model
    assert m.make_cache(8, "f16").keys[0].dtype == np.float16
    assert m.make_cache(8, dtype=np.float16).keys[0].dtype == np.float16      # the older spelling
    assert m.make_cache().max_len == m.context_length                           # the whole context, lazily
    assert m.kv_bytes_per_token("f32") == ROW_F32
    with pytest.raises(GenerationError):
        m.make_cache(8, "bogus")


def test_pipeline_and_engine_kv_type(tiny_f32_path):
    from mixqrt.pipeline import Pipeline
    pipe = Pipeline(str(tiny_f32_path), kv_type="f16", progress=False)
    try:
        assert pipe.kv_type == "f16" and pipe.model.kv_type == "f16"
        assert pipe.max_context == pipe.model.context_length == 256            # the model's own
        assert pipe.engine.kv_type == "f16" and pipe.engine.max_context == 256
        a, last = greedy(pipe.engine, [5, 6, 7, 8, 9, 10])
        b, last2 = greedy(pipe.engine, [5, 6, 7, 8, 9, 10])
        assert a == b and last2.cached_tokens == 5                             # f16 rows came back from the tree
        node = next(iter(next(iter(pipe.engine._cache.tree.roots.values())).children.values()))
        assert node.kv.dtype == np.float16
        eng = pipe.configure_engine(kv_type="f32")
        assert eng.kv_type == "f32" and eng._cache.row_bytes == ROW_F32
    finally:
        pipe.close()
    with pytest.raises(GenerationError, match="kv_type"):
        Pipeline(str(tiny_f32_path), kv_type="q5", progress=False)


def test_generate_step_kv_type(lm):
    from mixqrt.generate import generate_step, stream_generate
    a = [t for t, _ in generate_step(lm.model, [5, 6, 7], max_tokens=4)]
    b = [t for t, _ in generate_step(lm.model, [5, 6, 7], max_tokens=4, kv_type="f16")]
    assert len(a) == len(b) == 4
    c = [r.token for r in stream_generate(lm.model, None, [5, 6, 7], max_new_tokens=4, temperature=0.0,
                                          eos_token_ids=[], kv_type="f16")]
    assert c == b


# ------------------------------------------------------------------ the KV byte bound
def test_engine_default_context_and_bound(lm):
    with Engine(lm) as eng:
        assert eng.max_context == lm.model.context_length
        assert eng._cache.capacity >= 256 << 20                               # a share of free memory


def test_prompt_that_cannot_fit_is_refused_with_the_sizes(lm):
    with Engine(lm, kv_cache_bytes=64 << 10) as eng:
        rows = eng._cache.max_rows()
        assert 0 < rows < eng.max_context
        with pytest.raises(RequestError, match="kv_cache_bytes") as e:
            eng.submit(list(range(3, 3 + rows)), max_new_tokens=4)
        assert f"{64 << 10:,d}" in str(e.value) and f"{rows} tokens" in str(e.value)
        with pytest.raises(RequestError, match="kv_cache_bytes"):            # n choices need n caches
            eng.submit(list(range(3, 3 + rows // 2 + 1)), max_new_tokens=4, n=2)
        toks, last = greedy(eng, list(range(3, 3 + rows - 5)), n=50)           # the budget is cut to what fits
        assert len(toks) == 5 and last.finish_reason == "length"


def test_requests_wait_for_room_under_the_bound(lm):
    prompt = list(range(3, 73))
    with Engine(lm) as ref:
        want, _ = greedy(ref, prompt)
    with Engine(lm, kv_cache_bytes=0) as off:
        cap = off._cache.bytes_for(len(prompt) + 6)                           # one request at a time
    with Engine(lm, kv_cache_bytes=cap, max_slots=4) as eng:
        reqs = [eng.submit(prompt, max_new_tokens=6, temperature=0.0, eos_token_ids=[]) for _ in range(3)]
        outs = [[r.token for r in q if r.token is not None] for q in reqs]
        assert outs == [want] * 3
        st = eng.stats()
        assert st["max_batch"] == 1 and st["kv_cache_bytes_used"] <= cap


def test_decoding_past_the_bound_ends_with_length(lm):
    """Two requests admitted together whose decode outgrows the bound: the longer ends "length",
    the bound holds."""
    with Engine(lm, kv_cache_bytes=0) as off:
        c = off._cache
        rows_page = next(r for r in range(1, 256) if c.bytes_for(r + 1) > c.bytes_for(r))   # rows of one page
    with Engine(lm, kv_cache_bytes=2 * c.bytes_for(rows_page), max_slots=2) as eng:
        reqs = [eng.submit(list(range(3, 3 + rows_page - 4 - i)), max_new_tokens=30, temperature=0.0,
                           eos_token_ids=[]) for i in range(2)]
        lasts = [list(q)[-1] for q in reqs]
        assert {r.finish_reason for r in lasts} <= {"length"}
        assert min(r.generation_tokens for r in lasts) < 30                    # cut by the bound, not the budget
        assert eng.stats()["kv_cache_bytes_used"] <= 2 * c.bytes_for(rows_page)


# ------------------------------------------------------------------ trims that drop more
class BlockTrimCache(KVCache):
    """A KVCache whose trim drops down to a multiple of BLOCK, as a packed cache may."""
    BLOCK = 4

    def trim(self, n: int) -> int:
        want = max(0, self.offset - max(0, int(n)))
        keep = want - want % self.BLOCK
        dropped = self.offset - keep
        self.offset = keep
        return dropped


def test_speculation_over_a_cache_that_trims_to_block_starts(lm, monkeypatch):
    from mixqrt.speculative import make_drafter
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    with Engine(lm) as plain:
        want, _ = greedy(plain, prompt, n=12)
    a = lm.model.args
    monkeypatch.setattr(lm.model, "make_cache", lambda max_len=None, kv_type=None, **kw: BlockTrimCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, int(max_len or a.max_position_embeddings)))
    with Engine(lm, speculative=make_drafter(3, None, 4, target=lm.model)) as eng:
        got, _ = greedy(eng, prompt, n=12)
        assert eng.stats()["verify_steps"] > 0
    assert got == want


# ------------------------------------------------------------------ ppl in pieces, bench --depth, inspect
def test_perplexity_pieces_equal_the_whole_window(lm):
    from mixqrt.evaluate import perplexity
    toks = np.random.default_rng(0).integers(3, 400, size=256)
    whole = perplexity(lambda ids: lm.logits(ids), toks, ctx=128, progress=False)
    parts = perplexity(None, toks, ctx=128, progress=False,
                       pieces_fn=lambda ids, first: lm.logit_pieces(ids, first, rows=24))
    assert parts.tokens == whole.tokens and abs(parts.ppl - whole.ppl) < 1e-3 * whole.ppl

    def short(ids, first):
        yield lm.logits(ids)[first:-2]
    with pytest.raises(GenerationError, match="scored positions"):
        perplexity(None, toks, ctx=128, progress=False, pieces_fn=short)


def test_bench_depth(lm):
    from mixqrt.bench import bench
    rows = bench(lm, threads=(1,), n_prompt=16, n_gen=4, ttft_prompt=8, repeats=1, depth=64, kv_type="f16",
                 progress=False, probe_bytes=1 << 20, probes=1)
    r = rows[0]
    assert r["depth"] == 64 and r["kv_type"] == "f16" and r["kv_bytes_per_token"] == ROW_F32 / 2
    assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0
    with pytest.raises(GenerationError, match="context"):
        bench(lm, threads=(1,), n_prompt=16, n_gen=4, repeats=1, depth=257, progress=False,
              probe_bytes=1 << 20, probes=1)


def test_inspect_reports_kv_bytes(tiny_f32_path):
    from mixqrt.inspect import inspect_model
    text = inspect_model(str(tiny_f32_path), kv_type="f16")
    assert f"KV cache f16: {ROW_F32 // 2:,d} bytes per token" in text
    import json
    info = json.loads(inspect_model(str(tiny_f32_path), as_json=True))
    assert info["kv_cache"]["kv_bytes_per_token_by_type"]["f32"] == ROW_F32


def test_cli_help_lists_kv_types():
    from mixqrt.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if hasattr(a, "choices") and isinstance(a.choices, dict)).choices
    for cmd in ("generate", "chat", "serve", "ppl", "bench", "inspect"):
        text = sub[cmd].format_help()
        assert "--kv-type" in text and f"default {DEFAULT_KV_TYPE}" in text, cmd
        assert all(t in text for t in KV_TYPES), cmd
    assert "--depth" in sub["bench"].format_help()
    a = p.parse_args(["generate", "--kv-type", "f16", "--kv-cache-bytes", "512MiB", "-p", "x"])
    assert a.kv_type == "f16" and a.kv_cache_bytes == 512 << 20
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--kv-type", "q5", "-p", "x"])


# ------------------------------------------------------------------ long prefill keeps streams going
def test_long_prefill_interleaves_decode_at_16k(tmp_path):
    """A 16k-token prompt is prefilled in prefill_chunk pieces, and every step of it also decodes
    the stream already running: over the long request's life (its 64 chunks), the other stream
    gets a token at every step, not just after the prefill."""
    from mixqrt.pipeline import LoadedModel
    from mixqrt.quantize.convert import quantize_model
    from mixqrt.testing.tiny import make_tiny_hf_model
    n = 16384
    d = make_tiny_hf_model(tmp_path / "m", arch="qwen2", config_extra={"max_position_embeddings": n + 64})
    quantize_model(str(d), "f32", tmp_path / "long.mxq", progress=False)
    lm = LoadedModel(tmp_path / "long.mxq")
    long_prompt = np.random.default_rng(1).integers(3, 400, size=n - 8).tolist()
    with Engine(lm, prefill_chunk=256, kv_cache_bytes=0, max_slots=2) as eng:
        assert eng.max_context == n + 64
        a = eng.submit([5, 6, 7], max_new_tokens=10000, temperature=0.0, eos_token_ids=[], buffer=100000)
        next(a)                                       # a is decoding
        before = eng.stats()
        b = eng.submit(long_prompt, max_new_tokens=2, temperature=0.0, eos_token_ids=[])
        assert len([r for r in b if r.token is not None]) == 2
        after = eng.stats()
        a.cancel()
    chunks = -(-len(long_prompt) // 256)
    steps = after["steps"] - before["steps"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(long_prompt)
    assert steps >= chunks + 1
    assert after["decode_tokens"] - before["decode_tokens"] >= steps - 2    # a decoded at (almost) every step
