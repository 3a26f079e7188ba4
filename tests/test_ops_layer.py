"""The float ops of a Qwen2 layer on every ISA tier against mixqrt.ops.ref (float64 inside), and
the native pool: thread counts, results independent of the thread count, the bandwidth probe."""
import os

import numpy as np
import pytest

import mixqrt.platform.isa as isa
from mixqrt import ops
from mixqrt.ops import ref as ops_ref
from mixqrt._kernels import _ops

EPS = 2.0 ** -24


@pytest.mark.parametrize("d", [1, 31, 33, 896, 3584])
def test_rmsnorm(tier, d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((3, d)).astype(np.float32) * 4
    w = rng.standard_normal(d).astype(np.float32)
    y = ops.rmsnorm(x, w, 1e-6)
    ref = ops_ref.rmsnorm(x, w, 1e-6)
    np.testing.assert_allclose(y, ref, rtol=8 * EPS, atol=8 * EPS * np.abs(ref).max())


@pytest.mark.parametrize("theta", [1e4, 1e6])
@pytest.mark.parametrize("dh", [64, 128])
def test_rope(tier, theta, dh):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 3, dh)).astype(np.float32)
    pos = np.array([0, 1, 77, 4095, 32767])
    y = ops.rope(x, pos, theta)
    np.testing.assert_allclose(y, ops_ref.rope(x, pos, theta), rtol=0, atol=4 * EPS * 8)
    assert not np.shares_memory(y, x)


@pytest.mark.parametrize("n", [1, 31, 33, 4864, 18944])
def test_silu_mul(tier, n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 8).astype(np.float32)
    g[:3] = [-200.0, 100.0, 0.0][: min(3, n)]
    u = rng.standard_normal(n).astype(np.float32)
    ref = ops_ref.silu_mul(g, u).astype(np.float64)
    y = ops.silu_mul(g, u)
    assert np.isfinite(y).all()
    assert (np.abs(y - ref) <= 8 * EPS * np.abs(ref) + 1e-37).all()


@pytest.mark.parametrize("n", [1, 31, 33, 255, 257, 896, 4864])
def test_fast_exp_paths_are_bit_identical_across_tiers(n):
    """SiLU and the fast softmax run exp on 4 vectors at a time in the AVX2 / AVX-512 tiers and one
    value at a time in the generic one (and in every tier's tail): the same operations per value, so
    the same bits, over the whole range, its edges, out-of-range values (libm) and NaN / inf."""
    rng = np.random.default_rng(n)
    g = (rng.uniform(-100, 100, n)).astype(np.float32)
    edge = np.array([-87.0, 88.0, -87.00001, 88.00001, 0.0, -0.0, 1e-30, -200.0, np.inf, -np.inf, np.nan],
                    np.float32)
    g[: min(n, edge.size)] = edge[: min(n, edge.size)]
    u = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal((2, n)) * 40).astype(np.float32)
    before = isa.current()
    try:
        outs = []
        for t in isa.available():
            isa.set_isa(t)
            outs.append((ops.silu_mul(g, u), ops.softmax(x, fast=True)))
    finally:
        isa.set_isa(before)
    for y, sm in outs[1:]:
        np.testing.assert_array_equal(y, outs[0][0])
        np.testing.assert_array_equal(sm, outs[0][1])


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("n", [1, 17, 1000, 32768])
def test_softmax(tier, fast, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, n)) * 30).astype(np.float32)
    x[0, 0] = -1e30 if n > 1 else x[0, 0]       # far outside the fast range: exact fallback
    x[1, : n // 2] = -np.inf
    ref = ops_ref.softmax(x).astype(np.float64)
    y = ops.softmax(x, fast=fast)
    # per-element relative error: exp (2 ulp) + the float32 rounding of x - max, amplified by
    # |x - max|, + normalisation (sum of n terms); plus the denormal spacing
    arg = np.abs(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    arg[~np.isfinite(arg)] = 0
    bound = (8 + 2 * np.log2(n + 1) + arg) * EPS * ref + 1e-44
    assert (np.abs(y - ref) <= bound).all(), np.max(np.abs(y - ref) / (ref + 1e-38))


def test_fast_exp_range():
    xs = np.concatenate([np.linspace(-87, 88, 20001), [-200.0, -87.5, 88.5, 100.0]]).astype(np.float32)
    got = np.array([_ops.expf_fast(float(v)) for v in xs], np.float64)
    ref = np.exp(xs.astype(np.float64))
    inr = (xs >= -87) & (xs <= 88)
    assert np.max(np.abs(got[inr] - ref[inr]) / ref[inr]) < 4 * EPS
    assert got[-1] == np.inf and got[-4] == np.float32(np.exp(np.float32(-200.0)))


@pytest.mark.parametrize("t,pos0", [(1, 0), (1, 40), (3, 10), (17, 0), (12, 5)])
@pytest.mark.parametrize("kv", [np.float32, np.float16])
def test_attention(tier, t, pos0, kv):
    rng = np.random.default_rng(t * 100 + pos0)
    hq, hkv, dh, s = 14, 2, 64, 64
    q = rng.standard_normal((t, hq, dh)).astype(np.float32)
    k = rng.standard_normal((hkv, s, dh)).astype(kv)
    v = rng.standard_normal((hkv, s, dh)).astype(kv)
    y = ops.attention(q, k, v, pos0)
    ref = ops_ref.attention(q, k.astype(np.float32), v.astype(np.float32), pos0)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.sqrt(pos0 + t))


@pytest.mark.parametrize("t,pos0,window", [(1, 0, 4), (1, 40, 16), (1, 15, 16), (1, 16, 16), (3, 10, 5),
                                           (17, 0, 8), (12, 5, 1), (40, 20, 64), (150, 3, 32)])
@pytest.mark.parametrize("kv", [np.float32, np.float16])
def test_attention_window(tier, t, pos0, window, kv):
    """Sliding-window attention (Gemma 3's local layers) against the numpy reference: a query at
    position p sees keys p-window+1 .. p; decode runs the C kernel over the window, prefill numpy."""
    rng = np.random.default_rng(t * 1000 + pos0 + window)
    hq, hkv, dh, s = 8, 2, 32, 256
    q = rng.standard_normal((t, hq, dh)).astype(np.float32)
    k = rng.standard_normal((hkv, s, dh)).astype(kv)
    v = rng.standard_normal((hkv, s, dh)).astype(kv)
    y = ops.attention(q, k, v, pos0, window=window)
    ref = ops_ref.attention(q, k.astype(np.float32), v.astype(np.float32), pos0, window=window)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.sqrt(min(pos0 + t, window) + 1))
    if pos0 + t > window:     # the window changes the answer (the test is not vacuous)
        full = ops_ref.attention(q, k.astype(np.float32), v.astype(np.float32), pos0)
        assert not np.allclose(full[-1], ref[-1])
    with pytest.raises(Exception, match="window"):
        ops.attention(q, k, v, pos0, window=0)


