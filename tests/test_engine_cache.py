"""mixqrt.generation.prompt_cache: the prompt cache's radix tree (longest prefix = brute force, salts never
cross, LRU evicts leaves only, lookups do not scan), its memory count against what is allocated,
KVCache.resident_bytes against the pages the kernel reports, and the Engine's cache_salt /
cache_prompt. Nothing asserts on time."""
from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixqrt.models.kv_cache import KVCache
from mixqrt.generation.engine import Engine
from mixqrt.generation.prompt_cache import NODE_OVERHEAD, SALT_OVERHEAD, PrefixTree, common_prefix
from mixqrt.errors import GenerationError

SALTS = [None, "a", "b", "a:b"]


class Rows:
    """K/V rows whose values name (salt, prefix): a copied row says exactly where it came from."""

    def __init__(self):
        self.ids: dict = {}

    def id(self, salt, prefix: tuple) -> float:
        return float(self.ids.setdefault((salt, prefix), len(self.ids) + 1))

    def of(self, salt, toks) -> np.ndarray:
        r = np.zeros((2, 1, len(toks), 1))
        for j in range(len(toks)):
            r[:, 0, j, 0] = self.id(salt, tuple(toks[:j + 1]))
        return r


def brute(seqs, salt, q, limit):
    return max([min(common_prefix(np.asarray(s), np.asarray(q)), limit) for t, s in seqs if t == salt] + [0])


def check_tree(tree: PrefixTree) -> None:
    """Counts and structure agree with a walk of the whole tree."""
    nodes, leaves, total = 0, 0, 0
    for salt, root in tree.roots.items():
        assert root.children, "an empty salt tree is kept"
        total += root.nbytes()
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            nodes += 1
            total += n.nbytes()
            assert n.kv.shape[2] == n.tokens.size > 0 and n.kv.flags.c_contiguous
            if n.children:
                for c in n.children.values():
                    assert c.parent is n
                stack.extend(n.children.values())
            else:
                assert n.children is None
                leaves += 1
    assert (nodes, leaves, total) == (len(tree), tree.leaves, tree.bytes)
    order = list(tree.lru)                       # every parent newer than its children
    rank = {id(n): i for i, n in enumerate(order)}
    for n in order:
        if n.parent is not None and id(n.parent) in rank:
            assert rank[id(n.parent)] > rank[id(n)]


ops = st.lists(st.tuples(st.sampled_from(["insert", "match"]), st.sampled_from(SALTS),
                         st.lists(st.integers(0, 3), min_size=1, max_size=12)), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, limit_cut=st.integers(0, 3))
def test_longest_prefix_is_brute_force_and_salts_never_cross(ops, limit_cut):
    tree, rows, seqs = PrefixTree(), Rows(), []
    for op, salt, toks in ops:
        if op == "insert":
            tree.insert(salt, np.asarray(toks), rows.of(salt, toks))
            seqs.append((salt, toks))
        else:
            limit = max(0, len(toks) - limit_cut)
            before = tree.lookup_steps
            n, path = tree.match(salt, np.asarray(toks), limit=limit)
            assert n == brute(seqs, salt, toks, limit)
            assert tree.lookup_steps - before <= max(1, n)     # one node per run, never a scan
            dst = np.zeros((2, 1, 16, 1))
            assert tree.copy_into(path, dst) == n
            # every copied row was computed for this salt and this very prefix
            assert [dst[0, 0, j, 0] for j in range(n)] == [rows.id(salt, tuple(toks[:j + 1])) for j in range(n)]
        check_tree(tree)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, cap=st.integers(0, 6000))
