"""docs/architecture.md, "Adding a format": a new row format is its codec (its C quantizer in
src/quant/quant.c and its numpy reference in formats/codec.py), its traits rows (mq_format.h and
formats/layout.py's _ROWS) and its unpack in one kernel file per SIMD tier (kern_avx2.c,
kern_avx512_impl.h; the portable tier and the dequantizer read the traits row), plus a test.

This test adds a toy format that way: q2u, 2-bit uniform codes with a (d, m) header, 32 weights a
block. It copies the kernel sources, inserts the toy's lines at exactly the places the doc names
(nothing else changes), compiles them with setup.py's flags into a small library, and checks: the C
quantizer gives the reference's bytes, the dequantizer its values, and every tier's products (decode,
the few-row exact rows, the GEMM) the numpy emulation of the integer product. The Python side gets the
toy's rows the same way: its traits row joined with the C row (layout.build_traits) and its reference
quantizer in codec.REFERENCE."""
from __future__ import annotations

import ast
import ctypes
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixqrt.formats import codec, layout

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "mixqrt" / "_kernels" / "src"
X86 = platform.machine().lower() in ("x86_64", "amd64")

# the toy's rows and kernels: (file, anchor, text inserted after the anchor), each anchor found once
TOY = "q2u"
EDITS = [
    # 1. its traits row (mq_format.h): its id among the row formats, its sizes, its list entry, its spec
    ("common/mq_format.h", "MQ_Q8, MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P, MQ_Q2C, MQ_Q5G,", " MQ_Q2U,"),
    ("common/mq_format.h", "#define MQ_Q5G_BLOCK MQ_BLOCK_BYTES(MQ_Q5G_HEADER, MQ_Q5G_GROUP, MQ_Q5G_BITS)\n",
     "#define MQ_Q2U_BLOCK MQ_BLOCK_BYTES(4, 32, 2)\n"),
    ("common/mq_format.h", "X(q5g, MQ_Q5G)", " X(q2u, MQ_Q2U)"),
    ("common/mq_format.h", "MQ_Q5G_TRAILER, 0, MQ_Q5G_BITS, MQ_LV_CODES},\n",
     '    [MQ_Q2U] = {"q2u", 2, 32, 4, MQ_Q2U_BLOCK, 0, 0, 2, MQ_LV_CODES},\n'),
    # 2. its codec, the C side (quant.c): a uniform block quantizer, as q4's with top code 3
    ("quant/quant.c", "            case MQ_Q5G: blk_q5g(xb, nv, codes, lo, step); break;\n",
     "            case MQ_Q2U: blk_uni(xb, nv, dst, codes, 3.0f); break;\n"),
    # 3. its kernels: its case in each SIMD tier's unpack template
    ("ops/kern_avx2.c", "    /* a new row format: its case above (docs/architecture.md, \"Adding a format\") */\n", """\
    case MQ_Q2U: {
        const uint8_t *A = row + (size_t)c * MQ_Q2U_BLOCK;
        *dw = h2f(A + MQ_HDR_D); *mm = h2f(A + MQ_HDR_M);
        return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)rd64(A + 4)), sh2), m3);
    }
"""),
    ("ops/kern_avx512_impl.h", "    /* a new row format: its case above (docs/architecture.md, \"Adding a format\") */\n", """\
    case MQ_Q2U: {
        const uint8_t *A = row + (size_t)(2 * p) * MQ_Q2U_BLOCK, *B = two ? A + MQ_Q2U_BLOCK : A;
        __m512 d = _mm512_cvtph_ps(h16x2(A, B)), m = _mm512_cvtph_ps(h16x2(A + MQ_HDR_M, B + MQ_HDR_M));
        if (!two) { d = _mm512_maskz_mov_ps(0x00ff, d); m = _mm512_maskz_mov_ps(0x00ff, m); }
        *dv = d; *mv = m;
        __m512i h = _mm512_mask_set1_epi64(_mm512_set1_epi64((long long)rd64(A + 4)), 0xf0, (long long)rd64(B + 4));
        return _mm512_and_si512(_mm512_srlv_epi64(h, sh2), m3);
    }
"""),
]
# 4. its Python traits row (layout._ROWS) and its reference quantizer (codec.REFERENCE)
TOY_ROW = (TOY, "uniform", True, True, False, False, False, None)

