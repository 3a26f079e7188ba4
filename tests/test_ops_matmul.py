"""Products from packed weights, every format on every ISA tier, against the numpy emulation of
the integer path (tests/test_kernels_ref.py) and the float64 product of the dequantized weights."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as _settings, strategies as st

import mixqrt.platform.isa as isa
from mixqrt import ops
from mixqrt._kernels import _ops
from mixqrt.errors import KernelError
from mixqrt.formats import layout
from mixqrt.formats.qtensor import QTensor

from test_kernels_ref import (FakeQT, PACKED_FMTS, emulate_matmul, exact_activations, quantize_act_ref,
                        random_qtensor)

DIMS = [1, 31, 33, 255, 257, 896, 4864]
TS = [1, 2, 3, 5]
SENT = np.float32(-7.25e30)


def settings(**kw):  # the tier fixture is deliberately shared by all examples of one test
    return _settings(suppress_health_check=[HealthCheck.function_scoped_fixture], **kw)


def guarded_matmul(w, x, pad=5):
    """ops kernel into a strided output with sentinel columns around it; checks they survive."""
    t = x.shape[0]
    n = w.shape[0]
    buf = np.full((t, n + 2 * pad), SENT, np.float32)
    y = buf[:, pad:pad + n]
    fid, raw, nn, k, lv, lo, step = ops._weight_args(w)
    _ops.matmul(fid, raw, nn, k, np.ascontiguousarray(x), y, lv, lo, step)
    assert (buf[:, :pad] == SENT).all() and (buf[:, pad + n:] == SENT).all(), "out-of-bounds write"
    return y


shapes = st.tuples(st.sampled_from(DIMS), st.sampled_from(DIMS), st.sampled_from(TS)).filter(
    lambda s: s[0] * s[1] * s[2] <= 1_500_000)


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_packed_exact(tier, fmt, shape, seed):
    """Exactly representable inputs: every tier must equal the integer emulation bit for bit."""
    n, k, t = shape
    rng = np.random.default_rng(seed)
    w = random_qtensor(fmt, n, k, rng, exact=True)
    x = exact_activations(t, k, rng)
    y = guarded_matmul(w, x)
    ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
    np.testing.assert_array_equal(y, ye.astype(np.float32))


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_packed_random(tier, fmt, shape, seed):
    """Random inputs: within the float32 rounding bound of the exact integer sums, and within the
    activation-quantization bound of the float64 product of the dequantized weights."""
    n, k, t = shape
    rng = np.random.default_rng(seed)
    w = random_qtensor(fmt, n, k, rng)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    y = guarded_matmul(w, x)
    ye, bound = emulate_matmul(fmt, (n, k), w.raw, x)
    assert (np.abs(y - ye) <= bound).all(), np.max(np.abs(y - ye) - bound)
    # vs float64 W x: |sum w (x - dx a)| <= sum |w| dx / 2 (+ float rounding)
    wf = layout.dequantize_bytes(fmt, (n, k), w.raw.tobytes()).astype(np.float64)
    _, d, _ = quantize_act_ref(x)
    kp = d.shape[1] * 32
    half_step = np.repeat(d, 32, axis=1)[:, :k].astype(np.float64) / 2          # [T, K]
    qbound = np.abs(wf) @ half_step.T                                             # [N, T]
    y64 = x.astype(np.float64) @ wf.T
    assert (np.abs(y - y64) <= qbound.T * 1.0001 + bound + 1e-6).all()
    assert kp >= k


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_float_weights(tier, fmt, shape, seed):
    n, k, t = shape
    rng = np.random.default_rng(seed)
    w = random_qtensor(fmt, n, k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    y = guarded_matmul(w, x)
    wf = w.dequantize().astype(np.float64)
    y64 = x.astype(np.float64) @ wf.T
    bound = (k + 8) * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(wf).T)
    assert (np.abs(y - y64) <= bound + 1e-30).all()


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 33), (5, 31), (9, 257), (33, 896)])
def test_opt_in_four_row_float_decode(tier, fmt, n, k):
    """MIXQRT_FLOAT_MV's 4-row decode path (AVX-512; other tiers ignore the switch): same bound as
    the default one-row loop, with row tails (n % 4) and K tails (k % 32), prefetch past the tile."""
    rng = np.random.default_rng(n * 1000 + k)
    w = random_qtensor(fmt, n, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    old = _ops.set_float_mv(True)
    try:
        y = guarded_matmul(w, x)
    finally:
        _ops.set_float_mv(old)
    wf = w.dequantize().astype(np.float64)
    bound = (k + 8) * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(wf).T)
    assert (np.abs(y - x.astype(np.float64) @ wf.T) <= bound + 1e-30).all()


def test_numpy_weights_and_vector_shapes(tier):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((33, 257)).astype(np.float32)
    x = rng.standard_normal(257).astype(np.float32)
    y = ops.matmul(w, x)
    assert y.shape == (33,)
    np.testing.assert_allclose(y, w.astype(np.float64) @ x, rtol=1e-4, atol=1e-4)
    y2 = ops.matmul(w.astype(np.float16), x[None])
    assert y2.shape == (1, 33)


@settings(max_examples=20, deadline=None)
@given(t=st.sampled_from(TS), k=st.sampled_from(DIMS), seed=st.integers(0, 2**31))
def test_quantize_activations_bit_exact(tier, t, k, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    x[:, :: 7] = 0.0
    if k > 40:
        x[:, 32:64] = 0.0                       # an all-zero block: d = 0
        x[:, 5] = 0.5 * 127 / 2                 # ties at .5 must round half to even like np.rint
    q, d, s = _ops.quantize_act(x)
    qr, dr, sr = quantize_act_ref(x)
    np.testing.assert_array_equal(q, qr)
    np.testing.assert_array_equal(d, dr)
    np.testing.assert_array_equal(s, sr)


def test_q3p_levels_argument(tier):
    rng = np.random.default_rng(3)
    w = random_qtensor("q3p", 7, 130, rng, exact=True)
    lv = np.array([0, 1, 2, 3, 5, 8, 13, 21], np.uint8)
    w.meta["q3p_levels"] = lv
    x = exact_activations(2, 130, rng)
    ye, _ = emulate_matmul("q3p", (7, 130), w.raw, x, q3p_levels=lv)
    np.testing.assert_array_equal(ops.matmul(w, x), ye.astype(np.float32))


@pytest.mark.parametrize("fmt", PACKED_FMTS + ("f16", "bf16", "f32"))
def test_embed_matches_dequantize(tier, fmt):
    rng = np.random.default_rng(4)
    w = random_qtensor(fmt, 37, 257, rng)
    ids = [0, 36, 5, 5]
    np.testing.assert_array_equal(ops.embed(w, ids), w.dequantize()[ids])


def test_bad_arguments():
    rng = np.random.default_rng(5)
    w = random_qtensor("q6", 4, 64, rng)
    with pytest.raises(ValueError):
        ops.matmul(w, np.zeros(63, np.float32))
    with pytest.raises(ValueError):
        _ops.matmul(1, w.raw[:-1], 4, 64, np.zeros((1, 64), np.float32), np.zeros((1, 4), np.float32))
    with pytest.raises(IndexError):
        ops.embed(w, [4])
    with pytest.raises(ValueError):
        ops.matmul(FakeQT("q7", (4, 64), w.raw), np.zeros(64, np.float32))


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@pytest.mark.parametrize("t", [1, 3])
def test_extreme_levels_no_saturation(tier, fmt, t):
    """Largest levels times |a| = 127 of the same sign in every pair: the AVX2 vpmaddubsw path must
    not saturate int16 (q8 sign trick, q2c table levels up to 255 split in two halves)."""
    from test_kernels_ref import layout as lay_mod
    n, k = 9, 256
    rng = np.random.default_rng(7)
    lay = lay_mod.PACKED[fmt]
    nb, g = lay.blocks_per_row(k), lay.group
    sign = rng.choice([-1, 1], size=(t, k))
    if fmt == "q8":
        codes = np.where(rng.random((n, nb, g)) < 0.5, -128, 127).astype(np.int8)
        codes[0] = -127
        codes[1] = 127
    else:
        codes = np.full((n, nb, g), (1 << lay.bits) - 1, np.uint8)
        codes[1::2] = rng.integers(0, 1 << lay.bits, size=codes[1::2].shape)
    p = lay_mod.Parts(codes=codes, d=np.full((n, nb), 0.25, np.float16))
    if fmt in ("q4", "q3u", "q3p", "q2c"):
        p.m = np.full((n, nb), -0.125, np.float16)
    if fmt == "q2c":
        p.lut = np.tile(np.array([0, 128, 254, 255], np.uint8), (n, nb, 1))
        p.lut[1::3] = np.array([127, 128, 200, 255], np.uint8)
    if fmt == "q5g":
        p.lo_hi = (-0.5, -0.5 + 31 * 2.0 ** -5)
    raw = np.frombuffer(lay_mod.assemble(fmt, (n, k), p), dtype=np.uint8).copy()
    w = FakeQT(fmt, (n, k), raw)
    x = np.ascontiguousarray((127 * 2.0 ** -4 * sign).astype(np.float32))
    x[-1, :32] = -127 * 2.0 ** -4  # one block with every activation at -127
    y = guarded_matmul(w, x)
    ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
    np.testing.assert_array_equal(y, ye.astype(np.float32))


def test_local_threads_and_concurrent_callers(tier):
    """local_threads(1) runs on the calling thread (pool untouched) with the same bits as the pool; several
    Python threads may run products at once (the kernels release the GIL; a busy pool runs the
    job inline); hot mode changes nothing in the results."""
    import threading
    rng = np.random.default_rng(3)
    w = random_qtensor("q3p", 300, 896, rng)
    x1 = rng.standard_normal(896).astype(np.float32)
    x5 = rng.standard_normal((5, 896)).astype(np.float32)
    ref1, ref5 = ops.matmul(w, x1), ops.matmul(w, x5)
    with ops.local_threads(1):
        np.testing.assert_array_equal(ops.matmul(w, x1), ref1)
        np.testing.assert_array_equal(ops.matmul(w, x5), ref5)
        with ops.local_threads(2):
            np.testing.assert_array_equal(ops.matmul(w, x5), ref5)
        assert ops._parts() == 1
    assert ops._parts() == 0
    with pytest.raises(ValueError):
        ops.local_threads(0)
    q = rng.standard_normal((12, 4, 16)).astype(np.float32)
    kc = rng.standard_normal((2, 20, 16)).astype(np.float32)
    a_ref = ops.attention(q, kc, kc, 3)
    with ops.local_threads(1):
        np.testing.assert_allclose(ops.attention(q, kc, kc, 3), a_ref, rtol=1e-6, atol=1e-7)
    errs = []

    def work(tid):
        try:
            if tid:
                ops.local_threads(1)    # for the rest of this thread
            for _ in range(20):
                xx = x5 if tid % 2 else x1
                got = ops.matmul(w, xx)
                np.testing.assert_array_equal(got, ref5 if tid % 2 else ref1)
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)
    ths = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    with ops.hot():
        assert ops.is_hot()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        np.testing.assert_array_equal(ops.matmul(w, x1), ref1)
    assert not ops.is_hot()
    assert not errs, errs


@pytest.fixture
def gemm_path():
    """Forces the AVX-512 prefill GEMM path (row tiles of 16, K slices of 16 chunks, token groups
    of 8) for every T >= 2; restores the default threshold afterwards."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    before = isa.current()
    isa.set_isa("avx512")
    old = _ops.set_gemm_min_t(2)
    yield
    _ops.set_gemm_min_t(old)
    isa.set_isa(before)