def test_eviction_keeps_the_bound_and_only_drops_leaves(ops, cap):
    tree, rows, seqs = PrefixTree(), Rows(), []
    for op, salt, toks in ops:
        if op == "insert":
            tree.insert(salt, np.asarray(toks), rows.of(salt, toks))
            seqs.append((salt, toks))
            tree.evict(cap)                       # asserts the oldest node is a leaf
            assert tree.bytes <= cap
        else:
            n, path = tree.match(salt, np.asarray(toks))
            assert n <= brute(seqs, salt, toks, len(toks))
            dst = np.zeros((2, 1, 16, 1))
            tree.copy_into(path, dst)
            assert [dst[0, 0, j, 0] for j in range(n)] == [rows.id(salt, tuple(toks[:j + 1])) for j in range(n)]
        check_tree(tree)
    tree.clear()
    assert tree.bytes == 0 and len(tree) == 0 and not tree.roots


def test_lru_keeps_the_recently_used_prefix():
    tree, rows = PrefixTree(), Rows()
    for t in ([1, 2, 3], [1, 2, 4], [5, 6]):
        tree.insert(None, np.asarray(t), rows.of(None, t))
    tree.match(None, np.asarray([1, 2, 3, 9]))             # [1,2] and [3] are now the newest
    before = tree.bytes
    tree.evict(before - 1)                                 # one node goes: the oldest leaf, [4]
    assert tree.match(None, np.asarray([1, 2, 4]))[0] == 2 and tree.match(None, np.asarray([5, 6]))[0] == 2
    tree.evict(0)
    assert len(tree) == 0 and tree.evictions == 4          # [4], [5,6], [3], [1,2]


