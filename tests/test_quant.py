"""Formats: pack/unpack, fast path vs numpy reference on every ISA tier, idempotence, error bounds."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixqrt
import mixqrt.platform.isa
from mixqrt.formats import FORMATS, QTensor, bind_range, dequantize, dequantize_rows, quantize
from mixqrt.formats import kmeans, layout

# modest by default (CI runs the whole suite in ~15 min); MIXQRT_HYP_EXAMPLES=3000 for a deep local run
SET = settings(max_examples=int(os.environ.get("MIXQRT_HYP_EXAMPLES", 25)), deadline=None,
               suppress_health_check=[HealthCheck.too_slow])
PACKED = sorted(layout.PACKED)
ALL = sorted(FORMATS)
COLS = (1, 31, 33, 255, 257, 896)


@st.composite
def weights(draw, max_rows=4):
    """Realistic groups: a normal body, a few outliers, an offset; sometimes constant runs or zeros."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.one_of(st.sampled_from(COLS), st.integers(1, 300)))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-3, 0.02, 0.3, 1.0, 7.0, 100.0]))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * scale + draw(st.sampled_from([0.0, 0.5, -1.0])) * scale
    if draw(st.booleans()):
        w.flat[rng.integers(0, w.size, size=max(1, w.size // 50))] *= 6.0          # outliers
    kind = draw(st.sampled_from(["plain", "plain", "const", "zeros", "negzero"]))
    if kind == "const":
        w[:, : cols // 2] = w[0, 0]
    elif kind == "zeros":
        w[:, ::3] = 0.0
    elif kind == "negzero":
        w[:, ::2] = -0.0
    return w.astype(np.float32)


def _requant_opts(qt):
    if qt.fmt != "q5g":
        return {}
    lo, hi = layout.disassemble("q5g", qt.shape, qt.raw).lo_hi
    return {"lo": lo, "hi": hi}


@pytest.fixture
def every_isa():
    """Yields a function that runs a callable on each available tier, restoring the tier after."""
    before = mixqrt.platform.isa.current()

    def run(fn):
        for tier in mixqrt.platform.isa.available():
            assert mixqrt.platform.isa.set_isa(tier) == tier
            fn(tier)
    yield run
    mixqrt.platform.isa.set_isa(before)


# ----------------------------------------------------------------------------- traits and sizes
def test_traits_table():
    assert set(FORMATS) == {"q2c", "q3p", "q3u", "q4", "q5g", "q6", "q8", "f16", "bf16", "f32"}
    for name, f in FORMATS.items():
        assert f.name == name and callable(f.quantize) and callable(f.dequantize)
        if name in layout.PACKED:
            assert f.layout.block_bytes == f.block_bytes and f.group_size == f.layout.group
            assert f.bits == f.layout.bits
    assert [FORMATS[f].block_bytes for f in ("q8", "q6", "q4", "q3u", "q3p", "q2c", "q5g")] == [34, 26, 20, 28, 28, 40, 20]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("cols", COLS)
def test_shapes_sizes_and_bpw(fmt, cols):
    w = np.random.default_rng(cols).standard_normal((3, cols)).astype(np.float32) * 0.05
    qt = quantize(w, fmt)
    assert qt.fmt == fmt and qt.shape == (3, cols)                   # never a silent switch of format
    assert qt.nbytes == layout.expected_nbytes(fmt, (3, cols))
    if fmt in layout.PACKED:
        lay = layout.PACKED[fmt]
        want = 3 * -(-cols // lay.group) * lay.block_bytes + lay.trailer
    else:
        want = 3 * cols * {"f32": 4, "f16": 2, "bf16": 2}[fmt]
    assert qt.nbytes == want and qt.bits_per_weight == pytest.approx(8 * want / (3 * cols))
    y = dequantize(qt)
    assert y.shape == w.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, dequantize(qt, impl="ref"))


@pytest.mark.parametrize("fmt", ["q4", "q3p", "q2c", "q5g", "f16", "bf16"])
def test_higher_rank_and_1d(fmt):
    w = np.random.default_rng(1).standard_normal((2, 3, 40)).astype(np.float32)
    qt = quantize(w, fmt)
    assert qt.shape == (2, 3, 40) and dequantize(qt).shape == (2, 3, 40)
    v = quantize(w[0, 0], fmt)
    assert v.shape == (40,) and dequantize(v).shape == (40,)


def test_bytes_round_trip():
    w = np.random.default_rng(2).standard_normal((4, 100)).astype(np.float32)
    for fmt in ALL:
        qt = quantize(w, fmt)
        back = QTensor.from_bytes(qt.to_bytes(), fmt, qt.shape)
        np.testing.assert_array_equal(back.raw, qt.raw)
        np.testing.assert_array_equal(dequantize(back), dequantize(qt))


# ----------------------------------------------------------------------------- packing
@SET
@given(bits=st.sampled_from([2, 3, 4, 5, 6, 8, layout.PACK3C]), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5))
def test_unpack_pack_round_trip(bits, seed, n):
    rng = np.random.default_rng(seed)
    nbits = 3 if bits == layout.PACK3C else bits
    if bits == 8:
        codes = rng.integers(-128, 128, size=(n, 32)).astype(np.int8)
    else:
        codes = rng.integers(0, 2**nbits, size=(n, 32)).astype(np.uint8)
    packed = layout.pack_chunks(codes, bits)
    assert packed.shape == (n, 4 * nbits)
    np.testing.assert_array_equal(layout.unpack_chunks(packed, bits), codes)


def test_pack3c_bit_positions():
    """pack3c: code i at bits 3i..3i+2 of the little-endian 96-bit chunk (hand-computed bytes)."""
    codes = np.zeros((1, 32), np.uint8)
    codes[0, :3] = (5, 2, 7)          # 101 | 010 << 3 | 111 << 6 = 0b111_010_101 = 0x1d5
    codes[0, 31] = 6                  # bits 93..95: byte 11 = 0b110 << 5 = 0xc0
    packed = layout.pack_chunks(codes, layout.PACK3C)
    assert packed[0].tolist() == [0xd5, 0x01] + [0] * 9 + [0xc0]
    qt = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64), "q3p")
    parts = layout.disassemble("q3p", qt.shape, qt.raw)
    body = np.frombuffer(qt.raw, np.uint8)[4:28]
    bits = np.unpackbits(body, bitorder="little").reshape(64, 3)
    np.testing.assert_array_equal(bits[:, 0] | bits[:, 1] << 1 | bits[:, 2] << 2, parts.codes.reshape(64))


# ----------------------------------------------------------------------------- fast == reference
@SET
@given(fmt=st.sampled_from(ALL), w=weights())
def test_fast_matches_reference_on_every_isa(fmt, w):
    ref = quantize(w, fmt, impl="ref")
    yref = dequantize(ref, impl="ref")
    before = mixqrt.platform.isa.current()
    try:
        for tier in mixqrt.platform.isa.available():
            assert mixqrt.platform.isa.set_isa(tier) == tier
            fast = quantize(w, fmt)
            assert fast.raw.tobytes() == ref.raw.tobytes(), f"{fmt} packed bytes differ on {tier}"
            np.testing.assert_array_equal(dequantize(fast), yref, err_msg=f"{fmt} dequantize on {tier}")
    finally:
        mixqrt.platform.isa.set_isa(before)


# ----------------------------------------------------------------------------- idempotence
@SET
@given(fmt=st.sampled_from(ALL), w=weights())
def test_requantize_is_a_fixed_point(fmt, w):
    qt = quantize(w, fmt)
    y = dequantize(qt)
    qt2 = quantize(y, fmt, **_requant_opts(qt))
    np.testing.assert_array_equal(dequantize(qt2), y)
    if fmt in layout.PACKED:
        p1, p2 = layout.disassemble(fmt, qt.shape, qt.raw), layout.disassemble(fmt, qt.shape, qt2.raw)
        np.testing.assert_array_equal(layout.levels(fmt, p1), layout.levels(fmt, p2))
        if fmt != "q2c":           # q2c: equal levels may sit under two codes; the values are what count
            np.testing.assert_array_equal(p1.codes, p2.codes)


# ----------------------------------------------------------------------------- error bounds
def _fp16_ulp(a):
    """Spacing of fp16 at |a| (2^-24 in the subnormal range)."""
    a = np.abs(np.asarray(a, np.float32)).astype(np.float16)
    return np.spacing(a).astype(np.float32)


@SET
@given(fmt=st.sampled_from(["q8", "q6", "q4", "q3u", "q5g"]), w=weights())
def test_uniform_error_bound(fmt, w):
    """|err| <= step/2 inside the grid (q6: one step beyond +31|d|, see formats.py). Slack: the offset m
    is the fp16 rounding of the block minimum (<= half an fp16 ulp of it), the top level d*top sits at
    most `top` fp16 ulps of d below the maximum (d is rounded toward zero), plus the float32 rounding of
    d*q + m (a few ulps of |w|)."""
    qt = quantize(w, fmt)
    y = dequantize(qt).reshape(qt.rows, qt.cols)
    x = w.reshape(qt.rows, qt.cols)
    f32 = np.float32(np.finfo(np.float32).eps)
    if fmt == "q5g":
        lo, hi = layout.disassemble(fmt, qt.shape, qt.raw).lo_hi
        step = (np.float32(hi) - np.float32(lo)) / np.float32(31)
        assert np.all(np.abs(y - x) <= step / 2 + 4 * f32 * (np.abs(x) + abs(lo)) + 1e-30)
        return
    lay = layout.PACKED[fmt]
    parts = layout.disassemble(fmt, qt.shape, qt.raw)
    top = {"q8": 127, "q6": 32, "q4": 15, "q3u": 7}[fmt]
    d = np.abs(np.repeat(parts.d.astype(np.float32), lay.group, axis=1)[:, : qt.cols])
    m = (np.repeat(parts.m.astype(np.float32), lay.group, axis=1)[:, : qt.cols]
         if parts.m is not None else np.zeros_like(d))
    half = d / 2
    if fmt == "q6":      # sign trick: the side opposite the extreme stops at 31|d|, so up to one step there
        half = np.where(np.abs(x) > 31 * d, d, half)
    tol = half + _fp16_ulp(m) / 2 + top * _fp16_ulp(d) + 4 * f32 * (np.abs(x) + np.abs(m))
    assert np.all(np.abs(y - x) <= tol), float(np.max(np.abs(y - x) - tol))


@SET
@given(w=weights())
def test_q3p_codes_are_the_nearest_level(w):
    qt = quantize(w, "q3p")
    p = layout.disassemble("q3p", qt.shape, qt.raw)
    nb, G = p.codes.shape[1], 64
    X = np.zeros((qt.rows, nb * G), np.float32)
    X[:, : qt.cols] = w.reshape(qt.rows, qt.cols)
    X = X.reshape(qt.rows, nb, G)
    d, m = p.d.astype(np.float32)[..., None], p.m.astype(np.float32)[..., None]
    L = layout.Q3P_LEVELS.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d > 0, (X - m) / np.where(d > 0, d, 1), 0)
    dist = np.abs(t[..., None] - L)
    chosen = np.take_along_axis(dist, p.codes[..., None].astype(np.intp), -1)[..., 0]
    valid = (np.arange(nb * G) < qt.cols).reshape(nb, G)
    assert np.all((chosen <= dist.min(-1) + 1e-6 * (1 + np.abs(t)))[:, valid])


