"""Quantization formats: a traits table, the numpy reference quantizers (the spec) and the fast path.

``quantize(w, fmt)`` validates ``w``, then runs the compiled quantizer (mixqrt._kernels._quant) or,
with ``impl="ref"``, the numpy reference below; the two are bit-exact (tests/test_quant*.py). The
reference produces layout.Parts and layout.assemble packs them, so the byte layout has one owner.

Rounding rules shared by both paths (why: re-quantizing a dequantized tensor must give it back):
- m (the offset) is the block minimum rounded to nearest-even fp16.
- d (the scale) is rounded toward zero to fp16, so the extreme element always lands on the top
  code; if fl(d * top + m) misses the block maximum but the next fp16 scale hits it exactly, the
  next one is kept. A dequantized block then re-quantizes to the same d and m.
- q6 is symmetric with the sign trick: d = x_ext / -32 where x_ext is the element of largest
  magnitude, so x_ext takes code 0 (level -32) and all 64 codes are usable.

``search=True`` (q6, q4, q3u, q3p; the other formats ignore it) keeps the same byte layout but picks
each block's header by minimising the (optionally importance-weighted) squared error, like
llama.cpp's make_qkx2_quants: candidate scales around the min/max one, a least-squares refit of d
and m for each candidate's codes, fp16 rounding, re-assignment, refinement, then a de-shrink of the
chosen header (d, m stretched by 1/beta about the block mean: an LS fit shrinks weights by ~3 % at
3 bits, which cost perplexity; docs/quality.md). _search_parts is the spec of src/quant/search.c.
The min/max header is candidate 0 and a block it reproduces exactly is left exactly as is;
``importance`` ([K] per-column weights, e.g. an imatrix's mean squared activations) implies search.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mixqrt.errors import QuantError
from mixqrt.formats import kmeans, layout
from mixqrt.formats.kmeans import F32, h_rne, h_rtz, snap
from mixqrt.formats.qtensor import QTensor, register_dequantizer

FP16_MAX = 65504.0
_BF16_INF_FROM = np.array([0x7F7F8000], dtype=np.uint32).view(np.float32)[0]  # rounds up to bf16 Inf
_FAST_IDS = layout.FMT_ID

try:  # the compiled fast path; the package still works (slowly) without a build
    from mixqrt._kernels import _quant as _fast
except ImportError:  # pragma: no cover - exercised only on a source tree that was never built
    _fast = None


@dataclass(frozen=True)
class Format:
    """Traits of one format. block_bytes/group_size are 0 for the plain (unblocked) formats."""
    name: str
    bits: int
    group_size: int
    block_bytes: int
    kind: str                          # "uniform" | "symmetric" | "piecewise" | "codebook" | "global" | "plain"
    quantize: Callable[..., QTensor]
    dequantize: Callable[[QTensor], np.ndarray]
    layout: layout.Layout | None

    def nbytes(self, shape) -> int:
        return layout.expected_nbytes(self.name, shape)


# ----------------------------------------------------------------------------- validation
def _as_f32(w, fmt: str) -> np.ndarray:
    if fmt not in _FAST_IDS:
        raise QuantError(f"unknown format {fmt!r}; known: {', '.join(sorted(_FAST_IDS))}")
    a = np.asarray(w)
    if a.dtype == object or a.dtype.kind not in "f":
        raise QuantError(f"cannot quantize dtype {a.dtype} to {fmt}; expected float16, float32 or float64")
    if a.dtype not in (np.float16, np.float32, np.float64):
        raise QuantError(f"cannot quantize dtype {a.dtype} to {fmt}; expected float16, float32 or float64")
    if a.ndim == 0:
        raise QuantError(f"cannot quantize a 0-d tensor to {fmt}; expected at least 1 dimension")
    if a.size == 0:
        raise QuantError(f"cannot quantize an empty tensor (shape {a.shape}) to {fmt}")
    x = np.ascontiguousarray(a, dtype=F32)
    # max and min propagate NaN and reach +-Inf, so they check finiteness without the tensor-sized
    # temporaries of isfinite(x) and abs(x) (2.2 GB for a 7B vocabulary-sized matrix)
    hi, lo = float(x.max()), float(x.min())
    if not (np.isfinite(hi) and np.isfinite(lo)):
        bad = "NaN" if np.isnan(x).any() else "Inf (or a float64 beyond float32 range)"
        raise QuantError(f"cannot quantize to {fmt}: the tensor contains {bad}")
    if layout.TRAITS[fmt].fp16_range:
        amax = max(hi, -lo)
        if amax > FP16_MAX:
            raise QuantError(f"cannot quantize to {fmt}: |w| reaches {amax:g}, beyond the fp16 range "
                             f"({FP16_MAX:g}) of its scales; use q5g, bf16 or f32")
    return x


def _blocks(x: np.ndarray, group: int):
    """[n, k] -> padded [n, nb, G] and the valid count per block [nb]."""
    n, k = x.shape
    nb = -(-k // group)
    X = np.zeros((n, nb * group), dtype=F32)
    X[:, :k] = x
    nv = np.minimum(group, k - np.arange(nb) * group)
    return X.reshape(n, nb, group), nv


# ----------------------------------------------------------------------------- reference quantizers
def _ref_minmax(X: np.ndarray, nv: np.ndarray, top: float):
    """Asymmetric min/max: returns (d16, m16, t = (x - m) / d with 0 where d == 0)."""
    valid = np.arange(X.shape[-1])[None, :] < nv[:, None]
    mn = np.where(valid, X, np.inf).min(axis=-1) + F32(0)          # -0.0 -> +0.0 (C does the same)
    mx = np.where(valid, X, -np.inf).max(axis=-1)
    m16 = h_rne(mn)
    m = m16.astype(F32)
    raw = (mx - m) / F32(top)
    d16 = snap(h_rtz(np.where(raw > 0, raw, F32(0))), m, top, mx)
    d = d16.astype(F32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d > 0, (X - m[..., None]) / np.where(d > 0, d, F32(1)), F32(0))
    return d16, m16, t, valid


@dataclass(frozen=True)
class Blocks:
    """A tensor cut into its format's blocks, what a reference quantizer reads: x [n, k] as given, X
    [n, nb, G] zero padded, nv [nb] valid weights per block, valid [n, nb, G], lay the layout."""
    x: np.ndarray
    X: np.ndarray
    nv: np.ndarray
    valid: np.ndarray
    lay: layout.Layout


def _ref_q8(b: Blocks, lo, hi) -> layout.Parts:
    amax = np.where(b.valid, np.abs(b.X), 0).max(axis=-1)
    d16 = snap(h_rtz(amax / F32(127)), F32(0), 127.0, amax)
    d = d16.astype(F32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.clip(np.rint(b.X / np.where(d > 0, d, F32(1))), -127, 127), 0)
    return layout.Parts(codes=np.where(b.valid, q, 0).astype(np.int8), d=d16)


def _ref_q6(b: Blocks, lo, hi) -> layout.Parts:
    ax = np.where(b.valid, np.abs(b.X), -1)
    ext = np.take_along_axis(b.X, np.argmax(ax, axis=-1)[..., None], -1)[..., 0]
    d16 = h_rtz(ext / F32(-32))
    d = d16.astype(F32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d != 0, np.clip(np.rint(b.X / np.where(d != 0, d, F32(1))), -32, 31), 0) + 32
    return layout.Parts(codes=np.where(b.valid, q, 0).astype(np.uint8), d=d16)


def ref_uniform(b: Blocks, lo, hi) -> layout.Parts:
    """Asymmetric min/max codes 0 .. 2^bits - 1 with a (d, m) header: q4, q3u (any bit count)."""
    top = float(2 ** b.lay.bits - 1)
    d16, m16, t, valid = _ref_minmax(b.X, b.nv, top)
    q = np.clip(np.rint(t), 0, top)
    return layout.Parts(codes=np.where(valid, q, 0).astype(np.uint8), d=d16, m=m16)


def _ref_q3p(b: Blocks, lo, hi) -> layout.Parts:
    L = layout.Q3P_LEVELS.astype(F32)
    d16, m16, t, valid = _ref_minmax(b.X, b.nv, float(L[-1]))
    mids = (L[:-1] + L[1:]) * F32(0.5)
    q = (t[..., None] > mids).sum(axis=-1)
    return layout.Parts(codes=np.where(valid, q, 0).astype(np.uint8), d=d16, m=m16)


def _ref_q2c(b: Blocks, lo, hi) -> layout.Parts:
    n, nb, G = b.X.shape
    flat_nv = np.broadcast_to(b.nv, (n, nb)).reshape(-1)
    codes, d16, m16, lut, _, _ = kmeans.quantize_blocks(b.X.reshape(-1, G), flat_nv)
    return layout.Parts(codes=codes.reshape(n, nb, G), d=d16.reshape(n, nb), m=m16.reshape(n, nb),
                        lut=lut.reshape(n, nb, 4))


def _ref_q5g(b: Blocks, lo, hi) -> layout.Parts:
    lo, hi = _q5g_range(b.x, lo, hi)
    step = (hi - lo) / F32(31)
    t = (b.X - lo) / step if step > 0 else np.zeros_like(b.X)
    q = np.clip(np.rint(t), 0, 31)
    return layout.Parts(codes=np.where(b.valid, q, 0).astype(np.uint8), lo_hi=(float(lo), float(hi)))


# The reference quantizer (the spec the C quantizer of src/quant/quant.c is tested against) of every
# row format: (blocks, lo, hi) -> layout.Parts. Adding a format: docs/architecture.md, "Adding a format".
REFERENCE = {"q8": _ref_q8, "q6": _ref_q6, "q4": ref_uniform, "q3u": ref_uniform, "q3p": _ref_q3p,
             "q2c": _ref_q2c, "q5g": _ref_q5g}


def _ref_parts(x: np.ndarray, fmt: str, lo=None, hi=None) -> layout.Parts:
    lay = layout.PACKED[fmt]
    X, nv = _blocks(x, lay.group)
    valid = np.broadcast_to(np.arange(lay.group)[None, :] < nv[:, None], X.shape)
    if fmt not in REFERENCE:
        raise QuantError(f"no reference quantizer for {fmt!r}")
    return REFERENCE[fmt](Blocks(x, X, nv, valid, lay), lo, hi)


def _ref_pack(x2: np.ndarray, fmt: str, lo, hi) -> bytes:
    """Reference quantize + assemble, a slab of rows at a time: the q2c reference holds several float64
    copies of its input, which for a whole embedding table would be gigabytes."""
    n, k = x2.shape
    step = max(1, (1 << 18) // k)
    out = []
    for r0 in range(0, n, step):
        xs = x2[r0:r0 + step]
        b = layout.assemble(fmt, xs.shape, _ref_parts(xs, fmt, lo, hi))
        out.append(b[:-8] if fmt == "q5g" else b)
    if fmt == "q5g":
        out.append(np.array([lo, hi], dtype="<f4").tobytes())
    return b"".join(out)


def _q5g_range(x: np.ndarray, lo, hi):
    if (lo is None) != (hi is None):
        raise QuantError("q5g needs both lo and hi (or neither, to use the tensor's own range)")
    if lo is None:
        return F32(x.min()), F32(x.max())
    lo, hi = F32(lo), F32(hi)
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo > hi:
        raise QuantError(f"q5g range lo={lo!r}, hi={hi!r} must be finite with lo <= hi")
    # half a step of slack: a dequantized q5g tensor (lo + 31 * step can round past hi) must re-quantize
    slack = float((hi - lo) / F32(31)) * 0.5
    if x.min() < lo - slack or x.max() > hi + slack:
        raise QuantError(f"q5g: values span [{x.min():g}, {x.max():g}], outside the bound range "
                         f"[{lo:g}, {hi:g}]; pass the range from bind_range over every tensor it covers")
    return lo, hi


def bind_range(arrays) -> tuple[float, float]:
    """"Dynamic range binding": one (lo, hi) over every array (e.g. all RMSNorm weights), as float32."""
    arrays = list(arrays)
    if not arrays:
        raise QuantError("bind_range needs at least one array")
    lo, hi = np.inf, -np.inf
    for i, a in enumerate(arrays):
        x = _as_f32(a, "q5g")
        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
    return float(F32(lo)), float(F32(hi))


# ----------------------------------------------------------------------------- search (spec of search.c)
SEARCH_FORMATS = tuple(n for n, t in layout.TRAITS.items() if t.searchable)   # q3p, q3u, q4, q6
_NCAND, _NNEG, _FSTEP, _REFINE = 11, 5, F32(0.04), 2
F64 = np.float64


def _cs(a):
    """Sum over the last axis, left to right in float64 (np.cumsum is sequential, like the C loop)."""
    return np.cumsum(a, axis=-1)[..., -1]


def _is_bad16(h):
    return (h.view(np.uint16) & np.uint16(0x7C00)) == np.uint16(0x7C00)


def _search_parts(x: np.ndarray, fmt: str, imp) -> layout.Parts:
    lay = layout.PACKED[fmt]
    X3, nv = _blocks(x, lay.group)
    n, nb, G = X3.shape
    valid3 = np.broadcast_to(np.arange(G)[None, :] < nv[:, None], X3.shape)
    colw = np.zeros(nb * G, dtype=F32)
    colw[: x.shape[1]] = 1.0 if imp is None else imp
    W3 = np.where(valid3, np.broadcast_to(colw.reshape(nb, G), X3.shape), F32(0))
    X, W, valid = X3.reshape(-1, G), W3.reshape(-1, G).astype(F64), valid3.reshape(-1, G)
    B = X.shape[0]
    sym = fmt == "q6"
    if sym:
        Lf = None
        T = F32(32)
    else:
        Lf = (layout.Q3P_LEVELS.astype(F32) if fmt == "q3p" else np.arange(2 ** lay.bits, dtype=F32))
        T = Lf[-1]
        mids = (Lf[:-1] + Lf[1:]) * F32(0.5)

    def near(t):
        if fmt == "q3p":
            return (t[..., None] > mids).sum(axis=-1)
        return np.rint(np.clip(t, F32(0), T)).astype(np.int64)

    def sse(d, m):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if sym:
                t = X / np.where(d != 0, d, F32(1))[:, None]
                q = np.where(d[:, None] != 0, np.rint(np.clip(t, F32(-32), F32(31))), F32(0)).astype(np.int64) + 32
                r = d[:, None] * (q - 32).astype(F32)
            else:
                t = (X - m[:, None]) / np.where(d > 0, d, F32(1))[:, None]
                q = np.where(d[:, None] > 0, near(t), 0)
                r = d[:, None] * Lf[q] + m[:, None]
        e = X.astype(F64) - r.astype(F64)
        return q, _cs(W * e * e)

    sxx = _cs(W * X.astype(F64) * X.astype(F64))

    def ls(q):
        l = (q - 32 if sym else Lf[q]).astype(F64)
        x64 = X.astype(F64)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            sll, slx = _cs((W * l) * l), _cs((W * l) * x64)
            if sym:
                ok = sll > 0
                d = slx / sll
                return ok, d, np.zeros_like(d), d * d * sll - 2.0 * d * slx + sxx
            sw, sl, sx = _cs(W), _cs(W * l), _cs(W * x64)
            D = sw * sll - sl * sl
            ok = D > 0
            d = (sw * slx - sl * sx) / D
            m = (sll * sx - sl * slx) / D
            return ok, d, m, d * d * sll + 2.0 * d * m * sl + m * m * sw - 2.0 * d * slx - 2.0 * m * sx + sxx

    # candidate 0: the plain header
    if sym:
        ax = np.where(valid, np.abs(X), -1)
        ext = np.take_along_axis(X, np.argmax(ax, axis=-1)[:, None], -1)[:, 0]
        dh = h_rtz(ext / F32(-32))
        mh = np.zeros(B, dtype=np.float16)
        searchable0 = dh.astype(F32) != 0
    else:
        mn = np.where(valid, X, np.inf).min(axis=-1) + F32(0)          # as _ref_minmax
        mx = np.where(valid, X, -np.inf).max(axis=-1)
        mh = h_rne(mn)
        raw = (mx - mh.astype(F32)) / T
        dh = snap(h_rtz(np.where(raw > 0, raw, F32(0))), mh.astype(F32), float(T), mx)
        searchable0 = (dh.astype(F32) > 0) & (mx > mn)
    bd, bm = dh.astype(F32), mh.astype(F32)
    _, best = sse(bd, bm)
    active = searchable0 & (best > 0)
    have = np.zeros(B, dtype=bool)
    cbest, cd, cm = np.zeros(B), np.zeros(B), np.zeros(B)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for a in ((0,) if sym else (0, 1)):
            for j in range(_NCAND):
                f = F32(1) + F32(j - _NNEG) * _FSTEP
                if sym:
                    isc = np.where(active, (F32(-32) * f) / ext, F32(0))
                    q = np.rint(np.clip(X * isc[:, None], F32(-32), F32(31))).astype(np.int64) + 32
                else:
                    isc = (T * f) / (mx - mn)
                    t = (X - mn[:, None]) * isc[:, None] if a == 0 else T - (mx[:, None] - X) * isc[:, None]
                    t = np.where(active[:, None], t, F32(0))        # blocks C never searches
                    q = near(t)
                ok, d, m, e = ls(q)
                if not sym:
                    ok = ok & (d > 0)
                upd = active & ok & (~have | (e < cbest))
                have |= upd
                cbest, cd, cm = np.where(upd, e, cbest), np.where(upd, d, cd), np.where(upd, m, cm)
        run = active & have
        for _ in range(_REFINE + 1):
            dh1 = cd.astype(F32).astype(np.float16)
            mh1 = cm.astype(F32).astype(np.float16)
            d1, m1 = dh1.astype(F32), mh1.astype(F32)
            ok = run & ~_is_bad16(dh1) & (d1 != 0 if sym else (~_is_bad16(mh1) & (d1 > 0)))
            q, e1 = sse(np.where(ok, d1, bd), np.where(ok, m1, bm))
            better = ok & (e1 < best)
            best = np.where(better, e1, best)
            bd, bm = np.where(better, d1, bd), np.where(better, m1, bm)
            dh, mh = np.where(better, dh1, dh), np.where(better, mh1, mh)
            lok, d, m, _ = ls(q)
            lok = lok & (True if sym else d > 0)
            cd, cm = np.where(better, d, cd), np.where(better, m, cm)
            run = better & lok
    q, final = sse(bd, bm)
    # step 4, de-shrink: stretch d (and m about mean(y)) by 1/beta with the codes kept
    nvf = valid.sum(axis=1).astype(F64)
    Lc = (q - 32).astype(F32) if sym else Lf[q]
    mcur = np.zeros(B, F32) if sym else bm
    Y = (bd[:, None] * Lc + mcur[:, None]).astype(F64)
    x64 = X.astype(F64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        my = _cs(np.where(valid, Y, 0.0)) / nvf
        mxx = _cs(np.where(valid, x64, 0.0)) / nvf
        if sym:                                   # q6 has no offset: it can only scale about 0
            my, mxx = np.zeros_like(my), np.zeros_like(mxx)
        yc, xc = Y - my[:, None], x64 - mxx[:, None]
        syx, sxx2 = _cs(np.where(valid, yc * xc, 0.0)), _cs(np.where(valid, xc * xc, 0.0))
        beta = syx / sxx2
        go = (final > 0) & ((bd != 0) if sym else (bd > 0)) & (sxx2 > 0) & (beta > 0.5) & (beta < 1.5)
        dh2 = (bd.astype(F64) / beta).astype(F32).astype(np.float16)
        ok2 = go & ~_is_bad16(dh2) & (dh2.astype(F32) != 0 if sym else dh2.astype(F32) > 0)
        if not sym:
            mh2 = (my + (bm.astype(F64) - my) / beta).astype(F32).astype(np.float16)
            ok2 &= ~_is_bad16(mh2)
            mh = np.where(ok2, mh2, mh)
        dh = np.where(ok2, dh2, dh)
    codes = np.where(valid, q, 0).astype(np.uint8).reshape(n, nb, G)
    return layout.Parts(codes=codes, d=dh.reshape(n, nb), m=None if sym else mh.reshape(n, nb))


def _search_pack(x2: np.ndarray, fmt: str, imp) -> bytes:
    n, k = x2.shape
    step = max(1, (1 << 16) // k)
    return b"".join(layout.assemble(fmt, x2[r:r + step].shape, _search_parts(x2[r:r + step], fmt, imp))
                    for r in range(0, n, step))


def _check_importance(imp, k: int, fmt: str):
    if imp is None:
        return None
    a = np.asarray(imp)
    if a.dtype.kind not in "fiu":
        raise QuantError(f"importance for {fmt} must be numeric, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=F32).reshape(-1)
    if a.size != k:
        raise QuantError(f"importance has {a.size} entries but the rows have {k} columns")
    if not np.isfinite(a).all() or (a < 0).any():
        raise QuantError("importance weights must be finite and >= 0")
    return a


# ----------------------------------------------------------------------------- plain formats
def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; no ml_dtypes needed."""
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    if ((r & 0x7F80) == 0x7F80).any():
        raise QuantError("cannot store as bf16: a value rounds to Inf (|w| near the float32 maximum)")
    return r