@pytest.mark.parametrize("entries", [10, 3000])
def test_lookup_does_not_scan_the_entries(entries):
    """The cost of a lookup (nodes visited) is the same with 10 or 3,000 cached prompts."""
    tree = PrefixTree()
    rng = np.random.default_rng(0)
    rows = np.zeros((2, 1, 8, 1))
    for i in range(entries):                               # distinct prompts, as a flood sends
        tree.insert(None, np.concatenate([[i], rng.integers(0, 100, 7)]), rows)
    s0 = tree.lookup_steps
    assert tree.match(None, np.asarray([entries // 2, 1, 2]))[0] >= 1
    assert tree.match(None, np.asarray([10 ** 6, 1, 2]))[0] == 0
    assert tree.match("other", np.asarray([0, 1, 2]))[0] == 0
    assert tree.lookup_steps - s0 == 1                    # the one run that matched


def test_counted_bytes_match_what_is_allocated():
    """The tree's count (rows + tokens + NODE_OVERHEAD per node + SALT_OVERHEAD per salt) is within
    15 % of the Python heap it really takes (tracemalloc, which numpy's data reports to)."""
    rng = np.random.default_rng(1)
    rows = np.zeros((4, 2, 16, 16), np.float32)           # 2 layers x K/V, 2 heads, head_dim 16
    for length in (1, 12):
        tree = PrefixTree()
        seqs = [rng.integers(0, 5000, length) for _ in range(1500)]
        gc.collect()
        tracemalloc.start()
        try:
            t0 = tracemalloc.get_traced_memory()[0]
            for i, s in enumerate(seqs):
                tree.insert(f"s{i % 7}", s, rows)
            gc.collect()
            real = tracemalloc.get_traced_memory()[0] - t0
        finally:
            tracemalloc.stop()
        assert 0.85 * tree.bytes <= real <= 1.15 * tree.bytes, (length, real, tree.bytes)
        before = tree.bytes
        tree.evict(before // 2)
        assert tree.bytes <= before // 2


# ============================================================================ KVCache pages
def _resident_pages(arr: np.ndarray) -> int:
    """Pages of arr's buffer the kernel has resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    addr = arr.__array_interface__["data"][0]
    n = (arr.nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    assert addr % mmap.PAGESIZE == 0
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(arr.nbytes), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore page counts: Linux")
@pytest.mark.parametrize("layers,heads,dim,max_len,dtype,rows", [
    (2, 2, 16, 256, np.float32, 5),        # the tiny model: one page per (layer, K/V, head)
    (2, 2, 16, 256, np.float32, 200),
    (3, 2, 24, 100, np.float32, 7),        # runs of 9,600 bytes: pages shared by two runs
    (1, 4, 8, 64, np.float16, 64),
    (2, 1, 64, 4096, np.float16, 1)])
def test_kvcache_resident_bytes_are_the_pages_written(layers, heads, dim, max_len, dtype, rows):
    kv = KVCache(layers, heads, dim, max_len, dtype)
    assert _resident_pages(kv.stacked) == 0
    x = np.ones((rows, heads, dim), dtype)
    for li in range(layers):
        kv.write(li, x, x, 0)
    assert _resident_pages(kv.stacked) * mmap.PAGESIZE == kv.resident_bytes(rows)


# ============================================================================ the Engine
@pytest.fixture(scope="module")
def lm(tiny_f32_path):
    from mixqrt.pipeline import LoadedModel
    return LoadedModel(tiny_f32_path)


def run(eng, prompt, **kw):
    out = list(eng.submit(prompt, max_new_tokens=3, temperature=0.0, eos_token_ids=[], **kw))
    return [r.token for r in out if r.token is not None], out[-1].cached_tokens


def test_engine_salts_isolate_and_cache_prompt_false(lm):
    secret = [5, 9, 13, 17, 21, 25, 29, 33]
    with Engine(lm) as eng:
        toks, cached = run(eng, secret + [40], cache_salt="alice")
        assert cached == 0
        # another salt, or none, sees nothing of it; the same salt hits
        assert run(eng, secret + [41], cache_salt="bob")[1] == 0
        assert run(eng, secret + [41])[1] == 0
        assert run(eng, secret + [42], cache_salt="alice")[1] == len(secret)
        # the answer is cached under the same salt only
        assert run(eng, secret + [40] + toks[:2] + [7], cache_salt="alice")[1] == len(secret) + 3
        assert run(eng, secret + [40] + toks[:2] + [7], cache_salt="bob")[1] == len(secret)   # bob's own secret + [41]
        # cache_prompt=False neither reads nor stores
        assert run(eng, secret + [42], cache_salt="alice", cache_prompt=False)[1] == 0
        n = eng.stats()["cache_nodes"]
        run(eng, [3, 1, 4, 1, 5], cache_prompt=False)
        assert eng.stats()["cache_nodes"] == n and run(eng, [3, 1, 4, 1, 5, 9])[1] == 0
        assert eng.stats()["cache_salts"] == 3
        with pytest.raises(GenerationError, match="cache_salt"):
            eng.submit([1], cache_salt=5)
        with pytest.raises(GenerationError, match="cache_salt"):
            eng.submit([1], cache_salt="x" * 2000)
        with pytest.raises(GenerationError, match="cache_prompt"):
            eng.submit([1], cache_prompt="no")
    with Engine(lm, kv_cache_bytes=0) as off:
        run(off, secret + [40])
        assert run(off, secret + [40])[1] == 0 and off.stats()["cache_nodes"] == 0


def test_engine_flood_keeps_the_bound_and_lookups_flat(lm):
    """Many distinct short requests: the counted bytes stay under the bound, cached nodes are
    evicted, and a lookup still visits at most one node per run of its prompt."""
    with Engine(lm) as probe:
        row = probe._cache.row_bytes
    cap = SALT_OVERHEAD + 40 * (6 * row + 24 + NODE_OVERHEAD)         # about 40 short entries
    with Engine(lm, kv_cache_bytes=cap, max_slots=4) as eng:
        reqs = [eng.submit([i % 400 + 3, i // 400 + 3, 7], max_new_tokens=3, eos_token_ids=[], temperature=0.0)
                for i in range(60)]
        for r in reqs:
            list(r)
        assert eng.stats()["kv_cache_bytes_used"] <= cap
        steps = eng._cache.tree.lookup_steps
        st = eng.stats()
        assert st["cache_evictions"] > 0 and st["idle_caches"] <= 40
        run(eng, [59 % 400 + 3, 3, 7, 9])
        assert eng._cache.tree.lookup_steps - steps <= 2        # its run when admitted, again when stored
        assert eng.stats()["kv_cache_bytes_used"] <= cap
