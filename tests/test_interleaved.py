"""q4x / q6x / q3x: q4's / q6's / q3p's blocks with rows interleaved by 16 (layout.py, mq_format.h). Pack/unpack
identity, the same values as the base format, every ISA tier bit-exact against the integer emulation
(decode kernels, GEMM, the gathering fallback of the other tiers), .mxq version 4, and the decode
prefetch (matmul then=)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as _settings, strategies as st

import mixqrt.platform.isa as isa
from mixqrt import ops
from mixqrt._kernels import _ops
from mixqrt.errors import FormatError, KernelError, QuantError
from mixqrt.io import mxq
from mixqrt.models.spec import row_slice
from mixqrt.formats import layout, quantize
from mixqrt.formats.codec import dequantize_rows, to_storage
from mixqrt.formats.qtensor import QTensor

from test_kernels_ref import emulate_matmul, exact_activations, random_qtensor
from test_ops_matmul import guarded_matmul

ROWS = [16, 32, 48, 256, 896]
COLS = [1, 31, 33, 255, 257, 896, 4864]


def settings(**kw):
    return _settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, **kw)


FMTS = sorted(layout.INTERLEAVED)                                   # q3x, q4x, q6x


def x_of(fmt, n, k, rng, exact=False):
    base = layout.INTERLEAVED[fmt][0]
    q = QTensor(base, (n, k), random_qtensor(base, n, k, rng, exact=exact).raw)
    return q, to_storage(q)


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=25)
@given(n=st.sampled_from(ROWS), k=st.sampled_from(COLS), seed=st.integers(0, 2**31))
def test_interleave_is_lossless(fmt, n, k, seed):
    base = layout.INTERLEAVED[fmt][0]
    q, qx = x_of(fmt, n, k, np.random.default_rng(seed))
    assert qx.fmt == fmt and qx.nbytes == q.nbytes
    if fmt != "q3x":
        assert np.array_equal(np.sort(qx.raw), np.sort(q.raw))      # the same bytes, moved
    assert np.array_equal(layout.from_interleaved(fmt, qx.raw, qx.shape), q.raw)
    assert np.array_equal(layout.to_interleaved(fmt, layout.from_interleaved(fmt, qx.raw, qx.shape), qx.shape), qx.raw)
    p, px = layout.disassemble(base, q.shape, q.raw), layout.disassemble(fmt, qx.shape, qx.raw)
    assert np.array_equal(p.codes, px.codes) and np.array_equal(p.d, px.d) and np.array_equal(p.m, px.m)
    assert layout.assemble(fmt, qx.shape, px) == qx.raw.tobytes()
    ref = layout.dequantize_bytes(base, q.shape, q.raw)
    assert np.array_equal(qx.dequantize(), ref)                       # C dequantizer (gathers rows)
    assert np.array_equal(layout.dequantize_bytes(fmt, qx.shape, qx.raw), ref)
    ids = np.random.default_rng(seed).integers(0, n, 9)
    assert np.array_equal(dequantize_rows(qx, ids), ref[ids])        # embedding lookup


def test_q4x_layout_by_hand():
    """Row r's chunk c: d at 2r, m at 32 + 2r, code bytes 4s..4s+3 at 64 + 64s + 4r (mq_format.h)."""
    rng = np.random.default_rng(0)
    q, qx = x_of("q4x", 32, 64, rng)
    rb = layout.PACKED["q4"].row_bytes(64)
    raw, g = q.raw.reshape(32, rb), qx.raw.reshape(2, 2, 320)        # [group, chunk, 320]
    for row in (0, 5, 17, 31):
        gi, r = divmod(row, 16)
        for c in range(2):
            blk = raw[row, 20 * c:20 * c + 20]
            assert bytes(g[gi, c, 2 * r:2 * r + 2]) == bytes(blk[0:2])
            assert bytes(g[gi, c, 32 + 2 * r:34 + 2 * r]) == bytes(blk[2:4])
            for s in range(4):
                assert bytes(g[gi, c, 64 + 64 * s + 4 * r:68 + 64 * s + 4 * r]) == bytes(blk[4 + 4 * s:8 + 4 * s])


def test_q6x_layout_by_hand():
    """Row r's chunk c: d at 2r, pack4 word s at 32 + 64s + 4r, pack2 word y at 288 + 64y + 4r."""
    rng = np.random.default_rng(2)
    q, qx = x_of("q6x", 32, 64, rng)
    raw, g = q.raw.reshape(32, 52), qx.raw.reshape(2, 2, 416)
    for row in (0, 7, 16, 31):
        gi, r = divmod(row, 16)
        for c in range(2):
            blk = raw[row, 26 * c:26 * c + 26]
            assert bytes(g[gi, c, 2 * r:2 * r + 2]) == bytes(blk[0:2])
            for w in range(6):
                o = 32 + 64 * w + 4 * r
                assert bytes(g[gi, c, o:o + 4]) == bytes(blk[2 + 4 * w:6 + 4 * w])