SOURCES = ["common/cpu.c", "common/format.c", "common/f16_avx2.c", "quant/quant.c", "quant/kmeans.c",
           "quant/search.c", "ops/dispatch.c", "ops/shared.c", "ops/kern_generic.c", "ops/kern_avx2.c",
           "ops/kern_avx512.c", "ops/kern_base_avx512.c", "ops/kern_mv_avx512.c", "ops/kern_gemm_avx512.c",
           "ops/kern_float_avx512.c"]

HARNESS = r"""
#include <stdlib.h>
#include <string.h>
#include "cpu.h"
#include "mq_ops.h"
#include "quant.h"
#define API __attribute__((visibility("default")))
API int toy_nfmt(void) { return MQ_NFMT; }
API int toy_npacked(void) { return MQ_NPACKED; }
API const char *toy_name(int f) { return MQ_FORMATS[f].name; }
API void toy_spec(int f, int *v) {
    const mq_fmt_spec *s = &MQ_FORMATS[f];
    v[0] = s->bits; v[1] = s->group; v[2] = s->header; v[3] = s->block_bytes; v[4] = s->trailer;
    v[5] = s->off; v[6] = s->pack; v[7] = s->levels; v[8] = mq_x_base(f);
}
API int toy_best_isa(void) { return mq_cpu_best_isa(); }
API int toy_quantize(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out) {
    return mq_quantize(fmt, x, n, k, out, NULL, 0.0f, 0.0f);
}
API int toy_dequantize(int fmt, const uint8_t *raw, int64_t n, int64_t k, float *out) {
    return mq_dequantize_rows(fmt, raw, k, NULL, n, out, NULL, 0.0f, 0.0f);
}
/* y [T, N] = W x on tier isa, as ops.matmul calls the kernels; q [T, kp], xd, xs [T, kp / 32]: the
 * quantized activations */
API int toy_matmul(int isa, int fmt, const uint8_t *w, int N, int K, const float *x, int T, float *y,
                   int8_t *q, float *xd, float *xs) {
    if (mq_isa_set(isa) != isa) return -1;
    const int G = MQ_FORMATS[fmt].group, kp = (K + 127) / 128 * 128;
    mq_act a = {q, xd, xs, T, K, kp, kp / 32, NULL, 0};
    mq_quantize_act_rows(x, (size_t)K, &a, 0, T);
    mq_mm_job j;
    memset(&j, 0, sizeof j);
    j.fmt = fmt; j.w = w; j.row_bytes = (size_t)mq_row_bytes(fmt, K); j.N = N; j.K = K;
    j.nc = (K + G - 1) / G * (G / MQ_CHUNK); j.a = &a; j.T = T; j.y = y; j.ldy = (size_t)N;
    mq_mm_rows(&j, 0, N);
    return 0;
}
"""