# N: tails of the 16-row tile; K: tails of the group, of the 16-chunk K slice (512) and several slices;
# T: tails of the 8-token group
GEMM_CASES = [(16, 64, 2), (17, 33, 3), (1, 512, 5), (31, 513, 16), (33, 1000, 33), (48, 96, 8),
              (15, 1055, 9), (64, 256, 512), (7, 31, 512)]


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@pytest.mark.parametrize("n,k,t", GEMM_CASES)
def test_gemm_path_exact(gemm_path, fmt, n, k, t):
    rng = np.random.default_rng(n * 1000 + k + t)
    w = random_qtensor(fmt, n, k, rng, exact=True)
    x = exact_activations(t, k, rng)
    y = guarded_matmul(w, x)
    ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
    np.testing.assert_array_equal(y, ye.astype(np.float32))


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@pytest.mark.parametrize("n,k,t", GEMM_CASES)
def test_gemm_path_random(gemm_path, fmt, n, k, t):
    rng = np.random.default_rng(n * 1000 + k + t + 1)
    w = random_qtensor(fmt, n, k, rng)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    y = guarded_matmul(w, x)
    ye, bound = emulate_matmul(fmt, (n, k), w.raw, x)
    assert (np.abs(y - ye) <= bound).all(), np.max(np.abs(y - ye) - bound)


