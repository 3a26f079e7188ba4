"""Randomized block Hadamard rotation (formats/rotation.py): the op on every ISA tier against its numpy
reference, the rotation round trip (rotated weights times rotated activations = the product), GPTQ on
rotated weights, the .mxq record (version 3) and the end-to-end model."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mixqrt
import mixqrt.platform.isa as isa
from mixqrt import ops
from mixqrt.ops import ref as ops_ref
from mixqrt.cli import parse_rotate
from mixqrt.quantize.convert import quantize_model
from mixqrt.errors import FormatError, KernelError, QuantError
from mixqrt.io.mxq import MxqFile, MxqWriter
from mixqrt.formats import dequantize, layout, quantize, rotation
from mixqrt.quantize.gptq import Hessian, gptq_quantize

from tinymodel import make_tiny_hf_model

ROT = {"block": 64, "seed": rotation.DEFAULT_SEED}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), t=st.sampled_from([1, 3, 17]), b=st.sampled_from([2, 4, 8, 16, 32, 64, 128, 1024]),
       nb=st.sampled_from([1, 2, 7, 14]), with_signs=st.booleans())
def test_hadamard_is_bit_identical_on_every_tier(seed, t, b, nb, with_signs):
    k = b * nb
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 100)).astype(np.float32)
    s = rotation.signs(seed, k) if with_signs else None
    ref = ops_ref.hadamard(x, b, s)
    before = isa.current()
    try:
        for name in isa.available():
            isa.set_isa(name)
            y = ops.hadamard(x, b, s)
            assert y.dtype == np.float32 and y.shape == x.shape
            assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), name
            assert np.array_equal(ops.hadamard(x[0], b, s), ref[0])            # 1-D input
    finally:
        isa.set_isa(before)
    # orthonormal: the norm of each row is kept, and the map is its own inverse (without signs)
    np.testing.assert_allclose(np.linalg.norm(ref, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(ops.hadamard(ops.hadamard(x, b), b), x, rtol=1e-4, atol=1e-5 * np.abs(x).max())


def test_hadamard_matches_the_matrix():
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    want = (x.reshape(2, 2, 16) @ (h / 4).T).reshape(2, 32)
    np.testing.assert_allclose(ops.hadamard(x, 16), want, rtol=1e-6, atol=1e-6)


def test_signs_are_balanced_and_read_only():
    s = rotation.signs(7, 4096)
    assert set(np.unique(s)) == {-1.0, 1.0} and abs(s.mean()) < 0.1
    assert not s.flags.writeable
    assert np.array_equal(rotation.signs(7, 64), s[:64])          # a prefix: the column index decides


def test_signs_pinned_values():
    # splitmix64 of the column index, bit 63 (rotation.py); computed independently here in Python ints
    def sm(seed, i):
        m = (1 << 64) - 1
        z = (seed + i * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        return -1.0 if z >> 63 else 1.0
    for seed in (0, rotation.DEFAULT_SEED, 2**64 - 1):
        assert rotation.signs(seed, 100).tolist() == [sm(seed, i) for i in range(1, 101)]


@pytest.mark.parametrize("fmt", ["q3p", "q4", "q6", "q8", "q2c", "q3u"])
@pytest.mark.parametrize("k", [64, 896])
def test_rotation_round_trip_on_every_tier(tier, fmt, k):
    """Rotate the weights and the activations: the same product, within float tolerance."""
    rng = np.random.default_rng(k)
    w = (rng.standard_normal((33, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    # exact weights: (W R)(R^T x) == W x
    wr = rotation.rotate(w, ROT)
    y = ops.matmul(wr, ops.hadamard(x, 64, rotation.signs(ROT["seed"], k)))
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4 * np.abs(x @ w.T).max())
    np.testing.assert_allclose(rotation.unrotate(wr, ROT), w, atol=1e-6)
    # a rotated QTensor: ops.matmul rotates x itself and matches the reference on its dequantized W
    qt = quantize(w, fmt, rot=ROT, search=fmt not in ("q2c", "q8"))
    assert dict(qt.meta["rot"]) == ROT
    ref = ops_ref.matmul(qt, x)
    got = ops.matmul(qt, x)
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.02 * np.abs(ref).max())
    np.testing.assert_allclose(ops.matmul(qt, x[0]), got[0], rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # embedding lookup of a rotated table: the effective rows
    np.testing.assert_array_equal(ops.embed(qt, [0, 5, 32]), dequantize(qt)[[0, 5, 32]])


@pytest.mark.parametrize("fmt", ["q3p", "q6", "q8", "q2c"])
def test_rotation_inside_the_matmul_call_is_bit_identical(tier, fmt):
    """_ops.matmul rotates a rotated weight's input itself (in its C call, on the pool for T > 1):
    the same bits as ops.hadamard first, then the product on the unrotated-meta tensor."""
    import copy
    rng = np.random.default_rng(11)
    k = 896
    qt = quantize((rng.standard_normal((37, k)) * 0.05).astype(np.float32), fmt, rot=ROT)
    plain = copy.copy(qt)
    plain.meta = {key: v for key, v in qt.meta.items() if key != "rot"}
    sg = rotation.signs(ROT["seed"], k)
    for t in (1, 2, 3, 9, 17):
        x = rng.standard_normal((t, k)).astype(np.float32)
        np.testing.assert_array_equal(ops.matmul(qt, x), ops.matmul(plain, ops.hadamard(x, ROT["block"], sg)))


@pytest.mark.parametrize("fmt,rot", [("q3p", ROT), ("q6", None), ("q8", ROT), ("q2c", None), ("q4x", None),
                                     ("q3x", None), ("q6x", None), ("f32", None)])
def test_matmul_silu_of_a_fused_gate_up_is_bit_identical(tier, fmt, rot):
    """ops.matmul(w, gu, silu=True) makes silu(gate) * up row by row inside the call (then the rotation,
    then the activation quantization) for packed weights, and falls back to silu_mul for float ones:
    the same bits as silu_mul then matmul, on every tier, for 1 row (decode) and prompts, on the pool
    and on one thread."""
    rng = np.random.default_rng(13)
    k = 256
    w = (rng.standard_normal((48, k)) * 0.05).astype(np.float32)
    qt = w if fmt == "f32" else quantize(w, fmt, rot=rot)
    for t in (1, 2, 5, 9, 33):
        gu = (rng.standard_normal((t, 2 * k)) * 3).astype(np.float32)
        want = ops.matmul(qt, ops.silu_mul(gu[:, :k], gu[:, k:]))
        np.testing.assert_array_equal(ops.matmul(qt, gu, silu=True), want)
        with ops.local_threads(1):
            np.testing.assert_array_equal(ops.matmul(qt, gu, silu=True), want)
    np.testing.assert_array_equal(ops.matmul(qt, gu[0], silu=True), ops.matmul(qt, ops.silu_mul(gu[:1, :k], gu[:1, k:]))[0])
    with pytest.raises(KernelError, match="silu"):
        ops.matmul(qt, gu[:, :k], silu=True)
    with pytest.raises(KernelError, match="even length"):
        ops.matmul(qt, gu[:, 1:], silu=True)


def test_matmul_refuses_bad_rotation_arguments():
    from mixqrt._kernels import _ops
    qt = quantize(np.ones((4, 64), np.float32), "q6")
    x, y = np.zeros((1, 64), np.float32), np.zeros((1, 4), np.float32)
    fid, raw, n, k, lv, lo, step = ops._weight_args(qt)
    for sg, b, match in ((np.ones(64, np.float32), 48, "power of two"), (np.ones(64, np.float32), 128, "power of two"),
                         (None, 32, "needs its signs"), (np.ones(32, np.float32), 32, "32 rotation signs")):
        with pytest.raises(ValueError, match=match):
            _ops.matmul(fid, raw, n, k, x, y, lv, lo, step, 0, None, sg, b, 0.1)
    f32 = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="packed weight"):
        _ops.matmul(layout.FMT_ID["f32"], f32.view(np.uint8).reshape(-1), 4, 64, x, y, None, 0.0, 0.0, 0, None, np.ones(64, np.float32), 32, 0.1)


def test_rotated_matmul_above_the_kept_buffer_size():
    """An input whose quantized activations are too large for the per-thread kept buffer (mq_call_buf
    keeps <= 64 MiB) gets its own block, freed after the call: the same bits as rotating first and
    multiplying the plain tensor, and the call after it is unaffected. (The rotated rows themselves
    are made one at a time in the thread's scratch row, never all at once.)"""
    import copy
    rng = np.random.default_rng(3)
    k = 4864
    qt = quantize((rng.standard_normal((16, k)) * 0.05).astype(np.float32), "q3p", rot=ROT)
    plain = copy.copy(qt)
    plain.meta = {key: v for key, v in qt.meta.items() if key != "rot"}
    sg = rotation.signs(ROT["seed"], k)
    x = rng.standard_normal((11200, k)).astype(np.float32)      # 68 MB of quantized activations
    np.testing.assert_array_equal(ops.matmul(qt, x), ops.matmul(plain, ops.hadamard(x, ROT["block"], sg)))
    np.testing.assert_array_equal(ops.matmul(qt, x[:5]), ops.matmul(plain, ops.hadamard(x[:5], ROT["block"], sg)))


def test_rotated_matmul_is_safe_across_sizes_and_threads():
    """ops.matmul rotates the input into a per-thread buffer that calls reuse (mq_call_buf): calls of
    different sizes in a row, and two threads at once, each get their own product."""
    import threading
    rng = np.random.default_rng(5)
    a = quantize((rng.standard_normal((40, 896)) * 0.05).astype(np.float32), "q3p", rot=ROT)
    b = quantize((rng.standard_normal((24, 128)) * 0.05).astype(np.float32), "q6", rot=ROT)
    xs = [rng.standard_normal((t, k)).astype(np.float32) for t, k in ((9, 896), (1, 128), (3, 896), (17, 128))]
    want = [ops_ref.matmul(a if x.shape[1] == 896 else b, x) for x in xs]
    for _ in range(2):
        for x, ref in zip(xs, want):
            got = ops.matmul(a if x.shape[1] == 896 else b, x)
            np.testing.assert_allclose(got, ref, rtol=0, atol=0.02 * np.abs(ref).max())
    x_before = [x.copy() for x in xs]
    errors = []

    def worker(order):
        try:
            for _ in range(30):
                for i in order:
                    got = ops.matmul(a if xs[i].shape[1] == 896 else b, xs[i])
                    np.testing.assert_allclose(got, want[i], rtol=0, atol=0.02 * np.abs(want[i]).max())
        except Exception as e:    # noqa: BLE001 (reported below)
            errors.append(e)
    ths = [threading.Thread(target=worker, args=(o,)) for o in ([0, 1, 2, 3], [3, 2, 1, 0])]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors[0]
    for x, x0 in zip(xs, x_before):
        np.testing.assert_array_equal(x, x0)      # the caller's input is never rotated in place


@pytest.mark.parametrize("fmt", ["q3p", "q4", "q2c"])
def test_rotation_lowers_the_error_on_outlier_weights(fmt):
    rng = np.random.default_rng(1)
    w = (rng.standard_t(3, (256, 896)) * 0.02).astype(np.float32)         # heavy tails
    plain = np.mean((dequantize(quantize(w, fmt, search=fmt != "q2c")) - w) ** 2)
    rot = np.mean((dequantize(quantize(w, fmt, search=fmt != "q2c", rot=ROT)) - w) ** 2)
    assert rot < plain


def test_bad_rotations_are_rejected():
    w = np.zeros((4, 96), np.float32)
    with pytest.raises(QuantError, match="does not divide"):
        quantize(w, "q3p", rot={"block": 64, "seed": 1})
    with pytest.raises(QuantError, match="power of two"):
        quantize(w, "q3p", rot={"block": 48, "seed": 1})
    with pytest.raises(QuantError, match="keys"):
        quantize(w, "q3p", rot={"block": 32})
    with pytest.raises(QuantError, match="seed"):
        quantize(w, "q3p", rot={"block": 32, "seed": -1})
    with pytest.raises(QuantError, match="packed matrix"):
        quantize(w, "f32", rot={"block": 32, "seed": 1})
    with pytest.raises(QuantError, match="importance"):
        quantize(w, "q3p", rot={"block": 32, "seed": 1}, importance=np.ones(96, np.float32))
    with pytest.raises(KernelError, match="power of two"):
        ops.hadamard(np.zeros(96, np.float32), 64)
    with pytest.raises(KernelError, match="signs"):
        ops.hadamard(np.zeros(64, np.float32), 64, np.ones(32, np.float32))
    with pytest.raises(SystemExit, match="ROLE=BLOCK"):
        parse_rotate(["ffn_down=63"])
    with pytest.raises(SystemExit, match="ROLE=BLOCK"):
        parse_rotate(["nonsense=64"])
    assert parse_rotate(["ffn_down=64", "embed=32"]) == {"ffn_down": 64, "embed": 32}
    assert parse_rotate(["none"]) == {} and parse_rotate(None) is None


def test_rotated_hessian_is_the_hessian_of_rotated_inputs():
    rng = np.random.default_rng(2)
    k = 320
    x = (rng.standard_normal((200, k)) * np.linspace(0.1, 4, k)).astype(np.float32)
    h = Hessian(k, 64, 128)                       # three spans: block-diagonal
    h.add(x)
    want = Hessian(k, 64, 128)
    want.add(rotation.rotate(x, ROT))
    got = h.rotated(ROT)
    assert got.spans == want.spans and got.tokens == want.tokens
    for a, b in zip(got.blocks, want.blocks):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    with pytest.raises(QuantError, match="splits"):
        Hessian(192, 32, 96).rotated({"block": 64, "seed": 1})     # spans of 96 columns


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([1, 3, 17]), k=st.sampled_from([64, 128, 256]),
       t=st.sampled_from([40, 300]), fmt=st.sampled_from(["q3p", "q4", "q6"]))
