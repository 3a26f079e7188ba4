"""q2c reference: a 4-level codebook per group from a deterministic 1-D k-means.

This numpy code is the spec the C fast path (src/quant/kmeans.c) reproduces bit for bit, so every
floating-point step is pinned down:

- values are sorted per group; 1-D k-means clusters are contiguous runs of the sorted values, so a
  cluster mean is a difference of prefix sums. Prefix sums are float64, accumulated left to right
  (np.cumsum is sequential, unlike np.sum which is pairwise).
- init (k-means++, derandomised): centre 0 is the lower median; centre j (1..3) is drawn by D^2
  sampling with a fixed quantile U[j] instead of a random number: the first sorted value whose
  cumulative D^2 exceeds U[j] * total. A value already chosen has D^2 = 0, so it is never drawn
  twice while an unchosen distinct value exists.
- Lloyd: boundaries = how many sorted values are <= each midpoint (ties go to the lower cluster);
  stop when the boundaries repeat or after MAX_ITERS; an empty cluster keeps its centre.
- codebook: m = fp16(c0), d = fp16 rounded toward zero of (c3 - m) / 255 (then snapped so that
  level 255 reproduces c3 exactly when a neighbour fp16 value does), lut = rint((c - m) / d).
- codes go to the nearest reconstructed level (ties to the lower code); if the k-means codebook's
  squared error (float64, summed in element order) exceeds that of the uniform min/max codebook
  lut = (0, 85, 170, 255), the uniform one is stored instead.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
U = (0.5, 0.25, 0.75)           # D^2 quantiles for centres 1..3
MAX_ITERS = 16
UNIFORM_LUT = np.array([0, 85, 170, 255], dtype=np.uint8)


def h_rne(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(np.float16)


def h_rtz(a) -> np.ndarray:
    """float32 -> float16 rounded toward zero: a scale never exceeds the exact quotient, so the
    extreme element always reaches the top code (that is what makes re-quantization a fixed point)."""
    a = np.asarray(a, dtype=F32)
    h = np.atleast_1d(a.astype(np.float16))
    over = np.abs(h.astype(F32)) > np.abs(np.atleast_1d(a))
    bits = h.view(np.uint16) - over.astype(np.uint16)
    return bits.view(np.float16).reshape(a.shape)


def snap(d16: np.ndarray, m32, top: float, target: np.ndarray) -> np.ndarray:
    """Keep d16 if fl(d*top + m) == target, else take the next fp16 up if that one hits target."""
    top = F32(top)
    up_bits = d16.view(np.uint16).astype(np.uint32) + 1
    ok = up_bits < 0x7C00
    up = np.where(ok, up_bits, 0x7BFF).astype(np.uint16).view(np.float16)
    hit0 = (d16.astype(F32) * top + m32) == target
    hit1 = ok & ((up.astype(F32) * top + m32) == target)
    return np.where(~hit0 & hit1, up, d16)


def _codebook(c0: np.ndarray, c3: np.ndarray, c: np.ndarray):
    """float32 centres -> (d16, m16, lut u8[...,4])."""
    m16 = h_rne(c0)
    m = m16.astype(F32)
    raw = (c3 - m) / F32(255)
    d16 = snap(h_rtz(np.where(raw > 0, raw, F32(0))), m, 255.0, c3)
    d = d16.astype(F32)
    pos = d > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (c - m[:, None]) / np.where(pos, d, F32(1))[:, None]
    lut = np.where(pos[:, None], np.clip(np.rint(t), 0, 255), 0).astype(np.uint8)
    return d16, m16, lut


def _assign(x: np.ndarray, valid: np.ndarray, d16, m16, lut):
    """Nearest reconstructed level per value; returns (codes u8, sse float64)."""
    r = d16.astype(F32)[:, None] * lut.astype(F32) + m16.astype(F32)[:, None]      # [B, 4]
    dist = np.abs(x[:, :, None] - r[:, None, :])
    codes = np.argmin(dist, axis=-1).astype(np.uint8)
    codes[~valid] = 0
    rec = np.take_along_axis(r, codes.astype(np.intp), axis=1)
    e = x.astype(np.float64) - rec.astype(np.float64)
    e = np.where(valid, e * e, 0.0)
    return codes, np.cumsum(e, axis=1)[:, -1]


def _kmeans(s: np.ndarray, vs: np.ndarray, nv: np.ndarray) -> np.ndarray:
    """s: sorted values as float64 [B, G] (pads anywhere past nv); returns sorted centres [B, 4]."""
    B = s.shape[0]
    rows = np.arange(B)
    sz = np.where(vs, s, 0.0)
    P = np.concatenate([np.zeros((B, 1)), np.cumsum(sz, axis=1)], axis=1)          # [B, G+1]
    C = np.zeros((B, 4))
    C[:, 0] = s[rows, (nv - 1) // 2]
    d2 = None
    for j in range(1, 4):
        diff = sz - C[:, j - 1:j]
        dj = np.where(vs, diff * diff, 0.0)
        d2 = dj if d2 is None else np.minimum(d2, dj)
        cum = np.cumsum(d2, axis=1)
        thr = U[j - 1] * cum[:, -1]
        idx = np.minimum((cum <= thr[:, None]).sum(axis=1), nv - 1)
        C[:, j] = s[rows, idx]
    C = np.sort(C, axis=1)
    active = np.ones(B, dtype=bool)
    prev = np.zeros((B, 3), dtype=np.int64)
    for it in range(MAX_ITERS):
        T = (C[:, :-1] + C[:, 1:]) * 0.5
        bnd = np.stack([(vs & (sz <= T[:, k:k + 1])).sum(axis=1) for k in range(3)], axis=1)
        if it > 0:
            active &= ~np.all(bnd == prev, axis=1)
        if not active.any():
            break
        edges = np.concatenate([np.zeros((B, 1), np.int64), bnd, nv[:, None]], axis=1)
        cnt = np.diff(edges, axis=1)
        sums = np.take_along_axis(P, edges[:, 1:], 1) - np.take_along_axis(P, edges[:, :-1], 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            new = np.where(cnt > 0, sums / np.maximum(cnt, 1), C)
        C = np.where(active[:, None], np.sort(new, axis=1), C)
        prev = np.where(active[:, None], bnd, prev)
    return C


def quantize_blocks(x: np.ndarray, nv: np.ndarray):
    """x: float32 [B, G] (values past nv[b] are padding); -> (codes [B,G] u8, d16, m16, lut [B,4])."""
    B, G = x.shape
    valid = np.arange(G)[None, :] < nv[:, None]
    s = np.sort(np.where(valid, x, np.inf), axis=1) + F32(0)          # pads sort last; -0.0 -> +0.0
    vs = np.arange(G)[None, :] < nv[:, None]
    s64 = s.astype(np.float64)
    C = _kmeans(s64, vs, nv).astype(F32)
    d_k, m_k, lut_k = _codebook(C[:, 0], C[:, 3], C)
    codes_k, sse_k = _assign(x, valid, d_k, m_k, lut_k)
    mn = s[:, 0]
    mx = s[np.arange(B), nv - 1]
    m_u = h_rne(mn)
    raw = (mx - m_u.astype(F32)) / F32(255)
    d_u = snap(h_rtz(np.where(raw > 0, raw, F32(0))), m_u.astype(F32), 255.0, mx)
    lut_u = np.broadcast_to(UNIFORM_LUT, (B, 4)).copy()
    lut_u[d_u.astype(F32) == 0] = 0
    codes_u, sse_u = _assign(x, valid, d_u, m_u, lut_u)
    use_k = sse_k <= sse_u
    pick = lambda a, b: np.where(use_k.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return pick(codes_k, codes_u), pick(d_k, d_u), pick(m_k, m_u), pick(lut_k, lut_u), sse_k, sse_u