@pytest.mark.parametrize("fmt", PACKED_FMTS)
def test_gemm_path_extreme_levels_and_threads(gemm_path, fmt):
    """Largest levels (q2c table up to 255, q8 -128/127) against |a| = 127, on the pool with
    several row ranges; and the same result as the 4-row tile path (T below the threshold)."""
    rng = np.random.default_rng(3)
    n, k, t = 200, 256, 21
    lay = layout.PACKED[fmt]
    nb, g = lay.blocks_per_row(k), lay.group
    if fmt == "q8":
        codes = np.where(rng.random((n, nb, g)) < 0.5, -128, 127).astype(np.int8)
    else:
        codes = np.full((n, nb, g), (1 << lay.bits) - 1, np.uint8)
        codes[1::2] = rng.integers(0, 1 << lay.bits, size=codes[1::2].shape)
    p = layout.Parts(codes=codes, d=np.full((n, nb), 0.25, np.float16))
    if fmt in ("q4", "q3u", "q3p", "q2c"):
        p.m = np.full((n, nb), -0.125, np.float16)
    if fmt == "q2c":
        p.lut = np.tile(np.array([0, 128, 254, 255], np.uint8), (n, nb, 1))
    if fmt == "q5g":
        p.lo_hi = (-0.5, -0.5 + 31 * 2.0 ** -5)
    raw = np.frombuffer(layout.assemble(fmt, (n, k), p), dtype=np.uint8).copy()
    w = FakeQT(fmt, (n, k), raw)
    x = np.ascontiguousarray((127 * 2.0 ** -4 * rng.choice([-1, 1], size=(t, k))).astype(np.float32))
    ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
    np.testing.assert_array_equal(guarded_matmul(w, x), ye.astype(np.float32))
    np.testing.assert_array_equal(ops.matmul(w, x), ye.astype(np.float32))
    _ops.set_gemm_min_t(0)
    np.testing.assert_array_equal(ops.matmul(w, x), ye.astype(np.float32))