def test_rotated_gptq_never_worse_than_rotated_rtn(seed, n, k, t, fmt):
    """GPTQ on the rotated rows with the rotated Hessian: the calibration loss ||W X - Ŵ X||^2 of the
    effective weights is never above rotated RTN's (the rotation is orthogonal, so the loss is the
    same in either basis)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, rng.integers(0, k, size=k // 16)] *= 8
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    h = Hessian(k, 64, 1024)
    h.add(x)
    g = gptq_quantize(rotation.rotate(w, ROT), fmt, h.rotated(ROT))
    g.meta = {**g.meta, "rot": ROT}
    r = quantize(w, fmt, search=True, rot=ROT)
    hf = x.astype(np.float64).T @ x.astype(np.float64)
    lg, lr = (np.einsum("ij,jk,ik->i", e, hf, e) for e in ((w - dequantize(q)).astype(np.float64) for q in (g, r)))
    assert (lg <= lr * (1 + 1e-4) + 1e-9).all()


def test_mxq_records_rotations_in_version_3(tmp_path):
    w = (np.random.default_rng(3).standard_normal((8, 128)) * 0.1).astype(np.float32)
    qt = quantize(w, "q3p", rot=ROT)
    plain = quantize(w, "q3p")
    with MxqWriter(tmp_path / "r.mxq", {"arch": "x"}) as f:
        f.add("a", qt)
        f.add("b", plain)
    with MxqWriter(tmp_path / "p.mxq", {"arch": "x"}) as f:
        f.add("b", plain)
    version = lambda p: struct.unpack("<I", (tmp_path / p).read_bytes()[4:8])[0]   # noqa: E731
    assert version("r.mxq") == 3 and version("p.mxq") == 2        # no rotation: still readable by older mixqrt
    with MxqFile(tmp_path / "r.mxq") as f:
        assert dict(f.tensors["a"].meta["rot"]) == ROT and not f.tensors["b"].meta
        np.testing.assert_array_equal(dequantize(f.tensors["a"]), dequantize(qt))
        assert f.info["a"].rot == ROT
    with pytest.raises(FormatError, match="packed matrix"):
        with MxqWriter(tmp_path / "bad.mxq", {}) as f:
            f.add("v", type("T", (), {"fmt": "f32", "shape": (4, 64), "raw": np.zeros(1024, np.uint8),
                                      "meta": {"rot": ROT}})())
    assert not (tmp_path / "bad.mxq").exists()
    # a refused rotation is refused before any byte is written: the writer goes on without the tensor
    with MxqWriter(tmp_path / "go.mxq", {"arch": "x"}) as f:
        with pytest.raises(FormatError, match="does not divide"):
            f.add("a", type("T", (), {"fmt": qt.fmt, "shape": qt.shape, "raw": qt.raw,
                                      "meta": {"rot": {"block": 256, "seed": 1}}})())
        f.add("b", plain)
    with MxqFile(tmp_path / "go.mxq") as f:
        assert list(f.info) == ["b"] and version("go.mxq") == 2


def _rewrite_header(path, edit, version=None):
    """Re-encode an .mxq header after edit(header) (CRC and sizes recomputed)."""
    import json
    import zlib
    from mixqrt.io.mxq import MAGIC, PREFIX
    b = bytearray(path.read_bytes())
    _, ver, hoff, hlen, _, _ = PREFIX.unpack(bytes(b[:PREFIX.size]))
    h = json.loads(bytes(b[hoff:hoff + hlen]))
    edit(h)
    ver = version or ver
    h["version"] = ver
    raw = json.dumps(h).encode()
    out = bytes(b[:hoff]) + raw
    path.write_bytes(PREFIX.pack(MAGIC, ver, hoff, len(raw), len(out), zlib.crc32(raw)) + out[PREFIX.size:])


@pytest.mark.parametrize("edit, version, match", [
    (lambda h: h["tensors"]["a"].__setitem__("rot", {"block": 64, "seed": 1}), 2, "keys"),       # v2: no rot
    (lambda h: h["tensors"]["a"].__setitem__("rot", {"block": 48, "seed": 1}), None, "power of two"),
    (lambda h: h["tensors"]["a"].__setitem__("rot", {"block": 256, "seed": 1}), None, "does not divide"),
    (lambda h: h["tensors"]["a"].__setitem__("rot", [64, 1]), None, "keys"),
    (lambda h: h["tensors"]["a"].__setitem__("rot", {"block": 64, "seed": 2**64}), None, "seed"),
])
def test_lying_rotation_records_are_refused(tmp_path, edit, version, match):
    qt = quantize(np.ones((8, 128), np.float32), "q3p", rot=ROT)
    with MxqWriter(tmp_path / "r.mxq", {"arch": "x"}) as f:
        f.add("a", qt)
    _rewrite_header(tmp_path / "r.mxq", edit, version)
    with pytest.raises(FormatError, match=match):
        MxqFile(tmp_path / "r.mxq")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tinyrot") / "m", arch="qwen2", tied=True, seed=0)


def test_rotated_model_end_to_end(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    rot = {"ffn_gate": 32, "ffn_up": 32, "ffn_down": 32, "embed": 32}
    a = quantize_model(str(tiny), "2356", tmp_path / "r.mxq", progress=False, rotate=rot)
    b = quantize_model(str(tiny), "2356", tmp_path / "n.mxq", progress=False, rotate={})
    assert a.total_bytes == b.total_bytes and a.recipe["rotate"] == rot and "rotate" not in b.recipe
    with MxqFile(tmp_path / "r.mxq") as f:
        rotated = {n for n, t in f.info.items() if t.rot}
    assert rotated and all(".mlp." in n or "embed" in n for n in rotated)
    f32 = mixqrt.load(str(tiny), "f32", progress=False)
    ids = np.arange(3, 40)
    ref = f32.logits(ids)
    def err(name):
        m = mixqrt.load(str(tmp_path / name), progress=False)
        try:
            return float(np.mean((m.logits(ids) - ref) ** 2))
        finally:
            m.close()
    # a graph that forgot to rotate the activations would be far off (error ~ 2x the logits' energy);
    # the rotated file is as close to f32 as the plain one, or closer
    e_rot, e_plain = err("r.mxq"), err("n.mxq")
    assert np.isfinite(e_rot) and e_rot < 1.25 * e_plain
    cal = quantize_model(str(tiny), "2356", tmp_path / "c.mxq", progress=False, rotate=rot,
                         calibrate="def f(x):\n    return x * 2\n" * 50, calib_tokens=64, calib_ctx=32)
    assert cal.total_bytes == a.total_bytes
    assert err("c.mxq") < 1.25 * e_plain


@pytest.mark.parametrize("fmt", ["q3p", "q4", "q6", "q2c"])
def test_rotated_row_slabs_give_the_whole_matrix_bytes(fmt, monkeypatch):
    from mixqrt.formats import codec as formats
    w = np.random.default_rng(5).standard_normal((37, 128)).astype(np.float32)
    whole = quantize(w, fmt, rot=ROT, search=fmt != "q2c")
    monkeypatch.setattr(formats, "_ROT_ROWS", 5)
    slabs = quantize(w, fmt, rot=ROT, search=fmt != "q2c")
    assert np.array_equal(whole.raw, slabs.raw) and dict(slabs.meta["rot"]) == ROT


def test_in_place_rotation_matches_and_refuses_views_it_cannot_write():
    w = np.random.default_rng(6).standard_normal((9, 128)).astype(np.float32)
    want = rotation.rotate(w, ROT)
    got = rotation.rotate(w, ROT, inplace=True)
    assert got is w and np.array_equal(got, want)
    with pytest.raises(QuantError, match="in-place"):
        rotation.rotate(np.ones((4, 128)), ROT, inplace=True)              # float64: would need a copy
    with pytest.raises(QuantError, match="in-place"):
        rotation.rotate(np.ones((4, 256), np.float32)[:, ::2], ROT, inplace=True)
