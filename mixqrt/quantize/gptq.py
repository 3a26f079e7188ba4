"""Error-compensating quantization (GPTQ / OBQ) for the group formats q3p, q3u, q4, q6 and q8.

For a linear layer y = W x the calibration loss of a quantized Ŵ is sum over calibration tokens of
||(W - Ŵ) x||² = tr((W - Ŵ) H (W - Ŵ)^T) with H = X^T X (the layer's input Hessian). RTN rounds every
weight on its own; GPTQ (Frantar et al. 2022, after Optimal Brain Quantization) rounds the columns
one by one and moves each rounding error onto the columns not yet rounded, weighted by the inverse
Hessian, so correlated inputs absorb each other's errors. Rows are independent in this loss.

Fit to the byte layouts (layout.py): a block of G consecutive columns of a row shares one header
(d, m). When the column sweep reaches a block, the header of every row is chosen from the
*error-updated* weights of those G columns with the same search quantizer RTN uses
(formats.quantize(search=True)), then each column is rounded to the nearest level of that header and
its error propagated through the upper Cholesky factor of H^-1 (dampened by `damp` x mean diag(H)).
The update is lazy per block (one BLAS product per block for the columns to the right).

Guarantee used by the tests: with ``fallback=True`` (default) every row keeps whichever of GPTQ and
RTN has the lower calibration loss on H, so the result never has a higher loss than RTN's. The
packed bytes are the ordinary format: kernels, files and loaders do not change.

numpy only: H^-1's upper Cholesky factor is inv(R) where H = R R^T with R upper triangular, which is
the lower Cholesky factor of H with rows and columns reversed (no scipy needed).
"""
from __future__ import annotations

import numpy as np

from mixqrt.errors import QuantError
from mixqrt.formats import layout
from mixqrt.formats.codec import dequantize, quantize
from mixqrt.formats.qtensor import QTensor

GPTQ_FORMATS = tuple(n for n, t in layout.TRAITS.items() if t.gptq)   # q3p, q3u, q4, q6, q8
F32 = np.float32


