"""Every row of a multi-row product is bit for bit the single-row (T = 1) product of that row, on every
ISA tier: the few-row kernels (batched decode, a speculative verify of up to 16 drafts + 1) and the
GEMM (prefill) fold each row as the decode kernels do (docs/kernels.md, "Products of several rows").
What holds: q4x / q6x / q3x (every matrix of a 2356t model) at any T on every tier; the row formats
at any T on the generic and AVX2 tiers and up to 17 rows (set_gemm_min_t's default 18) on AVX-512,
whose row-format GEMM folds in its own order. End to end: a T-row forward of a 2356t model gives
the logits of T single decode steps exactly."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as _settings, strategies as st

import mixqrt.platform.isa as isa
from mixqrt import ops
from mixqrt._kernels import _ops
from mixqrt.formats import layout
from mixqrt.formats.codec import to_storage
from mixqrt.formats.qtensor import QTensor

from test_kernels_ref import random_qtensor

ROW_FMTS = sorted(layout.PACKED)                                 # q2c q3p q3u q4 q5g q6 q8
X_FMTS = sorted(layout.INTERLEAVED)                              # q3x q4x q6x
MAX_T = 17                                                        # speculative.MAX_DRAFT + 1


def settings(**kw):
    return _settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, **kw)


def weight(fmt, n, k, rng):
    if fmt in layout.INTERLEAVED:
        base = layout.INTERLEAVED[fmt][0]
        return to_storage(QTensor(base, (n, k), random_qtensor(base, n, k, rng).raw))
    return random_qtensor(fmt, n, k, rng)


def assert_rows_are_single_rows(w, x, ts):
    one = np.concatenate([ops.matmul(w, x[t:t + 1]) for t in range(len(x))])
    for t in ts:
        y = ops.matmul(w, x[:t])
        assert np.array_equal(y, one[:t]), (t, float(np.abs(y - one[:t]).max()))
        with ops.local_threads(1):
            assert np.array_equal(ops.matmul(w, x[:t]), one[:t]), t


@pytest.mark.parametrize("fmt", ROW_FMTS + X_FMTS)
@settings(max_examples=12)
@given(n=st.integers(1, 9), k=st.sampled_from([1, 31, 33, 64, 255, 257, 896, 1000]), t=st.integers(2, MAX_T),
       seed=st.integers(0, 2**31), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_rows_equal_single_rows(tier, fmt, n, k, t, seed, scale):
    """Odd shapes (row formats: any height; interleaved: whole groups of 16), T in 2..17, on the pool
    and on one thread."""
    rng = np.random.default_rng(seed)
    n = 16 * n if fmt in layout.INTERLEAVED else 7 * n - 3
    w = weight(fmt, n, k, rng)
    x = (rng.standard_normal((t, k)) * scale).astype(np.float32)
    assert_rows_are_single_rows(w, x, [t])


@pytest.mark.parametrize("fmt", ROW_FMTS + X_FMTS)
def test_rows_equal_single_rows_every_t(tier, fmt):
    """Every T from 1 to 17 on one shape (the few-row kernels' compiled row counts, the tiles' tails)."""
    rng = np.random.default_rng(7)
    n = 48 if fmt in layout.INTERLEAVED else 45
    w = weight(fmt, n, 257, rng)
    x = rng.standard_normal((MAX_T, 257)).astype(np.float32)
    assert_rows_are_single_rows(w, x, range(1, MAX_T + 1))


@pytest.mark.parametrize("fmt", X_FMTS)
@pytest.mark.parametrize("k", [64, 640, 1088])
def test_interleaved_gemm_rows_equal_single_rows(tier, fmt, k):
    """Prefill-sized products of q4x / q6x / q3x (the GEMM on AVX-512: token groups of 8, K slices of 16
    chunks, padded groups), and 2-8 rows (the few-row kernels)."""
    rng = np.random.default_rng(k)
    w = weight(fmt, 64, k, rng)
    x = rng.standard_normal((41, k)).astype(np.float32)
    assert_rows_are_single_rows(w, x, [18, 24, 41])
    assert_rows_are_single_rows(w, x[:8], [2, 3, 5, 8])
    before_max = _ops.set_few_max_t(None)
    try:
        _ops.set_few_max_t(0)                       # 9+ rows through the GEMM too
        assert_rows_are_single_rows(w, x, [9, 18, 24, 41])
    finally:
        _ops.set_few_max_t(before_max)


@pytest.mark.parametrize("fmt", X_FMTS)
def test_interleaved_verify_rows_equal_single_rows(tier, fmt):
    """9-65 rows (a speculative verify of up to 64 drafts): on AVX-512 the few-row kernels over L2 row
    blocks, the rows in groups of 2-8 (_ops.set_few_max_t); every T, on a matrix of several blocks."""
    rng = np.random.default_rng(11)
    w = weight(fmt, 640, 1088, rng)
    x = rng.standard_normal((65, 1088)).astype(np.float32)
    assert_rows_are_single_rows(w, x, [9, 10, 16, 17, 23, 33, 47, 63, 64, 65])


@pytest.mark.parametrize("fmt", ["q3p", "q3u", "q4", "q6", "q8", "q2c"])
@pytest.mark.parametrize("lean,fold", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("k", [256, 257, 2048])
def test_avx512_rows_follow_the_decode_kernel(fmt, lean, fold, k):
    """AVX-512 row formats: the T = 1 kernel depends on the format, the chunk count, the row length and
    the switches (lean paths, q6 fold); the rows of a 2-17 row product follow whichever it is, also
    for heights that leave the 4-row tiles a tail and for products that span several row blocks."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    before, old_lean, old_fold = isa.current(), _ops.set_lean_mv(lean), _ops.set_q6_fold(fold)
    try:
        isa.set_isa("avx512")
        rng = np.random.default_rng(k)
        w = weight(fmt, 301 if k < 1000 else 150, k, rng)
        x = rng.standard_normal((MAX_T, k)).astype(np.float32)
        assert_rows_are_single_rows(w, x, [2, 4, 9, MAX_T])
    finally:
        _ops.set_lean_mv(old_lean)
        _ops.set_q6_fold(old_fold)
        isa.set_isa(before)