def test_q3x_layout_by_hand():
    """Row r's code k = 4i + j (step i) in the six planes of .mxq version 5 (mq_format.h): for i < 12
    bits 3(i & 1) .. +2 of byte 64 + 64(i >> 1) + 4r + j; for i = 12 + w, bits 6-7 of plane w's byte
    and bit 6 + (w & 1) of plane 4 + (w >> 1)'s byte."""
    rng = np.random.default_rng(1)
    q, qx = x_of("q3x", 32, 128, rng)
    p = layout.disassemble("q3p", q.shape, q.raw)
    g = qx.raw.reshape(2, 2, 448)                                    # [group, block, 448]
    for row in (0, 9, 16, 31):
        gi, r = divmod(row, 16)
        for b in range(2):
            assert g[gi, b, 2 * r:2 * r + 2].view("<f2")[0] == p.d[row, b]
            assert g[gi, b, 32 + 2 * r:34 + 2 * r].view("<f2")[0] == p.m[row, b]
            for k in range(64):
                i, j = divmod(k, 4)
                byte = lambda w: int(g[gi, b, 64 + 64 * w + 4 * r + j])   # noqa: E731
                if i < 12:
                    code = (byte(i >> 1) >> (3 * (i & 1))) & 7
                else:
                    w = i - 12
                    code = (byte(w) >> 6) | (((byte(4 + (w >> 1)) >> (6 + (w & 1))) & 1) << 2)
                assert code == p.codes[row, b, k]


def test_q3x_version4_files_upgrade_losslessly(tmp_path):
    """A version 4 file's q3x tensor (a 2-bit and a 1-bit plane) raises a FormatError naming the
    fix; mxq.upgrade rewrites it as version 5 with the same codes, scales and values."""
    from mixqrt.errors import FormatError
    from mixqrt.io import mxq
    rng = np.random.default_rng(2)
    q, qx = x_of("q3x", 32, 128, rng)
    p = layout.disassemble("q3p", q.shape, q.raw)
    n, nb = 32, 2
    # version 4's bytes of the same block: the old planes, built by the inverse of q3x_v4_unparts
    c = p.codes.reshape(2, 16, nb, 4, 4, 4).astype(np.uint8)        # [g, r, b, f, z, j]
    lo2, hi = c & 3, (c >> 2) & 1
    lo = (lo2[:, :, :, 0] | (lo2[:, :, :, 1] << 2) | (lo2[:, :, :, 2] << 4) | (lo2[:, :, :, 3] << 6)).transpose(0, 2, 3, 1, 4)
    sh = np.arange(4, dtype=np.uint8)[:, None]
    hy = [((hi[:, :, :, 2 * y] << sh) | (hi[:, :, :, 2 * y + 1] << (sh + 4))).astype(np.uint8).sum(axis=3, dtype=np.uint8)
          for y in (0, 1)]
    hib = np.stack(hy, axis=2).transpose(0, 3, 2, 1, 4)
    g = qx.raw.reshape(2, nb, 448).copy()
    g[..., 64:320] = lo.reshape(2, nb, 256)
    g[..., 320:448] = hib.reshape(2, nb, 128)
    codes, d, m = layout.q3x_v4_unparts(g.reshape(-1), n, nb)
    assert np.array_equal(codes, p.codes) and np.array_equal(d, p.d) and np.array_equal(m, p.m)
    old = tmp_path / "v4.mxq"
    with mxq.MxqWriter(old, {"kind": "test"}) as w:
        w.add("w", QTensor("q3x", (32, 128), g.reshape(-1)), None)
    raw = bytearray(old.read_bytes())                                # relabel it version 4, CRC intact
    hoff, hlen = mxq.PREFIX.unpack(bytes(raw[:64]))[2:4]
    hdr = bytes(raw[hoff:hoff + hlen]).replace(b'"version":5', b'"version":4')
    import zlib
    raw[hoff:hoff + hlen] = hdr
    raw[:64] = mxq.PREFIX.pack(mxq.MAGIC, 4, hoff, hlen, len(raw), zlib.crc32(hdr))
    old.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="q3x tensor 'w'.*version 4.*upgrade"):
        mxq.MxqFile(old)
    new = tmp_path / "v5.mxq"
    assert mxq.upgrade(old, new) == 1
    with mxq.MxqFile(new) as f:
        assert mxq._parse_prefix(f.arena)[0] == mxq.VERSION_Q3X
        assert np.array_equal(np.asarray(f.tensors["w"].raw), qx.raw)
    from mixqrt.cli import main                                      # the same through the CLI
    assert main(["upgrade", "-q", str(old), str(tmp_path / "cli.mxq")]) == 0
    assert (tmp_path / "cli.mxq").read_bytes() == new.read_bytes()
    assert main(["upgrade", str(old), str(old)]) == 2                 # never in place


