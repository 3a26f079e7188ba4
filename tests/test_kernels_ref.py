"""Numpy emulation of the integer path of mixqrt's products (src/ops/generic.c, mq_ops.h), and
random packed tensors built from codes and scales via layout.Parts + layout.assemble."""
from __future__ import annotations

import numpy as np

from mixqrt.formats import layout

OFF = {"q6": 32}   # q8: the kernels form the signed sums exactly (U - 128, in integers)
PACKED_FMTS = ("q8", "q6", "q4", "q3u", "q3p", "q2c", "q5g")


class FakeQT:
    """Duck-typed QTensor (fmt, shape, raw, meta) usable before formats/codec.py exists."""

    def __init__(self, fmt, shape, raw, meta=None):
        self.fmt, self.shape, self.raw, self.meta = fmt, tuple(shape), raw, meta or {}

    def dequantize(self):
        if self.fmt in layout.PACKED:
            return layout.dequantize_bytes(self.fmt, self.shape, self.raw.tobytes())
        dt = layout.PLAIN[self.fmt]
        v = self.raw.view(dt).reshape(self.shape)
        if self.fmt == "bf16":
            return (v.astype(np.uint32) << 16).view(np.float32)
        return v.astype(np.float32)


def random_parts(fmt, n, k, rng, exact=False):
    """Random codes/scales. exact=True: power-of-two scales and small offsets so that every float
    operation of the kernels is exact (results must then match the emulation bit for bit)."""
    lay = layout.PACKED[fmt]
    nb = lay.blocks_per_row(k)
    g = lay.group
    if fmt == "q8":
        codes = rng.integers(-128, 128, size=(n, nb, g)).astype(np.int8)
    else:
        codes = rng.integers(0, 1 << lay.bits, size=(n, nb, g)).astype(np.uint8)
    if exact:
        d = (2.0 ** rng.integers(-3, 1, size=(n, nb))).astype(np.float16)
        m = (rng.integers(-4, 5, size=(n, nb)) * 2.0 ** -3).astype(np.float16)
    else:
        d = rng.uniform(1e-3, 2e-2, size=(n, nb)).astype(np.float16)
        m = rng.uniform(-0.2, 0.2, size=(n, nb)).astype(np.float16)
    p = layout.Parts(codes=codes, d=d)
    if fmt in ("q4", "q3u", "q3p", "q2c"):
        p.m = m
    if fmt == "q2c":
        hi = 64 if exact else 256
        p.lut = np.sort(rng.integers(0, hi, size=(n, nb, 4)), axis=-1).astype(np.uint8)
    if fmt == "q5g":
        p.lo_hi = (-0.5, -0.5 + 31 * 2.0 ** -5) if exact else (-0.37, 0.61)
    return p


def random_qtensor(fmt, n, k, rng, exact=False):
    if fmt in layout.PLAIN:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        if fmt == "f16":
            raw = w.astype(np.float16).view(np.uint8).reshape(-1)
        elif fmt == "bf16":
            raw = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
        else:
            raw = w.view(np.uint8).reshape(-1)
        return FakeQT(fmt, (n, k), np.ascontiguousarray(raw))
    parts = random_parts(fmt, n, k, rng, exact)
    raw = np.frombuffer(layout.assemble(fmt, (n, k), parts), dtype=np.uint8).copy()
    return FakeQT(fmt, (n, k), raw)


def exact_activations(t, k, rng):
    """Activations whose int8 quantization is exact: per 32-block a power-of-two step, one value
    at +-127 steps and the rest small integers of steps."""
    kp = -(-k // 32) * 32
    a = rng.integers(-31, 32, size=(t, kp // 32, 32))
    a[:, :, 0] = rng.choice([-127, 127], size=(t, kp // 32))
    step = 2.0 ** rng.integers(-6, -2, size=(t, kp // 32, 1))
    x = (a * step).reshape(t, kp)[:, :k]
    # the last block may have lost its +-127 to the cut; re-anchor it
    tail = k - (kp // 32 - 1) * 32
    x[:, k - tail] = 127 * step[:, -1, 0] * np.sign(x[:, k - tail] + 0.5)
    return np.ascontiguousarray(x.astype(np.float32))


def quantize_act_ref(x: np.ndarray):
    """Exactly the C activation quantization: x [T, K] -> q int8 [T, kp], d, s float32 [T, kp/32]."""
    t, k = x.shape
    kp = -(-k // 128) * 128
    xp = np.zeros((t, kp), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(t, kp // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(t, kp), d, s


def unpacked_levels(fmt, shape, raw, q3p_levels=layout.Q3P_LEVELS):
    """-> U int64 [N, nc*32] (u8 levels; q8: its signed codes), dw float32 [N, nc], mm float32 [N, nc]
    as the kernels see them."""
    n, k = layout.rows_cols(shape)
    lay = layout.PACKED[fmt]
    parts = layout.disassemble(fmt, shape, raw.tobytes())
    nb = lay.blocks_per_row(k)
    cpb = lay.group // 32
    c = parts.codes.reshape(n, nb * lay.group)
    if fmt == "q8":
        u = c.view(np.int8).astype(np.int64)
    elif fmt == "q3p":
        u = q3p_levels[c].astype(np.int64)
    elif fmt == "q2c":
        u = np.take_along_axis(parts.lut, parts.codes.astype(np.intp), axis=-1).reshape(n, -1).astype(np.int64)
    else:
        u = c.astype(np.int64)
    if fmt == "q5g":
        lo, hi = np.float32(parts.lo_hi[0]), np.float32(parts.lo_hi[1])
        dw = np.full((n, nb * cpb), (hi - lo) / np.float32(31), np.float32)
        mm = np.full((n, nb * cpb), lo, np.float32)
    else:
        dw = np.repeat(parts.d.astype(np.float32), cpb, axis=1)
        m = np.repeat(parts.m.astype(np.float32), cpb, axis=1) if parts.m is not None else np.zeros_like(dw)
        mm = (m - np.float32(OFF.get(fmt, 0)) * dw).astype(np.float32)
    return u, dw, mm


def emulate_matmul(fmt, shape, raw, x, q3p_levels=layout.Q3P_LEVELS):
    """-> (y float64 [T, N], bound float64 [T, N]): the kernels' integer sums exactly, their float
    combination in float64, and a bound on the float32 rounding of any summation order."""
    u, dw, mm = unpacked_levels(fmt, shape, raw, q3p_levels)
    n = u.shape[0]
    nc = dw.shape[1]
    q, d, s = quantize_act_ref(x)
    t = x.shape[0]
    qa = q[:, : nc * 32].reshape(t, nc, 32).astype(np.int64)
    ub = u.reshape(n, nc, 32)
    isum = np.einsum("nci,tci->tnc", ub, qa)                     # exact int64
    iabs = np.einsum("nci,tci->tnc", np.abs(ub), np.abs(qa))
    dwdx = (dw[None, :, :] * d[:, None, :nc]).astype(np.float32).astype(np.float64)   # [T, N, nc]
    ms = mm.astype(np.float64)[None] * s[:, None, :nc].astype(np.float64)
    y = (dwdx * isum).sum(-1) + ms.sum(-1)
    mag = (np.abs(dwdx) * iabs).sum(-1) + np.abs(ms).sum(-1)
    bound = (2 * nc + 8) * 2.0 ** -24 * mag * 1.01 + 1e-30
    return y, bound