def test_rope_freqs_equals_rope_at_plain_frequencies():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    pos = np.array([0, 5, 100, 4000])
    inv = 1.0 / 1e4 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(ops.rope_freqs(x, pos, inv), ops_ref.rope(x, pos, 1e4), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ops.rope_freqs(x, pos, inv / 8.0), ops_ref.rope(x, pos / 8.0, 1e4), atol=1e-4)


@pytest.mark.parametrize("hq,hkv,dh", [(14, 2, 64), (9, 3, 64), (28, 4, 128), (8, 1, 256), (6, 2, 48), (4, 2, 8),
                                        (16, 2, 192), (12, 2, 64), (5, 1, 128), (4, 4, 64), (10, 2, 80), (16, 2, 112)])
@pytest.mark.parametrize("kv", [np.float32, np.float16])
def test_attention_bit_identical_across_tiers(hq, hkv, dh, kv):
    """The grouped decode attention (AVX-512: 16-key blocks, AVX2: 4-key blocks, head_dim a multiple of 16)
    reduces each dot product in the generic tier's order: every tier gives the same bits, for key counts
    around the block sizes, prefill rows and both cache dtypes."""
    rng = np.random.default_rng(hq * dh)
    before = isa.current()
    try:
        for t, pos0, s in [(1, 0, 40), (1, 3, 40), (1, 15, 40), (1, 16, 40), (1, 33, 40), (3, 30, 40), (9, 0, 40),
                           (1, 299, 300)]:
            q = rng.standard_normal((t, hq, dh)).astype(np.float32)
            k = rng.standard_normal((hkv, s, dh)).astype(kv)
            v = rng.standard_normal((hkv, s, dh)).astype(kv)
            outs = []
            for tier in isa.available():
                isa.set_isa(tier)
                outs.append(ops.attention(q, k, v, pos0))
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
    finally:
        isa.set_isa(before)