def _setup_flags():
    """BASE_FLAGS and ISA_FLAGS as setup.py gives them to the build (read, not imported)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("BASE_FLAGS", "ISA_FLAGS"):
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out["BASE_FLAGS"], out["ISA_FLAGS"]


def add_toy(tree: Path):
    for rel, anchor, text in EDITS:
        p = tree / rel
        src = p.read_text()
        assert src.count(anchor) == 1, f"{rel}: the walk-through's place {anchor.strip()!r} is gone or not unique"
        p.write_text(src.replace(anchor, anchor + text))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    assert cc, "no C compiler (the build needs one too)"
    tree = tmp_path_factory.mktemp("toyfmt") / "src"
    shutil.copytree(SRC, tree)
    add_toy(tree)
    (tree / "harness.c").write_text(HARNESS)
    base, isa = _setup_flags()
    inc = [f"-I{tree / d}" for d in ("common", "ops", "quant")]
    jobs, objs = [], []
    for rel in SOURCES + ["harness.c"]:
        extra = [f for suffix, fl in isa.items() if rel.endswith(suffix) for f in fl]
        if extra and not X86:
            continue   # as setup.py: the tier files are x86 only
        obj = tree / (rel.replace("/", "_") + ".o")
        objs.append(str(obj))
        jobs.append(subprocess.Popen([cc, *base, "-fPIC", *extra, *inc, "-c", str(tree / rel), "-o", str(obj)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if len(jobs) >= (os.cpu_count() or 1):
            _wait(jobs.pop(0))
    for j in jobs:
        _wait(j)
    so = tree / "libtoyfmt.so"
    subprocess.run([cc, "-shared", "-o", str(so), *objs, "-lm", "-lpthread"], check=True)
    return _bind(ctypes.CDLL(str(so)))


def _wait(p):
    out, _ = p.communicate()
    assert p.returncode == 0, f"{' '.join(p.args)}\n{out}"


def _bind(so):
    P = ctypes.c_void_p
    so.toy_name.restype = ctypes.c_char_p
    so.toy_quantize.argtypes = [ctypes.c_int, P, ctypes.c_int64, ctypes.c_int64, P]
    so.toy_dequantize.argtypes = [ctypes.c_int, P, ctypes.c_int64, ctypes.c_int64, P]
    so.toy_matmul.argtypes = [ctypes.c_int, ctypes.c_int, P, ctypes.c_int, ctypes.c_int, P, ctypes.c_int, P, P, P, P]
    return so


def _specs(so) -> list[dict]:
    """The library's MQ_FORMATS as _format.format_specs() gives the real one."""
    levels = {0: "codes", 1: "signed", 2: "table", 3: "block_lut"}
    out = []
    for i in range(so.toy_nfmt()):
        v = (ctypes.c_int * 9)()
        so.toy_spec(i, v)
        out.append(dict(id=i, name=so.toy_name(i).decode(), bits=v[0], group=v[1], header=v[2],
                        block_bytes=v[3], trailer=v[4], pack=v[6], off=v[5], levels=levels[v[7]], base=v[8]))
    return out


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.fixture
def toy(lib, monkeypatch):
    """The Python side with the toy's rows: its traits row joined with the library's C row, and its
    reference quantizer (a uniform format: the one q4 and q3u use)."""
    traits = layout.build_traits(_specs(lib), layout._ROWS + (TOY_ROW,))
    monkeypatch.setattr(layout, "TRAITS", traits)
    monkeypatch.setattr(layout, "PACKED", layout.packed_layouts(traits))
    monkeypatch.setitem(codec.REFERENCE, TOY, codec.ref_uniform)
    return traits[TOY]


def _weights(n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 0.5, (n, 1)).astype(np.float32)
    w[0, :7] = 0.0          # a flat run, and one all-constant row: d = 0
    w[1] = 0.25
    return w


def test_the_toy_is_in_every_table(lib, toy):
    assert toy.id < lib.toy_npacked() and (toy.bits, toy.group, toy.header, toy.block_bytes) == (2, 32, 4, 12)
    assert toy.levels == "codes" and toy.off == 0 and toy.base is None
    assert layout.PACKED[TOY].block_bytes == 12 and set(layout.TRAITS) - {TOY} == set(codec.FORMATS) | set(layout.INTERLEAVED)
    with pytest.raises(ImportError, match="q2u"):   # a C row without its Python row (or the reverse) fails
        layout.build_traits(_specs(lib), layout._ROWS)