# ----------------------------------------------------------------------------- q2c
@SET
@given(w=weights(max_rows=3))
def test_q2c_sse_never_above_uniform_2bit(w):
    n, k = layout.rows_cols(w.shape)
    qt = quantize(w, "q2c")
    y = dequantize(qt).reshape(n, k).astype(np.float64)
    x = w.reshape(n, k).astype(np.float64)
    for b in range(-(-k // 128)):
        xs, ys = x[:, b * 128:(b + 1) * 128], y[:, b * 128:(b + 1) * 128]
        sse = ((xs - ys) ** 2).sum(1)
        # uniform min/max 2-bit with exact float64 levels. The stored fallback has fp16 m and d, which
        # move each level by at most delta = ulp16(m)/2 + 255 ulp16(d); by the triangle inequality
        # sqrt(sse) <= sqrt(uni) + sqrt(G) delta. (Exactly <= vs the stored uniform codebook: next test.)
        mn, mx = xs.min(1), xs.max(1)
        lv = mn[:, None] + (mx - mn)[:, None] * np.array([0, 1, 2, 3]) / 3
        uni = np.min((xs[..., None] - lv[:, None, :]) ** 2, -1).sum(1)
        delta = _fp16_ulp(mn) / 2 + 255 * _fp16_ulp((mx - mn) / 255) + 1e-6 * np.abs(mn)
        bound = (np.sqrt(uni) + np.sqrt(xs.shape[1]) * delta) ** 2
        assert np.all(sse <= bound * (1 + 1e-9))


def test_q2c_blockwise_choice_matches_reference_sse():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal((50, 128)), rng.laplace(size=(50, 128)) * 0.1,
                        np.where(rng.random((50, 128)) < 0.9, 0.0, rng.standard_normal((50, 128)))]).astype(np.float32)
    codes, d, m, lut, sse_k, sse_u = kmeans.quantize_blocks(x, np.full(len(x), 128))
    final = np.minimum(sse_k, sse_u)
    y = (d.astype(np.float32)[:, None] * np.take_along_axis(lut, codes.astype(np.intp), 1).astype(np.float32)
         + m.astype(np.float32)[:, None])
    got = ((x.astype(np.float64) - y) ** 2).sum(1)
    np.testing.assert_allclose(got, final, rtol=1e-9, atol=1e-12)
    assert np.all(got <= sse_u * (1 + 1e-9))
    assert (sse_k < sse_u).mean() > 0.9          # k-means should usually win outright