@pytest.mark.parametrize("fmt", ["q8", "q6", "q3p", "q2c", "q4x", "q6x", "q3x"])
def test_gemm_shared_activation_layout_is_bit_identical(fmt):
    """On several threads a prompt's GEMM reads one interleaved copy of the activations made on the
    pool (mq_gemm_interleave) instead of each thread making its own: the same bits as one thread
    (which interleaves for itself), for token counts around the 8-token group and the q8 sums."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    from mixqrt.formats import quantize
    rng = np.random.default_rng(17)
    w = quantize((rng.standard_normal((96, 320)) * 0.05).astype(np.float32), fmt)
    n0 = ops.get_num_threads()
    before = isa.current()
    try:
        isa.set_isa("avx512")
        ops.set_num_threads(3)
        for t in (8, 9, 15, 64, 130):
            x = (rng.standard_normal((t, 320)) * 2).astype(np.float32)
            with ops.local_threads(1):
                want = ops.matmul(w, x)
            np.testing.assert_array_equal(ops.matmul(w, x), want)
    finally:
        ops.set_num_threads(n0)
        isa.set_isa(before)


@pytest.mark.parametrize("fmt", ["q3p", "q3u", "q6", "q6-fold", "q4", "q2c"])
@pytest.mark.parametrize("lean", [True, False])
@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([1, 3, 4, 5, 31, 33, 257]), k=st.sampled_from([1, 31, 33, 64, 255, 257, 896, 4864]),
       seed=st.integers(0, 2**31))
def test_avx512_decode_paths(fmt, lean, n, k, seed):
    """Both AVX-512 decode paths (the lean fused one, default, and the generic unpack one) give
    the emulation's exact result on exact inputs, for row counts around the 4-row tile."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    fold = fmt == "q6-fold"          # q6 short rows through the opt-in mv_q6f
    fmt = fmt.removesuffix("-fold")
    before, old, old_fold = isa.current(), _ops.set_lean_mv(lean), _ops.set_q6_fold(fold)
    isa.set_isa("avx512")
    try:
        assert _ops.set_lean_mv(lean) == lean
        rng = np.random.default_rng(seed)
        w = random_qtensor(fmt, n, k, rng, exact=True)
        x = exact_activations(1, k, rng)
        ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
        np.testing.assert_array_equal(guarded_matmul(w, x), ye.astype(np.float32))
    finally:
        _ops.set_lean_mv(old)
        _ops.set_q6_fold(old_fold)
        isa.set_isa(before)


