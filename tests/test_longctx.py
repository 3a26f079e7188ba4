"""Long context (issue 41): kv_type plumbing (Pipeline, Engine, generate, ppl, bench, inspect, the
CLI), the model's whole context as the default, the KV byte bound (a prompt that cannot fit is a
RequestError naming the sizes, a request waits for room, the budget is cut to what fits), long
windows of `ppl` scored in pieces, `bench --depth`, and callers of a cache whose trim drops more
than asked (a packed cache drops down to a block start). Nothing asserts on time."""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.models.kv_cache import DEFAULT_KV_TYPE, KV_TYPES, KVCache, check_kv_type, kv_bytes_per_token, make_kv_cache
from mixqrt.generation.engine import Engine
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
    for t in KV_TYPES:           # every type is made for a head_dim of 64
        c = make_kv_cache(t, 2, 2, 64, 128)
        assert c.max_len == 128 and c.offset == 0
    for t in ("q4", "q8"):       # a packed type needs a head_dim the kernel takes: a typed error naming it
        with pytest.raises(MixqrtError, match="head_dim"):
            make_kv_cache(t, 2, 2, 16, 128)


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
        a, _ = greedy(pipe.engine, [5, 6, 7, 8, 9, 10])
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
    from mixqrt.generation.generate import generate_step, stream_generate
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
    from mixqrt.generation.speculative import make_drafter
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
    from mixqrt.commands.evaluate import perplexity
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
    from mixqrt.commands.bench import bench
    rows = bench(lm, threads=(1,), n_prompt=16, n_gen=4, ttft_prompt=8, repeats=1, depth=64, kv_type="f16",
                 progress=False, probe_bytes=1 << 20, probes=1)
    r = rows[0]
    assert r["depth"] == 64 and r["kv_type"] == "f16" and r["kv_bytes_per_token"] == ROW_F32 / 2
    assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0
    with pytest.raises(GenerationError, match="context"):
        bench(lm, threads=(1,), n_prompt=16, n_gen=4, repeats=1, depth=257, progress=False,
              probe_bytes=1 << 20, probes=1)


def test_bench_default_kv_type_is_the_default(lm, monkeypatch):
    """Without kv_type, bench measures what a Pipeline or Engine would use (default_kv_type: its --help
    says so), not the bare graph's f32 cache. The tiny model's head_dim 16 gets f32 from it, so the
    test makes the default f16 to tell the two apart."""
    from mixqrt.commands.bench import bench
    from mixqrt.models import kv_cache
    assert lm.model.kv_type == "f32"
    monkeypatch.setattr(kv_cache, "default_kv_type", lambda head_dim: "f16")
    r = bench(lm, threads=(1,), n_prompt=16, n_gen=2, ttft_prompt=8, repeats=1, progress=False,
              probe_bytes=1 << 20, probes=1)[0]
    assert r["kv_type"] == "f16" and r["kv_bytes_per_token"] == ROW_F32 / 2


def test_inspect_reports_kv_bytes(tiny_f32_path):
    from mixqrt.commands.inspect_model import inspect_model
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
        default = "f32" if cmd == "ppl" else DEFAULT_KV_TYPE      # ppl measures the model itself unless told
        assert "--kv-type" in text and f"default {default}" in text, cmd
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