def test_quantize_stores_q4_as_q4x_where_it_can():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 100)).astype(np.float32)
    qx = quantize(w, "q4x")
    assert qx.fmt == "q4x" and np.array_equal(qx.dequantize(), quantize(w, "q4").dequantize())
    assert layout.storage_format("q4", (48, 100)) == "q4x"
    assert layout.storage_format("q4", (40, 100)) == "q4"            # not whole groups: stays q4
    assert layout.storage_format("q4", (896,)) == "q4"
    assert layout.storage_format("q6", (48, 100)) == "q6x" and layout.storage_format("q6", (40, 100)) == "q6"
    assert layout.storage_format("q8", (48, 100)) == "q8"
    assert layout.storage_format("q3p", (48, 100)) == "q3x" and layout.storage_format("q3p", (8, 100)) == "q3p"
    q3 = quantize(w, "q3x")
    assert q3.fmt == "q3x" and np.array_equal(q3.dequantize(), quantize(w, "q3p").dequantize())
    assert to_storage(quantize(w[:40], "q4")).fmt == "q4"
    with pytest.raises(QuantError, match="multiple of 16"):
        quantize(w[:40], "q4x")
    with pytest.raises(QuantError, match="multiple of 16"):
        QTensor("q4x", (40, 100), np.zeros(layout.PACKED["q4"].nbytes((40, 100)), np.uint8))
    rot = quantize(w, "q4x", rot={"block": 4, "seed": 7})           # rotated: stored rotated, as q4
    assert rot.fmt == "q4x" and rot.meta["rot"]["block"] == 4
    np.testing.assert_allclose(rot.dequantize(), quantize(w, "q4", rot={"block": 4, "seed": 7}).dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t", [1, 2, 3, 5, 9, 40])
@settings(max_examples=6)
@given(n=st.sampled_from(ROWS), k=st.sampled_from(COLS), seed=st.integers(0, 2**31))
def test_matmul_exact_every_tier(tier, fmt, t, n, k, seed):
    """Exact inputs: every tier, decode (T = 1) and batched, equals the base format's integer
    emulation bit for bit."""
    if n * k * t > 2_000_000:
        return
    rng = np.random.default_rng(seed)
    q, qx = x_of(fmt, n, k, rng, exact=True)
    x = exact_activations(t, k, rng)
    y = guarded_matmul(qx, x)
    ye, _ = emulate_matmul(q.fmt, (n, k), q.raw, x)
    np.testing.assert_array_equal(y, ye.astype(np.float32))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t", [1, 2, 8])
def test_matmul_random_matches_base_and_threads(tier, fmt, t):
    rng = np.random.default_rng(t)
    q, qx = x_of(fmt, 896, 896, rng)
    x = rng.standard_normal((t, 896)).astype(np.float32)
    y4, yx = ops.matmul(q, x), ops.matmul(qx, x)
    np.testing.assert_allclose(yx, y4, rtol=1e-5, atol=1e-5 * float(np.abs(y4).max()))
    with ops.local_threads(1):
        np.testing.assert_array_equal(ops.matmul(qx, x), yx)          # same rows on one thread


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [1, 33, 257, 896])
def test_few_rows_equal_the_gemm_rows(fmt, k):
    """Products of 2-8 rows (batched decode) go through the decode kernels' unpack with their float fold,
    as the GEMM does: each row is bit for bit that row of a GEMM product (a 12-row product, the cached
    tiles), on the pool or on one thread (and the T = 1 row: test_rows_exact.py)."""
    rng = np.random.default_rng(k)
    _, qx = x_of(fmt, 48, k, rng)
    x = rng.standard_normal((12, k)).astype(np.float32)
    big = ops.matmul(qx, x)                                          # 12 rows: the GEMM
    try:
        for t in range(2, 9):
            few = ops.matmul(qx, x[:t])
            with ops.local_threads(1):
                np.testing.assert_array_equal(ops.matmul(qx, x[:t]), few)
            np.testing.assert_array_equal(big[:t], few)
        ops.set_gemm_cache(1 << 24)
        np.testing.assert_array_equal(ops.matmul(qx, x[:3]), big[:3])
        np.testing.assert_array_equal(ops.matmul(qx, x[:3]), big[:3])
    finally:
        ops.set_gemm_cache(0)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [1, 33, 257, 896])