def _plain_raw(x: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "f32":
        return x.astype("<f4").reshape(-1).view(np.uint8)
    if fmt == "f16":
        return x.astype("<f2").reshape(-1).view(np.uint8)
    return _to_bf16(x).astype("<u2").reshape(-1).view(np.uint8)


# ----------------------------------------------------------------------------- public API
def quantize(w, fmt: str, *, impl: str = "fast", lo=None, hi=None, search: bool = False,
             importance=None, rot=None) -> QTensor:
    """Quantize a float array to `fmt`; impl="ref" runs the numpy reference (the spec).

    q5g: lo/hi give the bound range (see bind_range); without them the tensor's own min/max is used.
    search / importance: error-minimising headers for q6/q4/q3u/q3p (module docstring); importance is
    [K] per-column weights (an imatrix row) and implies search. Ignored by the other formats.
    rot: {"block": b, "seed": s} stores the rows rotated (mixqrt.formats.rotation; 2-D packed formats
    only, not with importance); dequantize undoes it and ops.matmul rotates the input to match.
    """
    if fmt in layout.INTERLEAVED:   # q4x / q3x: quantized as q4 / q3p, stored row-interleaved
        base = layout.INTERLEAVED[fmt][0]
        shape = np.shape(w)
        if layout.storage_format(base, shape) != fmt:
            raise QuantError(f"{fmt} stores [N, K] tensors with N a multiple of {layout.XROWS}, not shape {shape}")
        return to_storage(quantize(w, base, impl=impl, lo=lo, hi=hi, search=search, importance=importance, rot=rot))
    if rot is not None:
        return _quantize_rotated(w, fmt, rot, impl=impl, search=search, importance=importance)
    x = _as_f32(w, fmt)
    shape = x.shape
    if fmt != "q5g" and (lo is not None or hi is not None):
        raise QuantError(f"lo/hi are only meaningful for q5g, not {fmt}")
    if impl not in ("fast", "ref"):
        raise QuantError(f"impl must be 'fast' or 'ref', got {impl!r}")
    n, k = layout.rows_cols(shape)
    x2 = x.reshape(n, k)
    meta = {}
    if fmt == "q5g":
        lo, hi = _q5g_range(x2, lo, hi)
        meta["lo_hi"] = (float(lo), float(hi))
    imp = _check_importance(importance, k, fmt)
    if (search or imp is not None) and fmt in SEARCH_FORMATS:
        if impl == "ref" or _fast is None:
            raw = np.frombuffer(_search_pack(x2, fmt, imp), dtype=np.uint8)
        else:
            raw = np.empty(layout.expected_nbytes(fmt, shape), dtype=np.uint8)
            _fast.quantize_search(_FAST_IDS[fmt], x2, raw, layout.Q3P_LEVELS, imp)
        return QTensor(fmt, shape, raw, meta)
    if impl == "ref" or _fast is None:
        if fmt in layout.PLAIN:
            raw = _plain_raw(x2, fmt)
        else:
            raw = np.frombuffer(_ref_pack(x2, fmt, lo, hi), dtype=np.uint8)
    else:
        if fmt == "bf16" and np.abs(x2).max() >= _BF16_INF_FROM:
            raise QuantError("cannot store as bf16: a value rounds to Inf (|w| near the float32 maximum)")
        raw = np.empty(layout.expected_nbytes(fmt, shape), dtype=np.uint8)
        _fast.quantize(_FAST_IDS[fmt], x2, raw, layout.Q3P_LEVELS,
                       float(lo) if lo is not None else 0.0, float(hi) if hi is not None else 0.0)
    return QTensor(fmt, shape, raw, meta)


def to_storage(qt: QTensor) -> QTensor:
    """qt in the form it is stored and run in (layout.storage_format): a q4 / q3p matrix with a
    multiple of 16 rows becomes q4x / q3x (same values, rows interleaved for the decode kernels);
    else qt itself."""
    fmt = layout.storage_format(qt.fmt, qt.shape)
    if fmt == qt.fmt:
        return qt
    return QTensor(fmt, qt.shape, layout.to_interleaved(fmt, qt.raw, qt.shape), dict(qt.meta or {}))


def _quantize_rotated(w, fmt: str, rot, **kw) -> QTensor:
    from mixqrt.formats import rotation
    if kw.get("importance") is not None:
        raise QuantError("rotation and importance (imatrix) cannot be combined: the importance is per "
                         "input column, which the rotation mixes")
    x = _as_f32(w, fmt)
    rec = rotation.record(rot, fmt, x.shape, "rot")
    # rows are independent in every packed format: rotate and quantize in slabs of rows, so a
    # vocabulary-sized table (2.2 GB float32 for a 7B embedding) never has a whole rotated copy
    parts = [quantize(rotation.rotate(x[r:r + _ROT_ROWS], rot), fmt, **kw)
             for r in range(0, x.shape[0], _ROT_ROWS)]
    raw = parts[0].raw if len(parts) == 1 else np.concatenate([p.raw for p in parts])
    return QTensor(fmt, x.shape, raw, {**parts[0].meta, "rot": rec})


_ROT_ROWS = 16384


def _unrotated(qt: QTensor, w: np.ndarray) -> np.ndarray:
    rot = qt.meta.get("rot") if qt.meta else None
    if rot is None:
        return w
    from mixqrt.formats import rotation
    return rotation.unrotate(w.reshape(-1, w.shape[-1]), rot).reshape(w.shape)


def _lo_hi(qt: QTensor) -> tuple[float, float]:
    if qt.fmt != "q5g":
        return 0.0, 0.0
    lo, hi = np.frombuffer(qt.raw[-8:].tobytes(), dtype="<f4")
    return float(lo), float(hi)


def _levels(qt: QTensor) -> np.ndarray:
    """The q3p table a tensor was quantized with (its meta), else the current Q3P_LEVELS."""
    lv = qt.meta.get("q3p_levels") if qt.meta else None
    return layout.Q3P_LEVELS if lv is None else layout.q3p_table(lv)


def dequantize(qt: QTensor, *, impl: str = "fast") -> np.ndarray:
    """QTensor -> float32 array of qt.shape: the effective weight (a rotated tensor's rows unrotated)."""
    return _unrotated(qt, dequantize_stored(qt, impl=impl))


def dequantize_stored(qt: QTensor, *, impl: str = "fast") -> np.ndarray:
    """The stored values as float32 (a rotated tensor's rows as stored, rotated)."""
    if impl == "ref" or _fast is None:
        if qt.fmt == "f32":
            return qt.raw.view("<f4").astype(np.float32).reshape(qt.shape)
        if qt.fmt == "f16":
            return qt.raw.view("<f2").astype(np.float32).reshape(qt.shape)
        if qt.fmt == "bf16":
            return (qt.raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(qt.shape)
        if qt.fmt in ("q3p", "q3x") and not np.array_equal(_levels(qt), layout.Q3P_LEVELS):
            p = layout.disassemble(qt.fmt, qt.shape, qt.raw)
            w = p.d.astype(F32)[..., None] * _levels(qt)[p.codes].astype(F32) + p.m.astype(F32)[..., None]
            return np.ascontiguousarray(w.reshape(qt.rows, -1)[:, : qt.cols]).reshape(qt.shape)
        return layout.dequantize_bytes(qt.fmt, qt.shape, qt.raw)
    n, k = qt.rows, qt.cols
    out = np.empty((n, k), dtype=np.float32)
    lo, hi = _lo_hi(qt)
    _fast.dequantize_rows(_FAST_IDS[qt.fmt], qt.raw, k, None, out, _levels(qt), lo, hi)
    return out.reshape(qt.shape)


def dequantize_rows(qt: QTensor, row_ids) -> np.ndarray:
    """Rows `row_ids` of a 2-D QTensor as float32 [len(row_ids), K] (embedding lookup): touches only
    those rows' bytes."""
    ids = np.ascontiguousarray(np.asarray(row_ids).reshape(-1))
    if ids.dtype.kind not in "iu":
        raise QuantError(f"row ids must be integers, got dtype {ids.dtype}")
    n, k = qt.rows, qt.cols
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise QuantError(f"row id out of range [0, {n}) for a {qt.fmt} tensor of shape {qt.shape}: "
                         f"got {int(ids.min())}..{int(ids.max())}")
    out = np.empty((ids.size, k), dtype=np.float32)
    if _fast is None:
        return dequantize(qt, impl="ref").reshape(n, k)[ids]
    lo, hi = _lo_hi(qt)
    _fast.dequantize_rows(_FAST_IDS[qt.fmt], qt.raw, k, ids, out, _levels(qt), lo, hi)
    return _unrotated(qt, out)


def _make(name: str, bits: int, kind: str) -> Format:
    lay = layout.PACKED.get(name)
    return Format(name=name, bits=bits, group_size=lay.group if lay else 0,
                  block_bytes=lay.block_bytes if lay else 0, kind=kind,
                  quantize=lambda w, _f=name, **o: quantize(w, _f, **o),
                  dequantize=dequantize, layout=lay)


# the quantization formats (the interleaved storage forms are not: recipes name their base format)
FORMATS: dict[str, Format] = {n: _make(n, t.bits, t.kind) for n, t in layout.TRAITS.items() if t.base is None}
register_dequantizer(dequantize)