@pytest.mark.parametrize("k", [96, 100])
def test_codec_c_quantizer_and_dequantizer_match_the_reference(lib, toy, k):
    w = _weights(24, k)
    ref = np.frombuffer(codec._ref_pack(w, TOY, None, None), dtype=np.uint8)
    out = np.zeros(layout.PACKED[TOY].nbytes(w.shape), dtype=np.uint8)
    assert ref.size == out.size
    assert lib.toy_quantize(toy.id, _ptr(w), w.shape[0], k, _ptr(out)) == 0
    np.testing.assert_array_equal(out, ref)
    want = layout.dequantize_bytes(TOY, w.shape, out.tobytes())
    got = np.zeros_like(w)
    assert lib.toy_dequantize(toy.id, _ptr(out), w.shape[0], k, _ptr(got)) == 0
    np.testing.assert_array_equal(got, want)
    p = layout.disassemble(TOY, w.shape, out.tobytes())
    assert p.codes.max() <= 3 and layout.assemble(TOY, w.shape, p) == out.tobytes()
    half_step = (w.max(axis=1) - w.min(axis=1)) / 3 * 0.5            # a block's range is within its row's
    assert (np.abs(want - w).max(axis=1) <= half_step * 1.01 + 1e-3).all()


def _emulate(p, q, xd, xs, T, nc):
    """The integer product every tier computes: per chunk the exact integer sum of U * q, then
    y += (d * xd) * isum + m * xs in float32, chunk after chunk (the portable tier's order)."""
    n = p.codes.shape[0]
    U = p.codes.reshape(n, -1)[:, : nc * 32].astype(np.int64).reshape(n, nc, 32)
    d = p.d.astype(np.float32).reshape(n, nc)
    m = p.m.astype(np.float32).reshape(n, nc)
    y = np.zeros((T, n), dtype=np.float32)
    for c in range(nc):
        isum = np.einsum("ni,ti->tn", U[:, c], q[:, c * 32:(c + 1) * 32].astype(np.int64)).astype(np.float32)
        y = y + (d[None, :, c] * xd[:, c, None]) * isum
        y = y + m[None, :, c] * xs[:, c, None]
    return y


def test_every_tier_multiplies_the_toy_as_the_reference(lib, toy):
    N, K = 48, 288                       # 9 chunks: an odd count (the AVX-512 pair's lone last chunk)
    w = _weights(N, K, seed=1)
    raw = np.zeros(layout.PACKED[TOY].nbytes(w.shape), dtype=np.uint8)
    lib.toy_quantize(toy.id, _ptr(w), N, K, _ptr(raw))
    p = layout.disassemble(TOY, w.shape, raw.tobytes())
    kp, nc = 384, 9
    tiers = [t for t in (0, 1, 2) if t <= lib.toy_best_isa()]
    assert tiers[0] == 0 and (not X86 or lib.toy_best_isa() >= 1)
    rng = np.random.default_rng(2)
    for T in (1, 3, 20):                 # decode; the exact few rows; the AVX-512 GEMM (T >= 18)
        x = rng.standard_normal((T, K)).astype(np.float32)
        ys = {}
        for isa in tiers:
            y = np.full((T, N), np.nan, dtype=np.float32)
            q = np.zeros((T, kp), np.int8)
            xd, xs = np.zeros((T, kp // 32), np.float32), np.zeros((T, kp // 32), np.float32)
            assert lib.toy_matmul(isa, toy.id, _ptr(raw), N, K, _ptr(x), T, _ptr(y), _ptr(q), _ptr(xd), _ptr(xs)) == 0
            ref = _emulate(p, q, xd, xs, T, nc)
            if isa == 0:                 # the portable tier: the emulation's order, bit for bit
                np.testing.assert_array_equal(y, ref)
            else:                        # the SIMD tiers: exact integer sums, their own float order
                np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5 * float(np.abs(ref).max()))
            ys[isa] = y
        if 2 in ys and T == 3:           # AVX-512, 2 <= T <= 17: every row bit for bit the T = 1 row
            for t in range(T):
                y1 = np.zeros((1, N), np.float32)
                q, xd, xs = np.zeros((1, kp), np.int8), np.zeros((1, 12), np.float32), np.zeros((1, 12), np.float32)
                lib.toy_matmul(2, toy.id, _ptr(raw), N, K, _ptr(np.ascontiguousarray(x[t:t + 1])), 1, _ptr(y1),
                               _ptr(q), _ptr(xd), _ptr(xs))
                np.testing.assert_array_equal(ys[2][t], y1[0])