@pytest.mark.parametrize("hq,hkv,dh", [(14, 2, 64), (28, 4, 128), (4, 1, 80), (6, 2, 48)])
@pytest.mark.parametrize("t,pos0,s", [(16, 0, 16), (33, 0, 40), (257, 0, 300), (40, 255, 300)])
@pytest.mark.parametrize("kv", [np.float32, np.float16])
def test_prefill_attention_rows_equal_decode(tier, hq, hkv, dh, t, pos0, s, kv):
    """A prefill's rows (head_dim a multiple of 16) are each exactly the single-token decode at their
    position (the KV cache holds the whole prompt): prefill and decode agree bit for bit, for any thread
    count and split over the pool, on every tier. Other head sizes run prompts as BLAS products: the
    same bits at any thread count, close to the reference."""
    rng = np.random.default_rng(t * dh + pos0)
    q = rng.standard_normal((t, hq, dh)).astype(np.float32)
    k = rng.standard_normal((hkv, s, dh)).astype(kv)
    v = rng.standard_normal((hkv, s, dh)).astype(kv)
    rows = np.concatenate([ops.attention(q[i:i + 1], k, v, pos0 + i) for i in range(t)])
    ref = ops_ref.attention(q, k.astype(np.float32), v.astype(np.float32), pos0)
    np.testing.assert_allclose(rows, ref, rtol=0, atol=2e-5 * np.sqrt(pos0 + t))
    n0 = ops.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            got.append(ops.attention(q, k, v, pos0))
        for g in got:
            np.testing.assert_array_equal(g, got[0])
        if dh % 16 == 0:
            np.testing.assert_array_equal(got[0], rows)
        else:
            np.testing.assert_allclose(got[0], ref, rtol=0, atol=2e-5 * np.sqrt(pos0 + t))
    finally:
        ops.set_num_threads(n0)


def test_row_ops_split_over_the_pool_give_the_same_bits():
    """rmsnorm, rope and silu_mul run their rows on the pool above ROWS_POOL_MIN values (prefill):
    the same bits as one row at a time; local_threads(1) keeps them on the calling thread."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 896)).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    qk = rng.standard_normal((300, 16, 64)).astype(np.float32)
    pos = np.arange(7, 307)
    gu = rng.standard_normal((300, 2 * 1000)).astype(np.float32) * 4
    one = (np.concatenate([ops.rmsnorm(x[i:i + 1], w, 1e-6) for i in range(300)]),
           np.concatenate([ops.rope(qk[i:i + 1], pos[i:i + 1], 1e6) for i in range(300)]),
           np.concatenate([ops.silu_mul(gu[i:i + 1, :1000], gu[i:i + 1, 1000:]) for i in range(300)]))
    n0 = ops.get_num_threads()
    try:
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            for threads in (None, 1):
                with ops.local_threads(threads):
                    got = (ops.rmsnorm(x, w, 1e-6), ops.rope(qk, pos, 1e6), ops.silu_mul(gu[:, :1000], gu[:, 1000:]))
                for a, b in zip(got, one):
                    np.testing.assert_array_equal(a, b)
    finally:
        ops.set_num_threads(n0)


def test_attention_bad_args():
    q = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError):
        ops.attention(q, np.zeros((3, 8, 8), np.float32), np.zeros((3, 8, 8), np.float32), 0)
    with pytest.raises(ValueError):
        ops.attention(q, np.zeros((2, 8, 8), np.float32), np.zeros((2, 8, 8), np.float32), 7)


@pytest.mark.parametrize("kv", [np.float32, np.float16])
@pytest.mark.parametrize("pool_min", [0, 10 ** 9])       # on the pool / on the calling thread
def test_attention_batch_equals_per_sequence(tier, kv, pool_min, monkeypatch):
    """decode_batch's one call for B sequences gives each row exactly what attention() gives it."""
    monkeypatch.setattr(ops, "ATTN_BATCH_POOL_MIN", pool_min)
    rng = np.random.default_rng(7)
    hq, hkv, dh = 14, 2, 64
    lens, pos = [64, 33, 300, 1, 128], [63, 0, 299, 0, 77]
    ks = [rng.standard_normal((hkv, s, dh)).astype(kv) for s in lens]
    vs = [rng.standard_normal((hkv, s, dh)).astype(kv) for s in lens]
    q = rng.standard_normal((len(lens), hq, dh)).astype(np.float32)
    y = ops.attention_batch(q, ks, vs, pos)
    for b in range(len(lens)):
        np.testing.assert_array_equal(y[b:b + 1], ops.attention(q[b:b + 1], ks[b], vs[b], pos[b]))


def test_attention_batch_bad_args():
    q = np.zeros((2, 4, 8), np.float32)
    k = [np.zeros((2, 8, 8), np.float32)] * 2
    with pytest.raises(ValueError, match="position 8 of sequence 1"):
        ops.attention_batch(q, k, k, [0, 8])
    with pytest.raises(ValueError, match="2 queries but 1 key caches"):
        ops.attention_batch(q, k[:1], k, [0, 0])
    with pytest.raises(ValueError, match="cache 0"):
        ops.attention_batch(q, [np.zeros((3, 8, 8), np.float32)] * 2, [np.zeros((3, 8, 8), np.float32)] * 2, [0, 0])
    with pytest.raises(ValueError, match="one position per row"):
        ops.attention_batch(q, k, k, [0])


