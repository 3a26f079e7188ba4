"""The numpy reference of the packed KV cache: the block format, the packer and the attention over
it, operation for operation as the C kernels (src/ops/kvattn_impl.h) compute them, so that every ISA
tier is compared against this module bit for bit (tests/test_kv.py).

The formats, per layer, per KV head, per block of G = 64 positions. ``q8`` (8.5 bits per value):

    kscale [Dh] f16, kmin [Dh] f16     keys per channel over the block's 64 positions (KIVI):
                                       k[t, c] ~ kscale[c] * code + kmin[c], codes 0 .. 255
    kcodes                             G x Dh codes, laid out for a 4-byte integer dot whose 16 lanes
                                       are 16 positions (see k_layout)
    vscale [G] f16, vmin [G] f16       values per position over the head's Dh channels:
                                       v[t, d] ~ vscale[t] * code + vmin[t]
    vcodes                             G x Dh codes, laid out for a 4-byte integer dot whose 16 lanes
                                       are 16 channels (see v_layout)

``q4`` (4.5 bits per value at Dh = 64: keys 4.875, values 4.125; the keys carry most of the loss):

    kmin [Dh] f16, kscale [Dh] u8      keys per channel over the block, as q8 with codes 0 .. 15 (the
                                       scale an 8-bit code of LOGTAB, rounded up), and
    kadj [4, Dh] u8                    per 16-position sub-block i a narrower range (sub_ranges): the
                                       min moves up (kadj & 15) * kscale, the step becomes
                                       kscale * ((kadj >> 4) + 1) / 16
    kcodes                             4-bit, k_layout
    vscale [G] u8                      values per position, symmetric: v[t, d] ~ vscale[t] * VLEV[code],
    vcodes                             vscale = absmax / 127 rounded up to LOGTAB, VLEV NF4's 16
                                       normal quantiles as int8

Block 0 (the first 64 positions: the attention sink) is never packed, and the most recent
positions are read in f16: a position's K/V are first stored in f16, a block is packed when its
64th position is written, and row p (n = p + 1 keys) reads block 0, the partial block n // G and the
RECENT whole blocks before it in f16, blocks 1 .. n // G - RECENT - 1 packed. What a row reads
depends on its position only, so a prompt's rows equal single decode steps bit for bit. (RECENT = 1
halved the 4-bit cache's loss; RECENT = 3, 192 to 255 positions read exactly as KIVI's residual
window, took another 6-16 % at 8k-16k tokens for about 1 % of a 16k step: docs/long-context.md.)

Attention per row and query head, blocks in order with an online softmax in base 2 (m, 16 lanes of
l, acc; scale = 1 / sqrt(Dh) * log2(e)):
  f16 block (positions i0 .. i1-1):  s_t = dot(q, k_t) * scale                (dotf: 16 lanes, tree)
  packed block:  q'_c = q_c * kscale_c; a = max|q'|;
                 q8_c = rint(q'_c * (127 / a)), d = a / 127;
                 q8: C = dot(q, kmin); s_t = (float(sum_c q8_c code_tc) * d + C) * scale
                 q4: u_tc = 16 a_ic + (b_ic + 1) code_tc (<= 255, sub-block i of t: k = kmin + kscale / 16 u);
                     s_t = (float(sum_c q8_c u_tc) * (d / 16) + C) * scale
  m' = max(m, max_t s_t); alpha = fexp2(m - m') (0 on the first block); p_t = fexp2(max(s_t - m', -125))
  lanes_i = lanes_i * alpha + (((p_i + p_i+16) + p_i+32) + p_i+48)             (zeros past the block's n)
  f16 block:     acc_d = acc_d * alpha + (p_t * v_td, added in position order)
  packed block:  p'_t = p_t * vscale_t; b = max p'; p8_t = rint(p'_t * (PMAX / b)), e = b / PMAX
                 q8: acc_d = acc_d * alpha + (float(sum_t p8_t vcode_td) * e + sum16(p_t * vmin_t))
                 q4: acc_d = acc_d * alpha + float(sum_t p8_t VLEV[vcode_td]) * e
  out = acc / ltree(lanes)
"""
from __future__ import annotations

import numpy as np