@settings(max_examples=15, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 4, 5, 16, 33]), k=st.sampled_from([128, 256, 896, 1408, 2048, 384]),
       seed=st.integers(0, 2**31))
def test_avx512_q2c_block_kernel(n, k, seed):
    """mv_q2c (whole 128-weight blocks, 4 rows a tile, tail rows as a repeated tile) and the unpack
    path it replaces both give the emulation's exact result on exact inputs; _ops.set_q2c_mv switches."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    before, old = isa.current(), _ops.set_q2c_mv(None)
    isa.set_isa("avx512")
    try:
        rng = np.random.default_rng(seed)
        w = random_qtensor("q2c", n, k, rng, exact=True)
        x = exact_activations(1, k, rng)
        ye, _ = emulate_matmul("q2c", (n, k), w.raw, x)
        for on in (True, False):
            assert _ops.set_q2c_mv(on) in (True, False)
            np.testing.assert_array_equal(guarded_matmul(w, x), ye.astype(np.float32))
    finally:
        _ops.set_q2c_mv(old)
        isa.set_isa(before)


@pytest.mark.parametrize("fmt", ["q4", "q6"])
def test_avx512_interleaved_decode_prefetch_keeps_bits(fmt):
    """mv_q4x / mv_q6x with and without their L2 software prefetch (_ops.set_mv_xpf) give the same bits,
    for a matrix longer than the prefetch distance and one shorter."""
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    from mixqrt.formats import codec
    before, old = isa.current(), _ops.set_mv_xpf(None)
    isa.set_isa("avx512")
    try:
        rng = np.random.default_rng(5)
        for n in (16, 512):
            w = codec.to_storage(codec.quantize(rng.standard_normal((n, 512)).astype(np.float32), fmt))
            x = rng.standard_normal((1, 512)).astype(np.float32)
            _ops.set_mv_xpf(True)
            a = ops.matmul(w, x)
            _ops.set_mv_xpf(False)
            np.testing.assert_array_equal(ops.matmul(w, x), a)
    finally:
        _ops.set_mv_xpf(old)
        isa.set_isa(before)


@pytest.mark.parametrize("levels", [b"", b"\x05", list(range(7)), [0, 1, 2, 3, 4, 5, 6, 300], [-1] * 8,
                                    [0, 12, 20, 28, 35, 43, 51, 200]])
def test_bad_q3p_level_table_is_refused(levels):
    """A q3p table the kernels cannot use (short: they would read past it; > 127: int16 saturation on
    AVX2) is a KernelError in embed and matmul, never an out-of-bounds read."""
    rng = np.random.default_rng(11)
    w = random_qtensor("q3p", 8, 64, rng)
    bad = QTensor("q3p", w.shape, w.raw, {"q3p_levels": levels})
    with pytest.raises(KernelError, match="q3p level table"):
        ops.embed(bad, [0, 3])
    with pytest.raises(KernelError, match="q3p level table"):
        ops.matmul(bad, np.ones(64, np.float32))
    with pytest.raises(ValueError, match="q3p"):       # the C boundary checks it too
        _ops.dequant_rows(layout.FMT_ID["q3p"], w.raw, 8, 64, np.zeros(1, np.int64), np.zeros((1, 64), np.float32), b"\x01")


def test_meta_change_after_first_matmul_is_seen():
    """Kernel arguments are cached per tensor; meta is read-only, and a new meta misses the cache."""
    rng = np.random.default_rng(12)
    w = QTensor("q3p", (16, 128), random_qtensor("q3p", 16, 128, rng).raw)
    x = rng.standard_normal(128).astype(np.float32)
    y0, e0 = ops.matmul(w, x), ops.embed(w, [1])
    with pytest.raises(TypeError):
        w.meta["q3p_levels"] = [0, 1, 2, 3, 4, 5, 6, 7]
    lv = [0, 9, 18, 27, 36, 45, 54, 63]
    w.meta = {"q3p_levels": lv}
    fresh = QTensor("q3p", w.shape, w.raw.copy(), {"q3p_levels": lv})
    np.testing.assert_array_equal(ops.matmul(w, x), ops.matmul(fresh, x))
    np.testing.assert_array_equal(ops.embed(w, [1]), ops.embed(fresh, [1]))
    assert not np.array_equal(ops.matmul(w, x), y0) and not np.array_equal(ops.embed(w, [1]), e0)


@pytest.mark.parametrize("t", [1, 5, 8, 16])
def test_q8_exact_long_rows(tier, t):
    """q8's integer sums are formed signed in every tier (levels + 128 for vpdpbusd, minus 128 * sum(q)
    in integers): long rows stay exact where the +128 form's float partial sums passed 2^24 (a 31 x 4864,
    T = 5 hypothesis draw failed on AVX-512 before)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        w = random_qtensor("q8", 31, 4864, rng, exact=True)
        x = exact_activations(t, 4864, rng)
        ye, _ = emulate_matmul("q8", (31, 4864), w.raw, x)
        np.testing.assert_array_equal(guarded_matmul(w, x), ye.astype(np.float32))