@pytest.fixture(scope="module")
def tiny_2356t(tmp_path_factory):
    from mixqrt.io import mxq
    from mixqrt.pipeline import LoadedModel
    from mixqrt.quantize.convert import quantize_model
    from tinymodel import make_tiny_hf_model
    base = tmp_path_factory.mktemp("rows_exact")
    hf = make_tiny_hf_model(base / "m", arch="qwen2", tied=True, seed=0)
    out = base / "q.mxq"
    # the FFN's gate and up as q3p (stored q3x), as on real models (the tiny one would pick q4)
    quantize_model(str(hf), "2356t", out, progress=False, overrides=["ffn_gate=q3p", "ffn_up=q3p"])
    fmts = {t.fmt for t in mxq.MxqFile(str(out)).tensors.values() if len(t.shape) == 2}
    assert fmts == {"q3x", "q4x", "q6x"}, fmts
    return LoadedModel(out)


@pytest.mark.parametrize("split", [(17,), (5, 9), (1, 17, 2), (40,)])
def test_model_rows_equal_decode_steps(tier, tiny_2356t, split):
    """A 2356t model's logits for forwards of several rows (a prompt, then a speculative verify of k+1
    rows) equal the logits of single-token decode steps exactly, the KV cache filled either way."""
    m = tiny_2356t.model
    toks = np.random.default_rng(len(split)).integers(0, m.args.vocab_size, sum(split))
    c_rows, c_steps = m.make_cache(128), m.make_cache(128)
    rows, pos = [], 0
    for n in split:
        rows.append(m(toks[pos:pos + n], c_rows, pos))
        pos += n
    steps = np.concatenate([m(toks[i:i + 1], c_steps, i) for i in range(pos)])
    assert np.array_equal(np.concatenate(rows), steps)