G = 64                      # positions per block
RECENT = 3                  # whole blocks before a row's own partial block that it reads in f16 (misc.h MQ_KV_RECENT)
F32 = np.float32


def pmax_of(bits: int) -> int:
    """Levels of a quantized probability: 8-bit values take signed probabilities (0..127) against
    unsigned codes, 4-bit values unsigned probabilities (0..255) against codes that fit a signed byte."""
    return 127 if bits == 8 else 255


SUB = 16                    # q4: positions per key sub-block (its own narrowing of the block's range)
NSUB = G // SUB
# q4's 8-bit scales (the keys' per-channel block scale, the values' per-position scale): code e stands
# for LOGTAB[e] = 2^((e mod 12) / 12) * 2^(e // 12 - 16), 1.5e-5 .. 38.1 in steps of 2^(1/12); a scale
# is stored as the smallest code at or above it, so the grid still covers the range (misc.h MQ_KV_LOGMANT)
LOGMANT = np.array([2.0 ** (k / 12) for k in range(12)]).astype(np.float32)
LOGTAB = np.array([np.ldexp(LOGMANT[e % 12], e // 12 - 16) for e in range(256)], np.float32)


def log8_code(x) -> np.ndarray:
    """The 8-bit code of scale(s) x: the first e with LOGTAB[e] >= x (255 if none, NaN included)."""
    return np.minimum(np.searchsorted(LOGTAB, np.asarray(x, np.float32), side="left"), 255).astype(np.uint8)
# q4 values: the 16 levels a code stands for, in units of the position's scale (absmax / 127): NF4's
# normal quantiles (QLoRA) rounded to int8 (misc.h MQ_KV_VLEV)
VLEV = np.array([-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127], np.int32)


def block_bytes(dh: int, bits: int) -> int:
    """Bytes of one packed block of one KV head (misc.h MQ_KV_BLOCK_BYTES)."""
    if bits == 4:
        return 2 * dh + dh + NSUB * dh + G * dh // 2 + G + G * dh // 2
    return 4 * dh + G * dh + 4 * G + G * dh


def offsets(dh: int, bits: int) -> dict:
    nk = G * dh * bits // 8
    if bits == 4:
        ka = 3 * dh + NSUB * dh
        return {"kmin": 0, "kscale": 2 * dh, "kadj": 3 * dh, "kcodes": ka, "vscale": ka + nk, "vcodes": ka + nk + G}
    return {"kscale": 0, "kmin": 2 * dh, "kcodes": 4 * dh, "vscale": 4 * dh + nk, "vmin": 4 * dh + nk + 2 * G,
            "vcodes": 4 * dh + nk + 4 * G}


def fwht(x) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of the last axis in blocks of its largest power-of-two
    divisor n (all of it for head dims 64, 128, 256), float32 butterflies (pairs i, i + h for h = 1,
    2, 4, ...), then times 1/sqrt(n) (kvpack.c mq_kv_fwht). Its own inverse up to rounding. q4 stores a
    layer's values rotated by it, and its attention rotates the output back."""
    x = np.array(x, F32, copy=True)
    shape = x.shape
    n = shape[-1] & -shape[-1]
    x = x.reshape(*shape[:-1], shape[-1] // n, n)
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(x.shape)
        h *= 2
    return (x * F32(1.0 / np.sqrt(n))).astype(F32).reshape(shape)


def rotates_values(bits: int) -> bool:
    """q4 keeps a packed layer's values Hadamard-rotated (f16 rows and packed blocks alike): rotated
    values are near-normal, which NF4's levels fit; the rows' outputs are rotated back."""
    return bits == 4


def check_head_dim(dh: int) -> None:
    if dh % 32 or dh < 32:
        raise ValueError(f"packed KV needs a head_dim that is a multiple of 32, got {dh}")


# ----------------------------------------------------------------------------- float helpers
def f16r(x) -> np.ndarray:
    """float32 -> f16 -> float32 (round to nearest even)."""
    return np.asarray(x, F32).astype(np.float16).astype(F32)


E2LO = np.float32(-125.0)   # kvattn_impl.h MQ_KV_E2LO
E2C = tuple(np.float32(float.fromhex(h)) for h in ("0x1.62e12ep-1", "0x1.ec0368p-3", "0x1.c9fc2ap-5", "0x1.3a0728p-7"))
LOG2E = np.float32(float.fromhex("0x1.715476p+0"))


def fexp2(x) -> np.ndarray:
    """The attention's exp, base 2 (kvattn_impl.h kexp2_ / kv_exp64_), x in [E2LO, 0]: 2^n * P(f),
    n = rint(x), f = x - n (exact), P of degree 4 by Horner in float32; the product is normal and exact."""
    x = np.asarray(x, F32)
    n = np.rint(x)
    f = (x - n).astype(F32)
    p = np.full_like(x, E2C[3])
    for c in (E2C[2], E2C[1], E2C[0], F32(1.0)):
        p = (p * f + c).astype(F32)
    return np.ldexp(p, n.astype(np.int32)).astype(F32)


def lanes16(p) -> np.ndarray:
    """[..., n <= 64] -> [..., 16]: lane i = ((p_i + p_i+16) + p_i+32) + p_i+48, zeros past n."""
    p = np.asarray(p, F32)
    if p.shape[-1] < 64:
        p = np.concatenate([p, np.zeros(p.shape[:-1] + (64 - p.shape[-1],), F32)], -1)
    return ((p[..., 0:16] + p[..., 16:32]) + p[..., 32:48]) + p[..., 48:64]


def ltree(lanes) -> np.ndarray:
    """[..., 16] -> [...]: sum16's tree (8 + 8, 4 + 4, (0 + 2) + (1 + 3))."""
    h = lanes[..., :8] + lanes[..., 8:]
    q = h[..., :4] + h[..., 4:]
    return (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])


def sum16(x) -> np.float32:
    """Sum of the last axis as the kernels add it: 16 lanes (value i to lane i % 16, in order), then
    the lanes' tree: 8 + 8, 4 + 4, then (r0 + r2) + (r1 + r3)."""
    x = np.asarray(x, F32)
    n = x.shape[-1]
    pad = (-n) % 16
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), F32)], -1)
    lanes = np.zeros(x.shape[:-1] + (16,), F32)
    for i in range(0, x.shape[-1], 16):
        lanes = lanes + x[..., i:i + 16]
    return ltree(lanes)