# ---------------------------------------------------------------- cached GEMM tiles (ops.set_gemm_cache)
def _tiles(w):
    fid, raw, n, k, lv, lo, step = ops._weight_args(w)
    nb = _ops.gemm_tiles_bytes(fid, n, k)
    buf = np.empty(nb + 128, np.uint8)
    off = (-buf.ctypes.data) % 64
    t = buf[off:off + nb]
    return t, _ops.gemm_tiles(fid, raw, n, k, t, lv, lo, step)


def _mm(w, x, tiles, threads=0):
    fid, raw, n, k, lv, lo, step = ops._weight_args(w)
    y = np.empty((x.shape[0], n), np.float32)
    return _ops.matmul(fid, raw, n, k, np.ascontiguousarray(x), y, lv, lo, step, threads, tiles)


@pytest.mark.parametrize("fmt", PACKED_FMTS)
@pytest.mark.parametrize("n,k,t", GEMM_CASES + [(200, 896, 2), (129, 4864, 4)])
def test_gemm_tiles_bit_identical(gemm_path, fmt, n, k, t):
    """The cached tiles hold exactly what the GEMM unpacks: the product from them equals the
    unpacking GEMM and the integer emulation bit for bit, on one thread and on the pool."""
    rng = np.random.default_rng(n * 7 + k + t)
    w = random_qtensor(fmt, n, k, rng, exact=True)
    x = exact_activations(t, k, rng)
    tiles, built = _tiles(w)
    assert built
    ye, _ = emulate_matmul(fmt, (n, k), w.raw, x)
    for threads in (1, 0):
        np.testing.assert_array_equal(_mm(w, x, tiles, threads), ye.astype(np.float32))
    xr = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    np.testing.assert_array_equal(_mm(w, xr, tiles), _mm(w, xr, None))