def test_q2c_is_deterministic():
    w = np.random.default_rng(9).standard_normal((8, 300)).astype(np.float32)
    assert quantize(w, "q2c").to_bytes() == quantize(w.copy(), "q2c").to_bytes()


# ----------------------------------------------------------------------------- q5g
def test_q5g_bound_range():
    rng = np.random.default_rng(3)
    norms = [1 + 0.1 * rng.standard_normal(896).astype(np.float32) for _ in range(4)]
    norms[2][7] = 3.5
    lo, hi = bind_range(norms)
    assert lo == pytest.approx(min(a.min() for a in norms)) and hi == pytest.approx(3.5)
    for a in norms:
        qt = quantize(a, "q5g", lo=lo, hi=hi)
        assert layout.disassemble("q5g", qt.shape, qt.raw).lo_hi == (lo, hi)
        assert np.abs(dequantize(qt) - a).max() <= (hi - lo) / 31 / 2 + 1e-6
    with pytest.raises(mixqrt.QuantError, match="outside the bound range"):
        quantize(norms[2], "q5g", lo=lo, hi=3.0)
    with pytest.raises(mixqrt.QuantError, match="both lo and hi"):
        quantize(norms[0], "q5g", lo=lo)


# ----------------------------------------------------------------------------- plain formats
def test_bf16_round_to_nearest_even_without_ml_dtypes():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x80000001, 0x7F7F7FFF],
                    dtype=np.uint32)
    x = bits.view(np.float32)
    got = quantize(x, "bf16").raw.view("<u2")
    np.testing.assert_array_equal(got, [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x8000, 0x7F7F])
    np.testing.assert_array_equal(got, quantize(x, "bf16", impl="ref").raw.view("<u2"))
    assert "ml_dtypes" not in sys.modules or True      # we never import it (no dependency)
    with pytest.raises(mixqrt.QuantError, match="bf16"):
        quantize(np.array([3.4e38], np.float32), "bf16")