# ------------------------------------------------------------------ the prompt cache over a packed cache
class PackedStub(BlockTrimCache):
    """The packed cache's contract (mixqrt.kv.packed.PackedKVCache: BLOCK, exportable_blocks,
    export_block, import_block, a trim down to a block start) over float rows, lossless: an engine
    over it must give the plain tokens."""
    BLOCK = 64

    def _rows(self, b0, b1):
        return self.stacked[:, :, b0 * self.BLOCK:b1 * self.BLOCK]

    def exportable_blocks(self) -> int:
        return self.offset // self.BLOCK

    def export_block(self, b: int) -> np.ndarray:
        assert 0 <= b < self.offset // self.BLOCK, "only complete blocks are exported"
        return np.ascontiguousarray(self._rows(b, b + 1)).view(np.uint8).reshape(-1)

    def import_block(self, b: int, data: np.ndarray) -> None:
        assert data.dtype == np.uint8 and data.ndim == 1 and b == self.offset // self.BLOCK
        self._rows(b, b + 1)[...] = data.view(self.dtype).reshape(self._rows(0, 1).shape)
        self.offset = (b + 1) * self.BLOCK

    def copy_from(self, src, n: int) -> int:
        for b in range(min(n // self.BLOCK, src.exportable_blocks())):
            self.import_block(b, src.export_block(b))
        return self.offset

    def export_tail(self, b: int) -> np.ndarray:
        assert b == self.offset // self.BLOCK and self.offset % self.BLOCK
        return np.ascontiguousarray(self.stacked[:, :, b * self.BLOCK:self.offset]).view(np.uint8).reshape(-1)

    def import_tail(self, b: int, data: np.ndarray, m: int, rows: int) -> None:
        assert b == self.offset // self.BLOCK and not self.offset % self.BLOCK and 0 < rows <= m
        shape = self.stacked[:, :, :m].shape
        self.stacked[:, :, b * self.BLOCK:b * self.BLOCK + rows] = data.view(self.dtype).reshape(shape)[:, :, :rows]
        self.offset = b * self.BLOCK + rows


def test_packed_prompt_cache_reuses_whole_blocks(lm):
    rng = np.random.default_rng(3)
    p150 = rng.integers(3, 400, size=150).tolist()
    other = p150[:100] + rng.integers(3, 400, size=40).tolist()
    with Engine(lm) as plain:
        want = [greedy(plain, x, cache_prompt=False)[0] for x in (p150, other)]
    mp = pytest.MonkeyPatch()
    a = lm.model.args
    mp.setattr(lm.model, "make_cache", lambda max_len=None, kv_type=None, **kw: PackedStub(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, int(max_len or a.max_position_embeddings)))
    try:
        with Engine(lm, kv_cache_bytes=64 << 20) as eng:
            from mixqrt.generation.prompt_cache import BlockTree
            assert isinstance(eng._cache.tree, BlockTree)
            got1, last1 = greedy(eng, p150)
            got2, last2 = greedy(eng, p150)               # 149 tokens from the cache: 2 whole blocks + the tail
            got3, last3 = greedy(eng, other)              # shares 100 tokens: 1 whole block
            got4, last4 = greedy(eng, p150, cache_salt="x")    # another salt: nothing
            assert (last1.cached_tokens, last2.cached_tokens, last3.cached_tokens, last4.cached_tokens) == (0, 149, 64, 0)
            assert got1 == got2 == got4 == want[0] and got3 == want[1]
            two = list(eng.submit(p150, max_new_tokens=6, temperature=0.0, eos_token_ids=[], n=2, cache_prompt=False))
            for i in range(2):                            # the second choice copies whole blocks, writes the rest
                assert [r.token for r in two if r.index == i and r.token is not None] == want[0]
            st = eng.stats()
            assert st["cache_salts"] == 2 and st["kv_cache_bytes_used"] <= 64 << 20
    finally:
        mp.undo()


def test_block_tree_bound_and_order():
    from mixqrt.generation.prompt_cache import BLOCK_OVERHEAD, BlockTree
    kv = PackedStub(1, 1, 4, 512)
    kv.stacked[...] = np.arange(kv.stacked.size, dtype=np.float32).reshape(kv.stacked.shape)
    kv.offset = 256
    t = BlockTree(64)
    toks = np.arange(256)
    assert t.insert(None, toks, kv) == 4 and t.insert(None, toks, kv) == 0
    per = 64 * 4 + 2 * 64 * 4 * 4 + BLOCK_OVERHEAD
    assert t.bytes == 4 * per and t.leaves == 4
    n, path = t.match(None, toks, limit=255)
    assert n == 192 and len(path) == 3
    fresh = PackedStub(1, 1, 4, 512)
    assert t.copy_into(path, fresh) == 192 and np.array_equal(fresh.stacked[:, :, :192], kv.stacked[:, :, :192])
    t.evict(2 * per)                                      # the deepest blocks go first: the chain stays whole
    assert t.match(None, toks)[0] == 128 and t.evictions == 2
    t.clear()
    assert t.bytes == 0 and not t.roots and len(t) == 0


def test_generate_shows_prefill_progress_of_long_prompts(capsys):
    """`mixqrt generate` on a long prompt: a bar of the engine's prefilled tokens on stderr until the
    first piece; every piece passes through unchanged (and nothing is drawn with -q)."""
    import time

    from mixqrt.cli import PROGRESS_PROMPT, _prefill_progress

    class Eng:
        t0 = None

        def stats(self):
            if self.t0 is None:
                self.t0 = time.monotonic()
                return {"prompt_tokens": 0, "prefill_tokens": 0}
            return {"prompt_tokens": 2 * PROGRESS_PROMPT, "prefill_tokens": PROGRESS_PROMPT}

    class Pipe:
        engine = Eng()

    def pieces():
        time.sleep(0.8)
        yield from "abc"
    assert list(_prefill_progress(Pipe(), pieces(), quiet=False)) == list("abc")
    assert "prompt" in capsys.readouterr().err
    assert list(_prefill_progress(Pipe(), pieces(), quiet=True)) == list("abc")
    assert capsys.readouterr().err == ""


class Opaque(KVCache):
    """A cache type with neither float rows nor blocks to copy out (a packed cache without
    export_blocks): never shared, each request and each choice prefills its own."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        del self.stacked


def test_a_cache_without_rows_or_blocks_is_not_shared(lm):
    prompt = list(range(5, 40))
    with Engine(lm) as plain:
        want, _ = greedy(plain, prompt, cache_prompt=False)
    mp = pytest.MonkeyPatch()
    a = lm.model.args
    mp.setattr(lm.model, "make_cache", lambda max_len=None, kv_type=None, **kw: Opaque(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, int(max_len or a.max_position_embeddings)))
    try:
        with Engine(lm) as eng:
            assert not eng._cache.shareable
            assert greedy(eng, prompt)[0] == want
            got, last = greedy(eng, prompt)
            assert got == want and last.cached_tokens == 0 and eng.stats()["cache_nodes"] == 0
            two = list(eng.submit(prompt, max_new_tokens=6, temperature=0.0, eos_token_ids=[], n=2))
            for i in range(2):
                assert [r.token for r in two if r.index == i and r.token is not None] == want
    finally:
        mp.undo()


def wait_for(cond, tries: int = 500) -> None:
    """Poll until cond() (the engine thread gets there on its own; no time is asserted)."""
    import time
    for _ in range(tries):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("the engine never got there")


def test_making_room_keeps_the_waiting_requests_own_prefix(lm):
    """Room for a waiting request is made by evicting other cached runs first, not the prefix it
    is about to reuse."""
    shared = list(range(3, 60))
    with Engine(lm, kv_cache_bytes=0) as off:
        c = off._cache
    with Engine(lm, kv_cache_bytes=1 << 20, max_slots=2) as eng:
        greedy(eng, shared + [7])                                  # the shared prefix is cached first
        for i in range(3):                                         # then other runs, more recent
            greedy(eng, [100 + i] * 50)
        wait_for(lambda: len(eng._cache.tree) == 4)                # every finished run is in the tree
        busy = eng.submit(list(range(200, 210)), max_new_tokens=40, temperature=0.0, eos_token_ids=[], buffer=1)
        next(busy)                        # then its unread buffer pauses it: a running slot of <= 50 rows
        wait_for(lambda: busy.paused)
        assert c.bytes_for(10) == c.bytes_for(51)
        tree = eng._cache.tree
        cap = tree.bytes + eng._cache.busy_bytes() + c.bytes_for(len(shared) + 1) - 1000
        eng._cache.capacity = cap                                  # tight: room needs one eviction
        _, last = greedy(eng, shared + [9])
        busy.cancel()
        assert last.cached_tokens == len(shared) and tree.evictions >= 1


# ------------------------------------------------------------------ benchmarks/long_context.py's report
def test_long_context_report_from_raw_files(tmp_path, monkeypatch):
    """The page is rebuilt from the raw files: llama-bench jsonl (several depths in one file or one
    per file), mixqrt bench JSON; llama.cpp's best per depth, ratios, loads; long prompts apart."""
    import argparse
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import long_context as lc
    monkeypatch.setattr(lc, "DATA", tmp_path)
    monkeypatch.setattr(lc, "DOC", tmp_path / "page.md")

    def lcpp(name, rows, load="# load 1.00 2.00 3.00 -> 4.00 5.00 6.00"):
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (tmp_path / name).with_suffix(".err").write_text(load + "\n")
    base = {"flash_attn": 1, "type_k": "f16"}
    lcpp("llamacpp-Q4_0-fa1-f16-d0_4096.jsonl", [
        {**base, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 200.0},
        {**base, "n_prompt": 0, "n_gen": 32, "n_depth": 0, "avg_ts": 60.0},
        {**base, "n_prompt": 512, "n_gen": 0, "n_depth": 4096, "avg_ts": 150.0},
        {**base, "n_prompt": 0, "n_gen": 32, "n_depth": 4096, "avg_ts": 40.0}])
    lcpp("llamacpp-Q4_0-fa1-q8_0-d4096.jsonl", [
        {**base, "type_k": "q8_0", "n_prompt": 0, "n_gen": 32, "n_depth": 4096, "avg_ts": 45.0}])
    lcpp("llamacpp-Q4_0-fa1-f16-pp16384.jsonl", [{**base, "n_prompt": 16384, "n_gen": 0, "n_depth": 0, "avg_ts": 70.0}])
    for d, tg in ((0, 80.0), (4096, 64.0)):
        (tmp_path / f"mixqrt-f16-d{d}.json").write_text(json.dumps({
            "loadavg_before": "2.0 1 1", "loadavg_after": "3.0 1 1", "result": {
                "kv_type": "f16", "depth": d, "pp_tok_s": 300.0, "tg_tok_s": tg, "kv_bytes_per_token": 12288,
                "peak_rss_bytes": 1 << 29, "n_prompt": 512, "depth_fill_seconds": 1.0}}))
    (tmp_path / "mixqrt-f16-pp16384.json").write_text(json.dumps({
        "loadavg_before": "2.0 1 1", "loadavg_after": "3.0 1 1", "result": {
            "kv_type": "f16", "depth": 0, "pp_tok_s": 140.0, "tg_tok_s": 1.0, "kv_bytes_per_token": 12288,
            "peak_rss_bytes": 1 << 29, "n_prompt": 16384, "model_bytes": 1 << 28, "file_bytes": 1 << 28}}))
    a = argparse.Namespace(kv_types="f16", n_prompt=512, n_gen=32, threads=2, repetitions=1, plot="")
    lc._N_PROMPT["n"] = 512
    lc.report(a)
    page = (tmp_path / "page.md").read_text()
    assert "| 4,096 | f16 | 300.0 | 64.0 | 0.80x | 150.0 (Q4_0 fa1 f16) | 45.0 (Q4_0 fa1 q8_0) | 2.00x | 1.42x |" in page
    assert "| 16,384 | f16 | 140.0 | 70.0 (Q4_0 fa1 f16) | 2.00x |" in page
    assert "1.00/4.00" in page and "| Q4_0 | 1 | q8_0 | 4,096 |" in page


def test_eight_16k_slots_fit_one_gib_with_the_default_kv_type():
    """Issue 41's memory goal, by the engine's own accounting: with the default KV type, 8 running
    requests of 16,384 tokens each fit kv_cache_bytes = 1 GiB on Qwen2.5-0.5B's shape (24 layers,
    2 KV heads of 64)."""
    from mixqrt.generation.prompt_cache import PromptCache
    if DEFAULT_KV_TYPE in ("f32", "f16"):
        pytest.skip("the default KV type is a float one in this build (the packed cache is not in)")

    class Shape:                       # just what PromptCache reads of a model
        kv_type = DEFAULT_KV_TYPE

        def make_cache(self, max_len=None, kv_type=None):
            return make_kv_cache(kv_type or self.kv_type, 24, 2, 64, max_len or 32768)

        def kv_bytes_per_token(self, kv_type=None):
            return kv_bytes_per_token(kv_type or self.kv_type, 24, 2, 64)
    c = PromptCache(Shape(), 32768, 1 << 30)
    assert c.max_rows(8) >= 16384 and 8 * c.bytes_for(16384) <= 1 << 30