def dotf(a, b) -> np.float32:
    """misc_impl.h dotf_: products, then sum16."""
    return sum16(np.asarray(a, F32) * np.asarray(b, F32))


# ----------------------------------------------------------------------------- layouts
def k_layout(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [G, Dh] (position, channel) -> the packed key bytes. 8 bits: per 16 positions s and 4
    channels c4, 64 bytes: byte 4 t + j = code(16 s + t, 4 c4 + j). 4 bits: per 16 positions and 8
    channels m, 64 bytes: low nibble code(16 s + t, 8 m + j), high nibble code(16 s + t, 8 m + 4 + j)."""
    g, dh = codes.shape
    c = codes.astype(np.uint8).reshape(g // 16, 16, dh // 4, 4)                # [s, t, c4, j]
    if bits == 8:
        return c.transpose(0, 2, 1, 3).reshape(-1).copy()                       # [s, c4, t, j]
    c = c.reshape(g // 16, 16, dh // 8, 2, 4)                                    # [s, t, m, half, j]
    b = c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)                               # [s, t, m, j]
    return b.transpose(0, 2, 1, 3).reshape(-1).copy()


def k_unlayout(raw: np.ndarray, dh: int, bits: int) -> np.ndarray:
    raw = np.asarray(raw, np.uint8)
    if bits == 8:
        return raw.reshape(G // 16, dh // 4, 16, 4).transpose(0, 2, 1, 3).reshape(G, dh).astype(np.int32)
    b = raw.reshape(G // 16, dh // 8, 16, 4).transpose(0, 2, 1, 3)                # [s, t, m, j]
    lo, hi = b & 15, b >> 4
    return np.stack([lo, hi], 3).reshape(G, dh).astype(np.int32)


def v_layout(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [G, Dh] -> the packed value bytes. 8 bits: per 4 positions u and 16 channels c16, 64
    bytes: byte 4 d + j = code(4 u + j, 16 c16 + d). 4 bits: per 4 positions and 32 channels m, 64
    bytes: low nibble code(4 u + j, 32 m + d), high nibble code(4 u + j, 32 m + 16 + d)."""
    g, dh = codes.shape
    c = codes.astype(np.uint8).reshape(g // 4, 4, dh // 16, 16)                 # [u, j, c16, d]
    if bits == 8:
        return c.transpose(0, 2, 3, 1).reshape(-1).copy()                       # [u, c16, d, j]
    c = c.reshape(g // 4, 4, dh // 32, 2, 16)                                    # [u, j, m, half, d]
    b = c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)                               # [u, j, m, d]
    return b.transpose(0, 2, 3, 1).reshape(-1).copy()


def v_unlayout(raw: np.ndarray, dh: int, bits: int) -> np.ndarray:
    raw = np.asarray(raw, np.uint8)
    if bits == 8:
        return raw.reshape(G // 4, dh // 16, 16, 4).transpose(0, 3, 1, 2).reshape(G, dh).astype(np.int32)
    b = raw.reshape(G // 4, dh // 32, 16, 4).transpose(0, 3, 1, 2)               # [u, j, m, d]
    lo, hi = b & 15, b >> 4
    return np.stack([lo, hi], 3).reshape(G, dh).astype(np.int32)


# ----------------------------------------------------------------------------- the packer
def _range_codes(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, qmax: int):
    """(scale f16, min f16, codes) of x against per-group lo/hi (broadcast)."""
    sc = f16r((hi - lo) / F32(qmax))
    mn = f16r(lo)
    inv = np.where(sc > 0, F32(1.0) / np.where(sc > 0, sc, F32(1.0)), F32(0.0)).astype(F32)
    codes = np.clip(np.rint((x - mn) * inv), 0, qmax).astype(np.int32)
    return sc, mn, codes


def sub_ranges(sc: np.ndarray, mn: np.ndarray, adj: np.ndarray) -> tuple:
    """q4 keys: a sub-block's (scale, min) per channel from the block's (sc, mn) and its adjustment
    bytes (low nibble a: the min moves up a * sc; high nibble: the scale is sc * (hi + 1) / 16)."""
    a = (adj & 15).astype(F32)
    b1 = ((adj >> 4) + 1).astype(F32)
    return ((sc * b1) * F32(0.0625)).astype(F32), (mn + sc * a).astype(F32)


KEY_NA, KEY_NB = 3, 4       # q4 keys: the (a, b) candidates a half-block's range is searched over


def _sub_codes(x: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    inv = np.where(sc > 0, F32(1.0) / np.where(sc > 0, sc, F32(1.0)), F32(0.0)).astype(F32)
    return np.clip(np.rint((x - mn) * inv), 0, 15).astype(np.int32)


def _sub_error(x: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Squared error per channel of x [SUB, Dh] against (sc, mn), as kvpack.c kv_sub_error: codes
    rounded half to even and clamped to 0..15, the errors added position by position in float32."""
    inv = np.where(sc > 0, F32(1.0) / np.where(sc > 0, sc, F32(1.0)), F32(0.0)).astype(F32)
    e = np.zeros(x.shape[1], F32)
    for t in range(x.shape[0]):
        y = np.clip((x[t] - mn) * inv, F32(-1.0), F32(16.0)).astype(F32)
        c = np.clip(np.rint(y), F32(0.0), F32(15.0)).astype(F32)
        d = ((c * sc + mn) - x[t]).astype(F32)
        e = (e + d * d).astype(F32)
    return e


def _q4_keys(k: np.ndarray):
    """k [G, Dh] -> (kscale f16, kmin f16, adj [NSUB, Dh] uint8, codes [G, Dh]). Each half-block's
    (a, b) is the one of least squared error among a0 .. a0 + KEY_NA - 1 (a0: the largest min at or
    below the half's own) and, for each a, the b that covers the half's max and the KEY_NB - 1 below
    it (the top values clipped); the first of equals wins."""
    lo, hi = k.min(0), k.max(0)
    ks = LOGTAB[log8_code((hi - lo) / F32(15))]
    km = f16r(lo)
    pos = ks > 0
    div = np.where(pos, ks, F32(1.0))
    codes = np.zeros(k.shape, np.int32)
    adj = np.zeros((NSUB, k.shape[1]), np.uint8)
    for i in range(NSUB):
        x = k[i * SUB:(i + 1) * SUB]
        li, hi_ = x.min(0), x.max(0)
        a0 = np.where(pos, np.clip(np.floor((li - km) / div), 0, 15), 0).astype(np.int32)
        best = berr = None
        for da in range(KEY_NA):
            a = np.where(pos, np.minimum(a0 + da, 15), 0)
            mi = (km + ks * a.astype(F32)).astype(F32)
            need = ((hi_ - mi) * F32(16)) / (div * F32(15))
            bn = np.where(pos, np.clip(np.ceil(need), 1, 16), 16).astype(np.int32)
            b1max = (255 - 16 * a) // 15                              # 16 a + (b + 1) * code fits a byte
            for db in range(KEY_NB):
                b1 = np.minimum(np.where(pos, np.maximum(bn - db, 1), 16), b1max)
                cand = (a | ((b1 - 1) << 4)).astype(np.uint8)
                err = _sub_error(x, *sub_ranges(ks, km, cand))
                if best is None:
                    best, berr = cand, err
                else:
                    take = err < berr
                    best = np.where(take, cand, best)
                    berr = np.where(take, err, berr)
        adj[i] = best
        codes[i * SUB:(i + 1) * SUB] = _sub_codes(x, *sub_ranges(ks, km, adj[i]))
    return ks, km, adj, codes


def _nf4_values(v: np.ndarray):
    """v [G, Dh] -> (vscale [G] (LOGTAB values), codes [G, Dh]): per position, absmax / 127 rounded up
    to an 8-bit scale, the nearest level."""
    vs = LOGTAB[log8_code(np.abs(v).max(1) / F32(127))]
    inv = np.where(vs > 0, F32(1.0) / np.where(vs > 0, vs, F32(1.0)), F32(0.0)).astype(F32)
    y = (v * inv[:, None]).astype(F32)
    mid = ((VLEV[1:] + VLEV[:-1]) / 2).astype(F32)
    codes = (y[..., None] > mid).sum(-1).astype(np.int32)
    return vs, codes


def pack_block(k: np.ndarray, v: np.ndarray, bits: int) -> np.ndarray:
    """One block of one head: k, v [G, Dh] (f16 values as float32) -> block_bytes(Dh, bits) bytes."""
    k = np.asarray(k, F32)
    v = np.asarray(v, F32)
    dh = k.shape[1]
    o = offsets(dh, bits)
    out = np.zeros(block_bytes(dh, bits), np.uint8)
    if bits == 4:
        ks, km, adj, kc = _q4_keys(k)
        vs, vc = _nf4_values(v)
        out[o["kmin"]:o["kscale"]] = km.reshape(-1).astype(np.float16).view(np.uint8)
        out[o["kscale"]:o["kadj"]] = log8_code(ks)
        out[o["kadj"]:o["kcodes"]] = adj.reshape(-1)
        out[o["kcodes"]:o["vscale"]] = k_layout(kc, bits)
        out[o["vscale"]:o["vcodes"]] = log8_code(vs)
        out[o["vcodes"]:] = v_layout(vc, bits)
        return out
    qmax = (1 << bits) - 1
    ks, km, kc = _range_codes(k, k.min(0, keepdims=True), k.max(0, keepdims=True), qmax)
    vs, vm, vc = _range_codes(v, v.min(1, keepdims=True), v.max(1, keepdims=True), qmax)
    out[o["vmin"]:o["vcodes"]] = vm.reshape(-1).astype(np.float16).view(np.uint8)
    out[o["kscale"]:o["kmin"]] = ks.reshape(-1).astype(np.float16).view(np.uint8)
    out[o["kmin"]:o["kmin"] + 2 * dh] = km.reshape(-1).astype(np.float16).view(np.uint8)
    out[o["kcodes"]:o["vscale"]] = k_layout(kc, bits)
    out[o["vscale"]:o["vscale"] + 2 * G] = vs.reshape(-1).astype(np.float16).view(np.uint8)
    out[o["vcodes"]:] = v_layout(vc, bits)
    return out


def unpack_block(raw: np.ndarray, dh: int, bits: int) -> tuple:
    """-> (kscale [Dh], kmin [Dh], kcodes [G, Dh], vscale [G], vmin [G] (q4: None), vcodes [G, Dh],
    kadj [NSUB, Dh] (q8: None))."""
    o = offsets(dh, bits)
    raw = np.asarray(raw, np.uint8)
    h = lambda a, n: raw[o[a]:o[a] + 2 * n].view(np.float16).astype(F32)     # noqa: E731
    kc = k_unlayout(raw[o["kcodes"]:o["vscale"]], dh, bits)
    vc = v_unlayout(raw[o["vcodes"]:], dh, bits)
    if bits == 4:
        return (LOGTAB[raw[o["kscale"]:o["kadj"]]], h("kmin", dh), kc, LOGTAB[raw[o["vscale"]:o["vcodes"]]], None, vc,
                raw[o["kadj"]:o["kcodes"]].reshape(NSUB, dh))
    return h("kscale", dh), h("kmin", dh), kc, h("vscale", G), h("vmin", G), vc, None


def dequant_block(raw: np.ndarray, dh: int, bits: int) -> tuple:
    """-> (k [G, Dh], v [G, Dh]) float32, what the packed block stands for."""
    ks, km, kc, vs, vm, vc, adj = unpack_block(raw, dh, bits)
    if bits == 4:
        k = np.empty(kc.shape, F32)
        for i in range(NSUB):
            sc, mn = sub_ranges(ks, km, adj[i])
            k[i * SUB:(i + 1) * SUB] = kc[i * SUB:(i + 1) * SUB].astype(F32) * sc + mn
        return k, VLEV[vc].astype(F32) * vs[:, None]
    return kc.astype(F32) * ks + km, vc.astype(F32) * vs[:, None] + vm[:, None]


# ----------------------------------------------------------------------------- attention
class _State:
    def __init__(self, g: int, dh: int):
        self.m = np.full(g, -np.inf, F32)
        self.lanes = np.zeros((g, 16), F32)     # the sum l in 16 lanes, folded by ltree at the end
        self.acc = np.zeros((g, dh), F32)

    def probs(self, s: np.ndarray):
        """s [g, n] scores of one block, base 2 -> (alpha [g], p [g, n]); updates m and the lanes."""
        m_new = np.maximum(self.m, s.max(1))
        first = np.isneginf(self.m)
        alpha = np.where(first, F32(0.0), fexp2(np.maximum(np.where(first, F32(0.0), self.m - m_new), E2LO))).astype(F32)
        p = fexp2(np.maximum(s - m_new[:, None], E2LO))
        self.m = m_new
        self.lanes = (self.lanes * alpha[:, None] + lanes16(p)).astype(F32)
        return alpha, p


def _f16_block(st, q, kf, vf, scale):
    """kf, vf [n, Dh] float32 (f16 values) of positions in one block."""
    s = (sum16(q[:, None, :] * kf[None, :, :]) * scale).astype(F32)          # [g, n]
    alpha, p = st.probs(s)
    out = st.acc * alpha[:, None]
    for t in range(kf.shape[0]):                                             # position order
        out = out + p[:, t:t + 1] * vf[t][None, :]
    st.acc = out.astype(F32)


def _q8_query(q, sc, mn):
    """The query against keys of per-channel scale sc and min mn: (q8 [g, Dh] int, d [g], c [g]) with
    dot(q, k_t) ~ sum_c q8_c code_tc * d + c."""
    qs = q * sc[None, :]                                                     # [g, Dh]
    c = dotf(q, mn[None, :])                                                 # [g]
    a = np.abs(qs).max(1)
    safe = np.where(a > 0, a, F32(1.0))
    q8 = np.where(a[:, None] > 0, np.rint(qs * (F32(127.0) / safe)[:, None]), 0).astype(np.int32)
    d = np.where(a > 0, a / F32(127.0), F32(0.0)).astype(F32)
    return q8, d, c


def probs8(ps: np.ndarray, pm: int) -> tuple:
    """A packed block's probabilities times the values' scales, ps [g, G] >= 0 -> (p8 [g, G] int in
    0 .. pm, e [g]) with ps ~ p8 * e: against the row's max b, rounded to nearest (kv_round8_)."""
    b = ps.max(1)
    safe = np.where(b > 0, b, F32(1.0))
    p8 = np.where(b[:, None] > 0, np.rint(ps * (F32(pm) / safe)[:, None]), 0).astype(np.int32)
    e = np.where(b > 0, b / F32(pm), F32(0.0)).astype(F32)
    return p8, e


def _packed_block(st, q, raw, dh, bits, scale):
    ks, km, kc, vs, vm, vc, adj = unpack_block(raw, dh, bits)
    if bits == 4:                   # k = kmin + kscale / 16 * u, u = 16 a + (b + 1) code <= 255: one query
        q8, d, c = _q8_query(q, ks, km)          # against the block's scale, one constant
        u = np.empty(kc.shape, np.int32)
        for i in range(NSUB):
            u[i * SUB:(i + 1) * SUB] = (kc[i * SUB:(i + 1) * SUB] * ((adj[i] >> 4).astype(np.int32) + 1)[None, :]
                                        + 16 * (adj[i] & 15).astype(np.int32)[None, :])
        isum = q8 @ u.T                                                      # [g, G] exact
        s = ((isum.astype(F32) * (d * F32(0.0625)).astype(F32)[:, None] + c[:, None]) * scale).astype(F32)
    else:
        q8, d, c = _q8_query(q, ks, km)
        isum = q8 @ kc.T                                                     # [g, G] exact
        s = ((isum.astype(F32) * d[:, None] + c[:, None]) * scale).astype(F32)
    alpha, p = st.probs(s)
    p8, e = probs8((p * vs[None, :]).astype(F32), pmax_of(bits))
    if bits == 4:
        iv = p8 @ VLEV[vc]                                                   # [g, Dh] exact
        st.acc = (st.acc * alpha[:, None] + iv.astype(F32) * e[:, None]).astype(F32)
        return
    vsum = sum16(p * vm[None, :])                                            # [g]
    iv = p8 @ vc                                                             # [g, Dh] exact
    st.acc = (st.acc * alpha[:, None] + (iv.astype(F32) * e[:, None] + vsum[:, None])).astype(F32)


def attend_row(q: np.ndarray, kf: np.ndarray, vf: np.ndarray, packed, n: int, bits: int,
               window: int | None = None) -> np.ndarray:
    """One row's attention for one KV head's query heads.

    q [g, Dh] float32; kf, vf [>= n, Dh] the f16 keys/values of every position (float32 values; only
    those the row reads in f16 need be right); packed: callable b -> block bytes (or None: f16 only,
    as a windowed layer or an f16 cache); n keys (the row sits at position n - 1); window: the row
    reads positions n - window .. n - 1 only (f16 only)."""
    g, dh = q.shape
    scale = F32(F32(1.0 / np.sqrt(dh)) * LOG2E)     # scores in base 2
    st = _State(g, dh)
    lo = 0 if window is None else max(0, n - window)
    npk = n // G - RECENT                           # blocks 1 .. npk - 1 are read packed
    for b in range(lo // G, (n + G - 1) // G):
        i0, i1 = max(b * G, lo), min((b + 1) * G, n)
        if packed is not None and 1 <= b < npk:
            _packed_block(st, q, packed(b), dh, bits, scale)
        else:
            _f16_block(st, q, kf[i0:i1], vf[i0:i1], scale)
    out = (st.acc / ltree(st.lanes)[:, None]).astype(F32)
    return fwht(out) if packed is not None and rotates_values(bits) else out


def attention(q: np.ndarray, kf: np.ndarray, vf: np.ndarray, packed_blocks, pos0: int, bits: int,
              window: int | None = None) -> np.ndarray:
    """q [T, Hq, Dh] at positions pos0..; kf, vf [Hkv, S, Dh] f16 values; packed_blocks [Hkv, NB,
    block_bytes] uint8 or None -> out [T, Hq, Dh] float32."""
    t, hq, dh = q.shape
    hkv = kf.shape[0]
    g = hq // hkv
    out = np.empty((t, hq, dh), F32)
    kf = np.asarray(kf, F32)
    vf = np.asarray(vf, F32)
    for r in range(t):
        n = pos0 + r + 1
        for h in range(hkv):
            pk = None if packed_blocks is None else (lambda b, h=h: packed_blocks[h, b])
            out[r, h * g:(h + 1) * g] = attend_row(np.asarray(q[r, h * g:(h + 1) * g], F32), kf[h], vf[h], pk, n,
                                                   bits, window)
    return out