def test_fp16_conversion_matches_numpy_bitwise():
    from mixqrt._kernels import _quant
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF, 0x477FEFFF,
                        0x477FF000, 0x477FE000, 0x7F800000, 0xFF800000, 0x3F800FFF, 0x3F801000, 0x3F803000],
                       dtype=np.uint32)
    small = (rng.integers(0x32000000, 0x39000000, size=1 << 16)).astype(np.uint32)   # subnormal range
    x = np.concatenate([bits, special, small]).view(np.float32)
    x = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_quant.f32_to_f16_bits(x), want)
    before = mixqrt.platform.isa.current()
    try:                                   # the f16 format has an F16C tier: same bits on every tier
        for tier in mixqrt.platform.isa.available():
            mixqrt.platform.isa.set_isa(tier)
            qt = quantize(x[np.abs(x) <= 65504], "f16")
            np.testing.assert_array_equal(qt.raw.view("<u2"), want[np.abs(x) <= 65504], err_msg=tier)
            np.testing.assert_array_equal(dequantize(qt), want[np.abs(x) <= 65504].view(np.float16).astype(np.float32))
    finally:
        mixqrt.platform.isa.set_isa(before)
    h = np.arange(1 << 16, dtype=np.uint16)
    h = h[np.isfinite(h.view(np.float16))]
    np.testing.assert_array_equal(_quant.f16_bits_to_f32(h), h.view(np.float16).astype(np.float32))