def test_avx2_rows_equal_the_decode_rows(fmt, k):
    """The AVX2 tier's products of several rows (its decode kernels' unpack shared by up to 4 tokens,
    each with the decode kernel's float fold) give every row bit for bit as a single-row product, for
    row counts across the 4-token tiles, on the pool or on one thread."""
    if "avx2" not in isa.available():
        pytest.skip("no AVX2 tier on this CPU")
    rng = np.random.default_rng(k + 1)
    _, qx = x_of(fmt, 48, k, rng)
    x = rng.standard_normal((11, k)).astype(np.float32)
    before = isa.current()
    try:
        isa.set_isa("avx2")
        rows = np.concatenate([ops.matmul(qx, x[t:t + 1]) for t in range(11)])
        for t in (2, 3, 4, 5, 11):
            np.testing.assert_array_equal(ops.matmul(qx, x[:t]), rows[:t])
            with ops.local_threads(1):
                np.testing.assert_array_equal(ops.matmul(qx, x[:t]), rows[:t])
    finally:
        isa.set_isa(before)


@pytest.mark.parametrize("fmt", FMTS)
def test_gemm_tiles_cached_and_row_ranges(fmt):
    if "avx512" not in isa.available():
        pytest.skip("no AVX-512 tier on this CPU")
    rng = np.random.default_rng(3)
    q, qx = x_of(fmt, 64, 257, rng, exact=True)
    x = exact_activations(5, 257, rng)
    fid, raw, n, k, lv, lo, step = ops._weight_args(qx)
    tiles = np.empty(_ops.gemm_tiles_bytes(fid, n, k) + 64, np.uint8)
    off = (-tiles.ctypes.data) % 64
    tiles = tiles[off:off + _ops.gemm_tiles_bytes(fid, n, k)]
    assert _ops.gemm_tiles(fid, raw, n, k, tiles, lv, lo, step)
    y = np.empty((5, n), np.float32)
    _ops.matmul(fid, raw, n, k, x, y, lv, lo, step, 0, tiles)
    ye, _ = emulate_matmul(q.fmt, (n, k), q.raw, x)
    np.testing.assert_array_equal(y, ye.astype(np.float32))
    part = row_slice(qx, 16, 48)                                     # whole groups: a view
    assert part.fmt == fmt and np.shares_memory(part.raw, qx.raw)
    np.testing.assert_array_equal(ops.matmul(part, x), y[:, 16:48])
    with pytest.raises(KernelError, match="multiples of 16"):
        row_slice(qx, 8, 48)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_entry_points_refuse_partial_groups(fmt):
    raw = np.zeros(layout.PACKED[layout.INTERLEAVED[fmt][0]].nbytes((24, 64)), np.uint8)
    fid = layout.FMT_ID[fmt]
    x, y = np.zeros((1, 64), np.float32), np.zeros((1, 24), np.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        _ops.matmul(fid, raw, 24, 64, x, y)
    with pytest.raises(ValueError, match="multiple of 16"):
        _ops.dequant_rows(fid, raw, 24, 64, np.zeros(1, np.int64), np.zeros((1, 64), np.float32))


def test_mxq_version_4_and_upgrade(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q4 = quantize(w, "q4")
    old, new = tmp_path / "old.mxq", tmp_path / "new.mxq"
    with mxq.MxqWriter(old, {"k": 1}) as wr:
        wr.add("a.weight", q4, layer=None)
        wr.add("b.weight", quantize(w[:8], "q4"), layer=None)          # 8 rows: stays q4
        wr.add("c.weight", quantize(w, "q3p"), layer=None)
    assert int.from_bytes(old.read_bytes()[4:8], "little") == mxq.VERSION
    assert mxq.upgrade(old, new) == 2
    with mxq.MxqFile(new) as f:
        assert f.info["a.weight"].fmt == "q4x" and f.info["b.weight"].fmt == "q4" and f.info["c.weight"].fmt == "q3x"
        np.testing.assert_array_equal(f.tensors["c.weight"].dequantize(), quantize(w, "q3p").dequantize())
        assert mxq._parse_prefix(f.arena)[0] == mxq.VERSION_Q3X      # it holds a q3x tensor
        np.testing.assert_array_equal(f.tensors["a.weight"].dequantize(), q4.dequantize())


def test_reader_refuses_q4x_in_an_older_version():
    with pytest.raises(FormatError, match="needs .mxq version 4"):
        mxq._check_tensor("t", {"fmt": "q4x", "shape": [16, 32], "offset": 4096, "nbytes": 320, "layer": None},
                          1 << 20, 64, 4096, version=3)
    with pytest.raises(FormatError, match="multiple of 16"):
        mxq._check_tensor("t", {"fmt": "q4x", "shape": [8, 32], "offset": 4096, "nbytes": 160, "layer": None},
                          1 << 20, 64, 4096, version=4)


def test_matmul_then_prefetch_changes_nothing():
    """matmul(then=W2) only reads W2 in the background: same product, same next product."""
    rng = np.random.default_rng(5)
    a = quantize(rng.standard_normal((256, 896)).astype(np.float32), "q4x")
    b = quantize(rng.standard_normal((512, 896)).astype(np.float32), "q3x")
    x = rng.standard_normal(896).astype(np.float32)
    ya, yb = ops.matmul(a, x), ops.matmul(b, x)
    before = ops.GAP_PREFETCH_BYTES
    try:
        for nbytes in (1, 4096, 8 << 20):
            ops.GAP_PREFETCH_BYTES = nbytes
            np.testing.assert_array_equal(ops.matmul(a, x, then=b), ya)
            np.testing.assert_array_equal(ops.matmul(b, x, then=a), yb)
            np.testing.assert_array_equal(ops.matmul(a, x, then=np.ones((4, 896), np.float32)), ya)
        _ops.prefetch(b.raw, b.nbytes)
        _ops.prefetch_wait()
        with pytest.raises(ValueError, match="contiguous"):
            _ops.prefetch(np.zeros((2, 2), np.uint8), 4)
    finally:
        ops.GAP_PREFETCH_BYTES = before


def test_q3x_keeps_its_level_table(tier):
    """A q3x tensor decodes and multiplies with the q3p level table in its meta (a file written with
    another table), like q3p, on every tier (each builds its own lookup tables from it)."""
    rng = np.random.default_rng(6)
    table = np.array([0, 9, 18, 27, 36, 45, 54, 63], np.uint8)
    q, qx = x_of("q3x", 32, 256, rng)
    q.meta, qx.meta = {"q3p_levels": table}, {"q3p_levels": table}
    np.testing.assert_array_equal(qx.dequantize(), q.dequantize())
    for t in (1, 3, 20):   # decode, few-row and GEMM paths: each builds its lookups from the table
        x = rng.standard_normal((t, 256)).astype(np.float32)
        np.testing.assert_allclose(ops.matmul(qx, x), ops.matmul(q, x), rtol=1e-5, atol=1e-5)
    assert not np.allclose(q.dequantize(), QTensor("q3p", q.shape, q.raw).dequantize())


def test_quantize_model_stores_interleaved_and_keeps_fused_parts_sliceable(tmp_path, monkeypatch):
    """quantize_model writes q4 / q6 / q3p matrices interleaved (version 4); a fused gate_up whose
    parts are not whole groups (intermediate 24: 2 x 24 = 48 rows) stays in rows, so the scheduler's
    row_slice of its gate and up halves still works."""
    import tinymodel
    from mixqrt.quantize.convert import quantize_model
    from mixqrt.io.mxq import MxqFile
    monkeypatch.setattr(tinymodel, "INTER", 24)
    src = tinymodel.make_tiny_hf_model(tmp_path / "hf", dtype="f32")
    out = tmp_path / "m.mxq"
    quantize_model(str(src), "q4", str(out), progress=False, offline=True)
    with MxqFile(out) as f:
        fmts = {n: t.fmt for n, t in f.info.items()}
        assert int.from_bytes(out.read_bytes()[4:8], "little") == mxq.VERSION_X
    gu = fmts["model.layers.0.mlp.gate_up_proj.weight"]
    assert gu == "q4"                                                # 24-row parts: rows
    assert fmts["model.layers.0.self_attn.o_proj.weight"] == "q4x"   # 64 rows
    assert fmts["model.layers.0.mlp.down_proj.weight"] == "q4x"
    import mixqrt
    m = mixqrt.load(str(out)).model
    g, u = row_slice(m.layers[0].gate_up[0], 0, 24), row_slice(m.layers[0].gate_up[0], 24, 48)
    assert g.shape == (24, 64) and u.shape == (24, 64)