# ----------------------------------------------------------------------------- pool
def test_threads_give_same_results():
    from test_kernels_ref import random_qtensor
    rng = np.random.default_rng(9)
    w = random_qtensor("q3p", 1000, 896, rng)
    x = rng.standard_normal((3, 896)).astype(np.float32)
    n0 = ops.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            assert ops.set_num_threads(n) == n and ops.get_num_threads() == n
            outs.append(ops.matmul(w, x))
            outs.append(ops.matmul(w, x[0]))
        for a, b in zip(outs[::2], outs[2::2]):
            np.testing.assert_array_equal(a, b)
    finally:
        ops.set_num_threads(n0)


def test_default_threads(monkeypatch):
    from mixqrt.platform import tuning
    monkeypatch.setitem(tuning._VALUES, "MIXQRT_NUM_THREADS", tuning.parse("MIXQRT_NUM_THREADS", "3"))
    assert ops.default_num_threads() == 3
    monkeypatch.setitem(tuning._VALUES, "MIXQRT_NUM_THREADS", tuning.parse("MIXQRT_NUM_THREADS", None))
    n = ops.default_num_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    from mixqrt.platform import topology
    monkeypatch.setattr(topology, "cgroup_cpu_limit", lambda *a, **k: 0.5)
    assert ops.default_num_threads() == 1 == topology.usable_cpus()   # one policy: doctor and the pool agree
    with pytest.raises(ValueError, match="MIXQRT_NUM_THREADS"):
        tuning.parse("MIXQRT_NUM_THREADS", "zero")
    with pytest.raises(ValueError):
        ops.set_num_threads(0)


def test_read_bandwidth():
    bw = ops.read_bandwidth(1 << 24, 2, 1)
    assert 1e8 < bw < 1e13


def test_import_starts_no_threads():
    """Importing mixqrt.ops starts nothing; the pool starts on the first op that uses it."""
    import subprocess
    import sys
    code = ("import os, numpy as np\n"
            "n0 = len(os.listdir('/proc/self/task'))\n"
            "import mixqrt.ops as ops\n"
            "assert len(os.listdir('/proc/self/task')) == n0, 'import started threads'\n"
            "assert not ops._pool_started\n"
            "with ops.local_threads(1):\n"
            "    ops.matmul(np.ones((4, 8), np.float32), np.ones(8, np.float32))\n"
            "assert not ops._pool_started, 'a thread-local op started the pool'\n"
            "ops.matmul(np.ones((4, 8), np.float32), np.ones(8, np.float32))\n"
            "assert ops._pool_started and ops.get_num_threads() == ops.default_num_threads()\n")
    import os

    import mixqrt   # run where the imported package lives (CI installs it into a venv)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(mixqrt.__file__))))


def test_read_bandwidth_patterns():
    from mixqrt.platform import isa
    pats = ops.read_bandwidth_patterns(1 << 22, 2, 1)
    assert "scalar-1stream" in pats and all(1e8 < v < 1e13 for v in pats.values())
    # wide-load patterns only where the CPU runs them (never a SIGILL on an older CPU)
    if "avx512" not in isa.available():
        assert not any(k.startswith("avx512") for k in pats)
    with pytest.raises(ValueError, match="pattern"):
        ops._ops.read_bandwidth_pattern("no-such-pattern", 1 << 20, 1, 1)


def test_honest_bound():
    from mixqrt.commands.bench import honest_bound
    assert honest_bound(50e9, [40e9, float("nan")]) == (50e9, None)
    bw, note = honest_bound(50e9, [57e9])
    assert bw == 57e9 and "probe is wrong" in note


def test_bench_notes_steal_and_small_pages():
    """The bench row notes hypervisor steal (>= 2 %) and weights mostly outside 2 MiB pages."""
    from mixqrt.commands.bench import format_rows
    from mixqrt.platform.perf import cpu_jiffies, steal_fraction
    a = cpu_jiffies()
    assert a is None or (len(a) == 2 and 0 <= a[0] <= a[1])
    assert steal_fraction(None, a) is None and steal_fraction((5, 100), (15, 200)) == 0.1
    assert steal_fraction((5, 100), (5, 100)) is None
    row = {"threads": 2, "pp_tok_s": 1.0, "tg_tok_s": 1.0, "ttft_s": 1.0, "peak_rss_bytes": 1 << 20,
           "model_bytes": 1 << 20, "bandwidth_ratio": 0.5, "read_bandwidth_bytes_s": 1e10, "n_prompt": 8,
           "n_gen": 8, "steal_fraction": 0.2, "weights_huge_fraction": 0.1}
    text = format_rows([row], "m")
    assert "took 20 % of the CPU time" in text and "only 10 % of the weights" in text
    quiet = format_rows([{**row, "steal_fraction": 0.0, "weights_huge_fraction": None}], "m")
    assert "NOTE" not in quiet