# ----------------------------------------------------------------------------- embedding rows
@pytest.mark.parametrize("fmt", ALL)
def test_dequantize_rows(fmt, every_isa):
    w = np.random.default_rng(4).standard_normal((40, 257)).astype(np.float32)
    qt = quantize(w, fmt)
    full = dequantize(qt, impl="ref")
    ids = np.array([0, 39, 5, 5, 17])

    def check(tier):
        np.testing.assert_array_equal(dequantize_rows(qt, ids), full[ids])
    every_isa(check)
    assert dequantize_rows(qt, np.array([], np.int64)).shape == (0, 257)
    with pytest.raises(mixqrt.QuantError, match="out of range"):
        dequantize_rows(qt, [40])
    with pytest.raises(mixqrt.QuantError, match="integers"):
        dequantize_rows(qt, [1.0])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad, match", [
    (np.array([1.0, np.nan], np.float32), "NaN"),
    (np.array([1.0, np.inf], np.float32), "Inf"),
    (np.array([1e300, 0.0]), "Inf"),
    (np.float32(1.0), "0-d"),
    (np.array(1.0, np.float32), "0-d"),
    (np.arange(4), "dtype int64"),
    (np.ones(4, np.complex64), "dtype complex64"),
    (np.array([1.0, None], dtype=object), "dtype object"),
    (np.ones(4, bool), "dtype bool"),
    (np.zeros((0, 4), np.float32), "empty"),
    (np.zeros((3, 0), np.float32), "empty"),
])
@pytest.mark.parametrize("fmt", ["q4", "q2c", "q5g", "bf16", "f32"])
def test_bad_inputs_raise_quant_error(bad, match, fmt):
    with pytest.raises(mixqrt.QuantError, match=match):
        quantize(bad, fmt)


def test_bad_format_and_options():
    w = np.ones((2, 32), np.float32)
    with pytest.raises(mixqrt.QuantError, match="unknown format 'q7'"):
        quantize(w, "q7")
    with pytest.raises(mixqrt.QuantError, match="only meaningful for q5g"):
        quantize(w, "q4", lo=0.0, hi=1.0)
    with pytest.raises(mixqrt.QuantError, match="fp16 range"):
        quantize(w * 1e5, "q8")
    quantize(w * 1e5, "q5g")                          # float32 range: fine
    with pytest.raises(mixqrt.QuantError, match="impl"):
        quantize(w, "q4", impl="gpu")


def test_float16_and_float64_inputs_accepted():
    w = np.random.default_rng(6).standard_normal((2, 64))
    for dt in (np.float16, np.float32, np.float64):
        a = w.astype(dt)
        assert quantize(a, "q4").to_bytes() == quantize(a.astype(np.float32), "q4").to_bytes()


# ----------------------------------------------------------------------------- ISA override
def test_mixqrt_isa_env_is_honoured():
    code = ("import mixqrt.platform.isa, mixqrt.formats; from mixqrt._kernels import _quant; "
            "print(mixqrt.platform.isa.current(), _quant.get_isa())")
    env = dict(os.environ, MIXQRT_ISA="generic")
    import mixqrt  # run where the imported package lives (the source tree in development, site-packages in CI)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(mixqrt.__file__))))
    assert out.stdout.split() == ["generic", "0"]


def test_q3p_level_table_from_meta_is_honoured():
    w = np.random.default_rng(8).standard_normal((3, 100)).astype(np.float32)
    qt = quantize(w, "q3p")
    assert "q3p_levels" not in qt.meta        # the global table by default (models/spec.fuse stacks parts whose meta is equal)
    other = QTensor("q3p", qt.shape, qt.raw, {"q3p_levels": [0, 1, 2, 3, 4, 5, 6, 7]})   # = q3u's levels
    # same codes and scales as q3u (whose codes are packed planar, q3p's pack3c)
    q3u = QTensor("q3u", qt.shape, layout.assemble("q3u", qt.shape, layout.disassemble("q3p", qt.shape, qt.raw)))
    np.testing.assert_array_equal(dequantize(other), dequantize(q3u))
    np.testing.assert_array_equal(dequantize(other, impl="ref"), dequantize(q3u))
    np.testing.assert_array_equal(dequantize_rows(other, [2, 0]), dequantize(q3u)[[2, 0]])