def test_gemm_tiles_other_tiers_and_bad_buffers(tier):
    """Tiers without AVX-512 build nothing and ignore tiles (same product); a short or misaligned
    buffer is refused before any kernel runs."""
    rng = np.random.default_rng(5)
    w = random_qtensor("q3p", 40, 96, rng, exact=True)
    x = exact_activations(9, 96, rng)
    tiles, built = _tiles(w)
    assert built == (tier == "avx512")
    ye, _ = emulate_matmul("q3p", (40, 96), w.raw, x)
    if built:
        np.testing.assert_array_equal(_mm(w, x, tiles), ye.astype(np.float32))
    else:
        np.testing.assert_array_equal(_mm(w, x, tiles), _mm(w, x, None))
    fid = layout.FMT_ID["q3p"]
    buf = np.zeros(tiles.nbytes + 128, np.uint8)
    off = (-buf.ctypes.data) % 64
    with pytest.raises(ValueError, match="64-byte aligned"):
        _mm(w, x, buf[off + 1:off + 1 + tiles.nbytes])
    with pytest.raises(ValueError, match="64-byte aligned"):
        _mm(w, x, buf[off:off + tiles.nbytes - 64])
    with pytest.raises(ValueError, match="float weights"):
        _ops.gemm_tiles_bytes(layout.FMT_ID["f32"], 4, 32)
    assert _ops.gemm_tiles_bytes(fid, 40, 96) == 3 * 4 * (512 + 128)


def test_set_gemm_cache_budget_and_reuse():
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    before_isa = isa.current()
    isa.set_isa("avx512")
    rng = np.random.default_rng(11)
    a = random_qtensor("q3p", 64, 256, rng, exact=True)
    b = random_qtensor("q6", 48, 256, rng, exact=True)
    x = exact_activations(8, 256, rng)
    need = _ops.gemm_tiles_bytes(layout.FMT_ID["q3p"], 64, 256)
    old = ops.set_gemm_cache(need)          # room for a only
    try:
        ya, yb = ops.matmul(a, x), ops.matmul(b, x)
        assert ops.gemm_cache_info() == {"budget": need, "used": need, "tensors": 1}
        np.testing.assert_array_equal(ya, emulate_matmul("q3p", (64, 256), a.raw, x)[0].astype(np.float32))
        np.testing.assert_array_equal(yb, emulate_matmul("q6", (48, 256), b.raw, x)[0].astype(np.float32))
        np.testing.assert_array_equal(ops.matmul(a, x), ya)        # from the cache
        ops.matmul(a, x[:1])                                       # decode never builds or reads tiles
        assert ops.gemm_cache_info()["tensors"] == 1
        del a, ya                                                  # a's tiles go with it
        import gc
        gc.collect()
        assert ops.gemm_cache_info() == {"budget": need, "used": 0, "tensors": 0}
        ops.matmul(b, x)                                           # now b fits
        assert ops.gemm_cache_info()["tensors"] == 1
        for bad in (-1, 1.5, "1G", True):
            with pytest.raises(KernelError, match="gemm cache"):
                ops.set_gemm_cache(bad)
        assert ops.set_gemm_cache(0) == need
        assert ops.gemm_cache_info() == {"budget": 0, "used": 0, "tensors": 0}
        isa.set_isa("avx2")                                        # other tiers: no tiles, budget kept
        ops.set_gemm_cache(need)
        np.testing.assert_array_equal(ops.matmul(b, x), yb)
        assert ops.gemm_cache_info() == {"budget": need, "used": 0, "tensors": 0}
    finally:
        ops.set_gemm_cache(old)
        isa.set_isa(before_isa)
