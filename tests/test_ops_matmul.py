"""Products from packed weights, every format on every ISA tier, against the numpy emulation of
the integer path (tests/test_kernels_ref.py) and the float64 product of the dequantized weights."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as _settings, strategies as st

import mixqrt.isa as isa
from mixqrt import ops
from mixqrt._kernels import _ops
from mixqrt.quant import layout

from test_kernels_ref import (FakeQT, PACKED_FMTS, emulate_matmul, exact_activations, quantize_act_ref,
                        random_qtensor)

DIMS = [1, 31, 33, 255, 257, 896, 4864]
TS = [1, 2, 3, 5]
SENT = np.float32(-7.25e30)


def settings(**kw):  # the tier fixture is deliberately shared by all examples of one test
    return _settings(suppress_health_check=[HealthCheck.function_scoped_fixture], **kw)


@pytest.fixture(params=isa.available())
def tier(request):
    before = isa.current()
    got = isa.set_isa(request.param)
    assert got == request.param
    yield got
    isa.set_isa(before)


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