def spans(k: int, group: int, hblock: int = 1024) -> list[tuple[int, int]]:
    """Column spans of the block-diagonal Hessian: equal widths <= hblock, multiples of `group`."""
    n = max(1, -(-k // max(hblock, group)))
    step = -(-(-(-k // n)) // group) * group
    return [(c, min(k, c + step)) for c in range(0, k, step)]


class Hessian:
    """Running X^T X of a layer's inputs, kept as diagonal blocks over `spans` (why: the full K x K
    product for K = 4864 costs T*K^2 flops per layer and its factorisation K^3, too slow on 2 shared
    cores; GPTQ then compensates errors within each span). One span when K <= hblock: exact."""

    def __init__(self, k: int, group: int = 64, hblock: int = 1024):
        self.k = int(k)
        self.spans = spans(self.k, group, hblock)
        self.blocks = [np.zeros((c1 - c0, c1 - c0), dtype=np.float64) for c0, c1 in self.spans]
        self.tokens = 0

    def add(self, x) -> None:
        x2 = np.asarray(x, dtype=np.float32).reshape(-1, self.k)
        for (c0, c1), b in zip(self.spans, self.blocks):
            xs = np.ascontiguousarray(x2[:, c0:c1])
            b += xs.T @ xs
        self.tokens += x2.shape[0]

    @classmethod
    def full(cls, h) -> "Hessian":
        """A dense [K, K] matrix as one span (tests, small layers)."""
        h = np.asarray(h, dtype=np.float64)
        out = cls(h.shape[0], 1, max(1, h.shape[0]))
        out.blocks = [h]
        return out

    def rotated(self, rot) -> "Hessian":
        """The Hessian of the inputs rotated by rot (mixqrt.formats.rotation): R^T H R per span, exact
        because a rotation block never straddles a span (spans are whole 64-column groups)."""
        from mixqrt.formats import rotation
        b, seed = rotation.check(rot, self.k, "Hessian rotation")
        out = Hessian.__new__(Hessian)
        out.k, out.spans, out.tokens = self.k, list(self.spans), self.tokens
        out.blocks = []
        for (c0, c1), blk in zip(self.spans, self.blocks):
            if c0 % b or (c1 - c0) % b:
                raise QuantError(f"Hessian span {c0}:{c1} splits {b}-column rotation blocks")
            out.blocks.append(rotation.rotate_hessian(blk, rot, rotation.signs(seed, self.k)[c0:c1]))
        return out

    def regroup(self, group: int) -> "Hessian":
        """The same blocks, checked to be whole groups of `group` columns (a span may not split a block)."""
        for c0, c1 in self.spans:
            if c0 % group or (c1 % group and c1 != self.k):
                raise QuantError(f"Hessian span {c0}:{c1} splits {group}-column blocks")
        return self


_BLK = 128
# Rows per slab of the column sweep and the RTN fallback (rows are independent in the loss). Why:
# whole-matrix working copies of a vocabulary-sized lm_head (152,064 x 3,584 for Qwen2-7B: 2.2 GB per
# float32 copy; the sweep's copy, RTN's and two dequantized ones) set the 7B run's peak RSS
# (docs/quality.md §0.1). A multiple of row_losses' step, so its sums are the same per row; every
# matrix of a decoder layer (N <= 32768) is one slab.
ROWS = 32768


def _one_thread():
    """LAPACK on 128 x 128 blocks with OpenBLAS threads measured ~50x slower on loaded shared cores
    (threads spin waiting for each other) than on one thread."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(1)


def _chol_lower(a: np.ndarray) -> np.ndarray:
    """Blocked right-looking Cholesky (in place on a copy): the BLAS-3 updates run at matmul speed,
    unlike np.linalg.cholesky on large matrices on this class of machine (measured 10-30x slower)."""
    a = np.array(a, copy=True)
    k = a.shape[0]
    for b0 in range(0, k, _BLK):
        b1 = min(k, b0 + _BLK)
        with _one_thread():
            l11 = np.linalg.cholesky(a[b0:b1, b0:b1])
            inv = np.linalg.inv(l11)
        a[b0:b1, b0:b1] = l11
        a[b0:b1, b1:] = 0
        if b1 < k:
            l21 = a[b1:, b0:b1] @ inv.T
            a[b1:, b0:b1] = l21
            a[b1:, b1:] -= l21 @ l21.T
    return a


def _tri_inv_lower(lo: np.ndarray) -> np.ndarray:
    """Inverse of a lower triangular matrix, by row blocks: X[i, :i] = -L_ii^-1 (L[i, :i] X[:i, :i])."""
    k = lo.shape[0]
    x = np.zeros_like(lo)
    for b0 in range(0, k, _BLK):
        b1 = min(k, b0 + _BLK)
        with _one_thread():
            inv = np.linalg.inv(lo[b0:b1, b0:b1])
        x[b0:b1, b0:b1] = np.tril(inv)
        if b0:
            x[b0:b1, :b0] = -inv @ (lo[b0:b1, :b0] @ x[:b0, :b0])
    return x


def _inv_chol_upper(h: np.ndarray, damp: float) -> np.ndarray:
    """U upper triangular with U^T U = (H + damp*mean(diag H)*I)^-1, columns never seen set to 1."""
    h = np.array(h, dtype=np.float64, copy=True)
    k = h.shape[0]
    diag = np.diagonal(h).copy()
    dead = diag <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    diag[dead] = 1.0
    mean = float(diag[~dead].mean()) if (~dead).any() else 1.0
    h[np.arange(k), np.arange(k)] = diag + damp * mean
    for extra in (0.0, 0.1, 1.0, 10.0):
        try:
            if extra:
                h[np.arange(k), np.arange(k)] += extra * mean
            lo = _chol_lower(np.ascontiguousarray(h[::-1, ::-1]))    # J H J = L L^T
            # H = R R^T with R = J L J upper, so U = R^-1 = J L^-1 J has U^T U = H^-1
            return np.ascontiguousarray(_tri_inv_lower(lo)[::-1, ::-1])
        except np.linalg.LinAlgError:
            continue
    raise QuantError("Hessian is not positive definite even with heavy dampening")


def _header(slab: np.ndarray, fmt: str, imp):
    """Per-row header (d, m as float16 [N]) chosen for the block `slab` [N, <=G] by the search quantizer."""
    qt = quantize(slab, fmt, search=fmt != "q8", importance=imp if fmt != "q8" else None)
    p = layout.disassemble(fmt, qt.shape, qt.raw)
    return p.d[:, 0], (p.m[:, 0] if p.m is not None else None)


def _round(col: np.ndarray, fmt: str, d: np.ndarray, m):
    """Nearest code of each row's header for one column -> (codes uint8/int8, dequantized values)."""
    df = d.astype(F32)
    ok = df != 0
    safe = np.where(ok, df, F32(1))
    if fmt == "q3p":
        lv = layout.Q3P_LEVELS.astype(F32)
        mf = m.astype(F32)
        t = (col - mf) / safe
        q = np.searchsorted((lv[:-1] + lv[1:]) / F32(2), t).astype(np.uint8)
        q = np.where(ok, q, 0).astype(np.uint8)
        return q, df * lv[q] + mf
    if fmt in ("q4", "q3u"):
        top = 15 if fmt == "q4" else 7
        mf = m.astype(F32)
        q = np.where(ok, np.clip(np.rint((col - mf) / safe), 0, top), 0).astype(np.uint8)
        return q, df * q.astype(F32) + mf
    if fmt == "q6":
        s = np.where(ok, np.clip(np.rint(col / safe), -32, 31), 0)
        return (s + 32).astype(np.uint8), df * s.astype(F32)
    if fmt == "q8":
        s = np.where(ok, np.clip(np.rint(col / safe), -127, 127), 0)
        return s.astype(np.int8), df * s.astype(F32)
    raise QuantError(f"GPTQ has no column rounding for format {fmt!r}")


def row_losses(w: np.ndarray, wq: np.ndarray, h, step: int = 8192) -> np.ndarray:
    """Per-row calibration loss (w - wq) H (w - wq)^T, float64 [N] (H: an array or a Hessian)."""
    hs = h if isinstance(h, Hessian) else Hessian.full(h)
    out = np.zeros(w.shape[0], dtype=np.float64)
    for (c0, c1), hb in zip(hs.spans, hs.blocks):
        hf = hb.astype(np.float64)
        for r in range(0, w.shape[0], step):      # float64: a row's loss does not depend on the slab (see _gptq_rows)
            e = (w[r:r + step, c0:c1] - wq[r:r + step, c0:c1]).astype(np.float64)
            out[r:r + step] += np.einsum("ij,ij->i", e @ hf, e)
    return out


def gptq_quantize(w, fmt: str, h, *, damp: float = 0.01, header_importance: bool = False,
                  fallback: bool = True, rtn: QTensor | None = None, blas_threads: int | None = 1,
                  refit: int = 0) -> QTensor:
    """Quantize w [N, K] to `fmt` minimising tr((W - Ŵ) H (W - Ŵ)^T) column by column (module doc).

    header_importance: weight the per-block header search by diag(H) of the block's columns.
    fallback: per row, keep RTN (formats.quantize(search=True), or `rtn` when given) where it has the
    lower loss on H, so the result is never worse than RTN on the calibration data.
    blas_threads: BLAS threads for the factorisation and updates (None: the library's default). 1 is
    the default because on 2 shared, loaded cores multi-threaded OpenBLAS measured 2-5x slower here.
    refit: passes of refit_headers after GPTQ (and the fallback): codes kept, each block's (d, m)
    re-solved on the calibration loss; never raises a row's loss.
    """
    from threadpoolctl import threadpool_limits
    with threadpool_limits(blas_threads):
        qt = _gptq(w, fmt, h, damp, header_importance, fallback, rtn)
        return refit_headers(w, qt, h, passes=refit) if refit else qt


def _gptq(w, fmt, h, damp, header_importance, fallback, rtn) -> QTensor:
    if fmt not in GPTQ_FORMATS:
        raise QuantError(f"GPTQ supports {', '.join(GPTQ_FORMATS)}, not {fmt!r}")
    w = np.asarray(w, dtype=F32)
    hs = h if isinstance(h, Hessian) else Hessian.full(h)
    if w.ndim != 2 or hs.k != w.shape[1]:
        raise QuantError(f"GPTQ needs W [N, K] and a Hessian of K = {w.shape[1:]} columns; got W {w.shape}, "
                         f"H of {hs.k}")
    if not (np.isfinite(w).all() and all(np.isfinite(b).all() for b in hs.blocks)):
        raise QuantError("GPTQ input contains NaN or Inf")
    if not damp > 0:
        raise QuantError(f"damp must be > 0, got {damp!r}")
    if rtn is not None and (rtn.fmt != fmt or tuple(rtn.shape) != w.shape):
        raise QuantError(f"rtn is {rtn.fmt} {tuple(rtn.shape)}, expected {fmt} {w.shape}")
    n, k = w.shape
    lay = layout.PACKED[fmt]
    hs = hs.regroup(lay.group)
    facs = [(_inv_chol_upper(hb, damp).astype(F32), np.diagonal(hb).astype(F32)) for hb in hs.blocks]
    rb = lay.row_bytes(k)
    raw = np.empty((n, rb), dtype=np.uint8)
    # never a 1-row slab unless W is one row: numpy sends a 1-row product to gemv, whose sums may
    # round differently from gemm's, so a 1-row tail joins the slab before it
    step = max(2, int(ROWS))
    for r0 in range(0, n, step):
        if r0 and n - r0 < 2:
            break
        r1 = n if n - (r0 + step) < 2 else r0 + step
        ws = w[r0:r1]
        raw[r0:r1] = _gptq_rows(ws, fmt, hs, facs, header_importance).reshape(r1 - r0, rb)
        if not fallback:
            continue
        shape = (r1 - r0, k)
        rr = (rtn.raw.reshape(n, rb)[r0:r1] if rtn is not None
              else quantize(ws, fmt, search=fmt != "q8").raw.reshape(r1 - r0, rb))
        lg = row_losses(ws, dequantize(QTensor(fmt, shape, raw[r0:r1].reshape(-1))), hs)
        lr = row_losses(ws, dequantize(QTensor(fmt, shape, np.ascontiguousarray(rr).reshape(-1))), hs)
        worse = lg > lr
        if worse.any():
            raw[r0:r1][worse] = rr[worse]
    return QTensor(fmt, (n, k), raw.reshape(-1))


def _gptq_rows(w, fmt, hs, facs, header_importance) -> np.ndarray:
    """The column sweep over one slab of rows (rows are independent): packed bytes of w [n, K]."""
    n, k = w.shape
    lay = layout.PACKED[fmt]
    g, nb = lay.group, lay.blocks_per_row(k)
    W = w.copy()
    codes = np.zeros((n, nb, g), dtype=np.int8 if fmt == "q8" else np.uint8)
    dd = np.zeros((n, nb), dtype=np.float16)
    mm = np.zeros((n, nb), dtype=np.float16) if fmt not in ("q6", "q8") else None
    for (s0, s1), (u, hd) in zip(hs.spans, facs):
        u64 = u.astype(np.float64)
        for c0 in range(s0, s1, g):
            c1, b = min(s1, c0 + g), c0 // g
            blk = W[:, c0:c1]                    # a view: updated in place below
            d, m = _header(blk, fmt, hd[c0 - s0:c1 - s0] + F32(1e-12) if header_importance else None)
            dd[:, b] = d
            if mm is not None:
                mm[:, b] = m
            err = np.empty((n, c1 - c0), dtype=F32)
            for j in range(c1 - c0):
                jj = c0 - s0 + j
                q, v = _round(blk[:, j], fmt, d, m)
                codes[:, b, j] = q
                e = (blk[:, j] - v) / u[jj, jj]
                err[:, j] = e
                if j + 1 < c1 - c0:
                    blk[:, j + 1:] -= np.outer(e, u[jj, jj + 1:c1 - s0])
            if c1 < s1:
                # in float64: the products of float32 values are exact and the sums' rounding no
                # longer reaches float32, so a row's update does not depend on how many rows the
                # product has (OpenBLAS 0.3.31's sgemm sums a row differently for different row
                # counts: the row slabs would give other bytes)
                W[:, c1:s1] -= (err.astype(np.float64) @ u64[c0 - s0:c1 - s0, c1 - s0:]).astype(F32)
    return np.frombuffer(layout.assemble(fmt, (n, k), layout.Parts(codes=codes, d=dd, m=mm)), dtype=np.uint8)


def _levels(fmt: str, codes: np.ndarray) -> np.ndarray:
    """Codes -> the integer level each one multiplies by d (ŵ = d * L + m; m = 0 for q6/q8)."""
    if fmt == "q3p":
        return layout.Q3P_LEVELS.astype(np.float64)[codes]
    if fmt == "q6":
        return codes.astype(np.float64) - 32
    return codes.astype(np.float64)


def refit_headers(w, qt: QTensor, h, *, passes: int = 1, step: int = 8192) -> QTensor:
    """Codes kept, every block's header (d, m) re-solved on the calibration loss tr(E H E^T).

    Block by block (Gauss-Seidel over the blocks of a row, every row at once), the loss as a function
    of one block's (d, m) with everything else fixed is a 2x2 (q6/q8: 1x1) least-squares problem in
    the block's Hessian H_bb plus the coupling r = (E H)_b - E_b H_bb to the other columns. The
    solution is rounded to fp16 and kept only for the rows where the exact change of the loss is
    negative (and d stays positive and finite), so no row's loss ever rises: the RTN bound of the
    fallback still holds. Why: GPTQ picks each header from the error-updated weights before the
    block's columns are rounded; once the codes are known, the loss-optimal header differs.

    Measured end to end (docs/quality.md §0) it is not a reliable gain: worse than GPTQ alone on 2356,
    better on 2356c. H here is undampened, so the fit can trade error in input directions the few
    calibration tokens barely excite for calibration loss (overfitting). Off by default; a tested option."""
    fmt = qt.fmt
    if fmt not in GPTQ_FORMATS:
        raise QuantError(f"refit_headers supports {', '.join(GPTQ_FORMATS)}, not {fmt!r}")
    w = np.asarray(w, dtype=F32)
    hs = h if isinstance(h, Hessian) else Hessian.full(h)
    n, k = w.shape
    lay = layout.PACKED[fmt]
    g = lay.group
    hs = hs.regroup(g)
    p = layout.disassemble(fmt, qt.shape, qt.raw)
    d, m = p.d.copy(), (p.m.copy() if p.m is not None else None)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        L = _levels(fmt, p.codes[r0:r1])                                  # [n, nb, G] float64
        for (s0, s1), hb in zip(hs.spans, hs.blocks):
            H = np.asarray(hb, dtype=np.float64)
            ws = w[r0:r1, s0:s1].astype(np.float64)
            b0 = s0 // g
            nbs = -(-(s1 - s0) // g)
            Ls = L[:, b0:b0 + nbs, :].reshape(r1 - r0, -1)[:, :s1 - s0]
            dd = np.repeat(d[r0:r1, b0:b0 + nbs].astype(np.float64), g, axis=1)[:, :s1 - s0]
            mmv = (np.repeat(m[r0:r1, b0:b0 + nbs].astype(np.float64), g, axis=1)[:, :s1 - s0]
                   if m is not None else 0.0)
            E = ws - (dd * Ls + mmv)
            HE = E @ H
            for _ in range(passes):
                for c0 in range(0, s1 - s0, g):
                    c1, b = min(s1 - s0, c0 + g), b0 + c0 // g
                    Hb = H[c0:c1, c0:c1]
                    lb, zb, eb = Ls[:, c0:c1], ws[:, c0:c1], E[:, c0:c1]
                    rc = HE[:, c0:c1] - eb @ Hb                            # coupling to the other columns
                    P = lb @ Hb
                    a11 = (P * lb).sum(1)
                    y1 = (P * zb).sum(1) + (lb * rc).sum(1)
                    if m is None:
                        with np.errstate(divide="ignore", invalid="ignore"):
                            a = np.where(a11 > 0, y1 / np.where(a11 > 0, a11, 1), 0)
                        bb = np.zeros_like(a)
                    else:
                        o = Hb.sum(0)
                        a12, a22 = P.sum(1), float(o.sum())
                        y2 = zb @ o + rc.sum(1)
                        det = a11 * a22 - a12 * a12
                        with np.errstate(divide="ignore", invalid="ignore"):
                            ok = det > 1e-12 * np.maximum(a11 * a22, 1e-300)
                            sd = np.where(ok, det, 1)
                            a = np.where(ok, (y1 * a22 - a12 * y2) / sd, 0)
                            bb = np.where(ok, (a11 * y2 - a12 * y1) / sd, 0)
                    with np.errstate(over="ignore", invalid="ignore"):
                        a16 = a.astype(np.float16)
                        b16 = bb.astype(np.float16)
                    new = a16.astype(F32).astype(np.float64)[:, None] * lb
                    if m is not None:
                        new = new + b16.astype(F32).astype(np.float64)[:, None]
                    en = zb - new
                    # exact change of the row loss: e' H e' + 2 e' r - (e H e + 2 e r)
                    delta = (np.einsum("ij,jk,ik->i", en, Hb, en) + 2 * (en * rc).sum(1)
                             - np.einsum("ij,jk,ik->i", eb, Hb, eb) - 2 * (eb * rc).sum(1))
                    scale = np.einsum("ij,ij->i", E, HE)
                    take = (np.isfinite(a16.astype(F32)) & np.isfinite(b16.astype(F32)) & (a16.astype(F32) > 0)
                            & (delta < -1e-9 * np.abs(scale)))
                    if not take.any():
                        continue
                    d[r0:r1, b][take] = a16[take]
                    if m is not None:
                        m[r0:r1, b][take] = b16[take]
                    diff = np.where(take[:, None], en - eb, 0.0)
                    E[:, c0:c1] += diff
                    HE += diff @ H[c0:c1, :]
    raw = layout.assemble(fmt, qt.shape, layout.Parts(codes=p.codes, d=d, m=m))
    return QTensor(fmt, qt.shape, np.frombuffer(raw, dtype=np.uint8))
