"""KV-format quality probe (docs/long-context.md, "How the format was chosen"): the real model with K
and V quantized and dequantized in numpy as they are written, attention in numpy with the positions a
packed cache reads exactly (block 0 and the blocks from the one R - 1 positions back) taken from the
f32 rows; KL of the next-token distributions against f32 K/V on WikiText-2 windows (the second half
of each scored, llama-perplexity's method).

    NWIN=3 python benchmarks/kv_format_probe.py MODEL.mxq 2048 65 c4g64/a4g64,K4s32/rn4 64

argv: model, window, R, formats (KEYS/VALUES specs), sink (positions always exact). A spec:
[r]{s|a}BITSgGROUP per position (r: Hadamard-rotated first; s symmetric, a asymmetric), cBITSgGROUP
per channel over GROUP positions, KBITSs{SUB}[bSB] per channel over 64 positions narrowed per SUB
(the q4 keys), [r]n4 NF4 per position, V4 asymmetric with 8-bit scale and min, f32 unquantized.
Not timed; the evaluation text only, never tuned on.
"""
import sys, time
from pathlib import Path

import numpy as np
import mixqrt
from mixqrt.models.kv_cache import KVCache



def hadamard(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def q_sym(x, bits, g):
    s = x.reshape(*x.shape[:-1], -1, g)
    qmax = 2 ** (bits - 1) - 1
    d = np.abs(s).max(-1, keepdims=True) / qmax
    d = d.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.clip(np.round(s * inv), -qmax - 1, qmax)
    return (q * d).reshape(x.shape)


def q_asym(x, bits, g, axis=-1):
    x = np.moveaxis(x, axis, -1)
    s = x.reshape(*x.shape[:-1], -1, g)
    lo, hi = s.min(-1, keepdims=True), s.max(-1, keepdims=True)
    qmax = 2 ** bits - 1
    d = ((hi - lo) / qmax).astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.clip(np.round((s - lo) * inv), 0, qmax)
    return np.moveaxis((q * d + lo).reshape(x.shape), -1, axis)


def q_asym_clip(x, bits, g, axis=-1, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75)):
    x = np.moveaxis(x, axis, -1)
    s = x.reshape(*x.shape[:-1], -1, g)
    lo0, hi0 = s.min(-1, keepdims=True), s.max(-1, keepdims=True)
    qmax = 2 ** bits - 1
    best, berr = None, None
    for r in ratios:
        c, h = (hi0 + lo0) / 2, (hi0 - lo0) / 2 * r
        lo, hi = c - h, c + h
        d = ((hi - lo) / qmax).astype(np.float16).astype(np.float32)
        lo = lo.astype(np.float16).astype(np.float32)
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        q = np.clip(np.round((s - lo) * inv), 0, qmax) * d + lo
        err = ((q - s) ** 2).sum(-1, keepdims=True)
        if best is None:
            best, berr = q, err
        else:
            m = err < berr
            best = np.where(m, q, best); berr = np.where(m, err, berr)
    return np.moveaxis(best.reshape(x.shape), -1, axis)


class FakeKV(KVCache):
    fmt = "f32"

    def write(self, layer, k, v, pos0):
        k = np.asarray(k, np.float32); v = np.asarray(v, np.float32)
        dh = k.shape[-1]
        f = self.fmt
        if f == "f32":
            pass
        elif f == "f16":
            k = k.astype(np.float16).astype(np.float32); v = v.astype(np.float16).astype(np.float32)
        else:
            kf, vf = f.split("/")
            k = self._q(k, kf, dh); v = self._q(v, vf, dh)
        super().write(layer, k, v, pos0)

    def _q(self, x, spec, dh):
        # spec: [r]{s|a}BITS g GROUP   e.g. "rs8g32", "a4g64", "ra4g64"
        rot = spec.startswith("r")
        if rot:
            spec = spec[1:]
            H = hadamard(dh)
            x = x @ H
        kind, rest = spec[0], spec[1:]
        if kind == "f":
            return x
        bits, g = rest.lstrip("a").split("g")
        bits, g = int(bits), int(g)
        if kind == "k":      # per channel, range clipped by MSE search
            t = x.shape[0] // g * g
            if t:
                x = x.copy(); x[:t] = q_asym_clip(x[:t], bits, g, axis=0)
            return x
        if kind == "m":      # per position, range clipped by MSE search
            return q_asym_clip(x, bits, g)
        if kind == "c":      # per channel over groups of g tokens (KIVI keys); tail rows raw
            t = x.shape[0] // g * g
            if t:
                x = x.copy(); x[:t] = q_asym(x[:t], bits, g, axis=0)
        else:
            x = q_sym(x, bits, g) if kind == "s" else q_asym(x, bits, g)
        if rot:
            x = x @ H.T
        return x.astype(np.float32)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))




def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def q_kquant_keys(x, bits=4, sub=32, blk=64, sbits=4):
    """keys [T, Dh] per channel over blk positions: f16 kscale, kmin of the whole block (as c4g64); each
    sub-block of `sub` positions narrows it: min_i = kmin + kscale * a_i (a_i 0..15, rounded down),
    scale_i = kscale * b_i / 16 (b_i 1..16, rounded up). 0.75 bit of scales per key at sub=32."""
    t = x.shape[0] // blk * blk
    out = x.copy()
    if not t:
        return out
    qmax = 2 ** bits - 1
    s = x[:t].reshape(t // blk, blk // sub, sub, x.shape[1])          # [B, S, sub, C]
    lo, hi = s.min(2), s.max(2)                                         # [B, S, C]
    kmin = f16(lo.min(1, keepdims=True))
    ksc = f16((hi.max(1, keepdims=True) - kmin) / qmax)
    ok = ksc > 0
    a = np.where(ok, np.floor((lo - kmin) / np.where(ok, ksc, 1)), 0).clip(0, 15)
    mq = kmin + ksc * a
    b = np.where(ok, np.ceil(16 * (hi - mq) / (qmax * np.where(ok, ksc, 1)) - 1e-6), 16).clip(1, 16)
    sc = ksc * b / 16
    inv = np.where(sc > 0, 1 / np.where(sc > 0, sc, 1), 0)
    q = np.clip(np.rint((s - mq[:, :, None]) * inv[:, :, None]), 0, qmax)
    out[:t] = (q * sc[:, :, None] + mq[:, :, None]).reshape(t, x.shape[1])
    return out


def q_vals8(x, bits=4, blk=64):
    """values [T, Dh] per position asym, the scale and min in 8 bits against per-block f16 supers."""
    t = x.shape[0] // blk * blk
    out = q_asym(x, bits, x.shape[1])
    if not t:
        return out
    qmax = 2 ** bits - 1
    s = x[:t].reshape(t // blk, blk, x.shape[1])
    lo, hi = s.min(2, keepdims=True), s.max(2, keepdims=True)            # [B, blk, 1]
    m0 = f16(lo.min(1, keepdims=True)); m1 = lo.max(1, keepdims=True)
    mstep = f16((m1 - m0) / 255)
    mi = np.where(mstep > 0, np.floor((lo - m0) / np.where(mstep > 0, mstep, 1)), 0).clip(0, 255)
    mq = m0 + mi * mstep
    rng = (hi - mq) / qmax
    smx = f16(rng.max(1, keepdims=True) / 255)
    si = np.where(smx > 0, np.ceil(rng / np.where(smx > 0, smx, 1) - 1e-6), 0).clip(0, 255)
    sc = si * smx
    inv = np.where(sc > 0, 1 / np.where(sc > 0, sc, 1), 0)
    q = np.clip(np.rint((s - mq) * inv), 0, qmax)
    out[:t] = (q * sc + mq).reshape(t, x.shape[1])
    return out


_orig_q = FakeKV._q


def _q2(self, x, spec, dh):
    if x.ndim == 3 and (spec.startswith("K") or spec.startswith("V")):
        return np.stack([_q2(self, x[:, h], spec, dh) for h in range(x.shape[1])], 1)
    if spec.startswith("K"):          # K4s32: K-quant keys, sub-block 32 (spec: K{bits}s{sub}[b{sbits}])
        body = spec[1:]
        sb = 4
        if "b" in body:
            body, sb = body.split("b"); sb = int(sb)
        bits, sub = body.split("s")
        return q_kquant_keys(np.asarray(x, np.float32), int(bits), int(sub), 64, sb).astype(np.float32)
    if spec.startswith("V"):          # V4: values, 8-bit scale/min
        return q_vals8(np.asarray(x, np.float32), int(spec[1:])).astype(np.float32)
    return _orig_q(self, x, spec, dh)


FakeKV._q = _q2


NF4 = np.array([-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127], np.float32)


def q_nf4(x, levels=NF4):
    """per position (last axis) absmax-scaled to +-127, nearest of 16 int8 levels; f16 scale."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).max(-1, keepdims=True)
    sc = f16(a / 127)
    inv = np.where(sc > 0, 1 / np.where(sc > 0, sc, 1), 0)
    y = x * inv
    mid = (levels[1:] + levels[:-1]) / 2
    idx = np.searchsorted(mid, y)
    return levels[idx] * sc


_orig_q2 = FakeKV._q


def _q3(self, x, spec, dh):
    rot = spec.startswith("r")
    body = spec[1:] if rot else spec
    if body == "n4":
        if rot:
            H = hadamard(dh)
            return (q_nf4(x @ H) @ H.T).astype(np.float32)
        return q_nf4(x).astype(np.float32)
    return _orig_q2(self, x, spec, dh)


FakeKV._q = _q3

MXQ, CTX, R, FMTS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
import os; NWIN = int(os.environ.get("NWIN", "1"))
SINK = int(sys.argv[5]) if len(sys.argv) > 5 else 0

class ResKV(FakeKV):
    G = 64
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.kq = [np.zeros_like(x) for x in self.keys]; self.vq = [np.zeros_like(x) for x in self.values]
    def write(self, layer, k, v, pos0):
        from mixqrt.models.kv_cache import KVCache
        KVCache.write(self, layer, k, v, pos0)
        kf, vf = self.fmt.split("/")
        t = k.shape[0]
        self.kq[layer][:, pos0:pos0+t] = self._q(np.asarray(k, np.float32), kf, k.shape[-1]).transpose(1, 0, 2)
        self.vq[layer][:, pos0:pos0+t] = self._q(np.asarray(v, np.float32), vf, v.shape[-1]).transpose(1, 0, 2)

def attend(self, li, q, cache, pos0, out=None):
    t, hq, dh = q.shape
    hkv = cache.num_kv_heads; g = hq // hkv
    n = pos0 + t
    o = np.empty_like(q)
    p = pos0 + np.arange(t)
    ki = np.arange(n)
    G = ResKV.G
    exact = ki[None, :] >= ((p[:, None] - R + 1) // G) * G          # [t, n]
    exact = exact | (ki[None, :] < SINK)
    causal = ki[None, :] <= p[:, None]
    for h in range(hkv):
        kr, vr = cache.keys[li][h, :n], cache.values[li][h, :n]
        kq, vq = cache.kq[li][h, :n], cache.vq[li][h, :n]
        qh = q[:, h*g:(h+1)*g].transpose(1, 0, 2)                         # [g, t, dh]
        s = np.where(exact, qh @ kr.T, qh @ kq.T) / np.sqrt(dh)
        s = np.where(causal, s, -np.inf)
        s -= s.max(-1, keepdims=True); np.exp(s, out=s); s /= s.sum(-1, keepdims=True)
        oh = (s * exact) @ vr + (s * ~exact) @ vq
        o[:, h*g:(h+1)*g] = oh.transpose(1, 0, 2)
    return o

m = mixqrt.load(MXQ); net = m.model if hasattr(m, "model") else m
type(net).attend = attend
import mixqrt.ops
mixqrt.ops.FUSED_DECODE = False
ids = np.asarray(m.tokenizer.encode(open(Path(__file__).resolve().parent.parent / "tests" / "data" / "wikitext-2-test.txt").read()[:CTX*6*NWIN+100000]), np.int64)
a = net.args
ALLKL = {}
for w in range(NWIN):
    win = ids[w*CTX:(w+1)*CTX]; half = CTX//2; base = None
    for f in ["f32/f32"] + FMTS:
        ResKV.fmt = f
        c = ResKV(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, CTX)
        t0 = time.time()
        lp = log_softmax(net(win, c, 0, last_only=False, chunk_size=512)[half:-1].astype(np.float64))
        if base is None:
            base = lp; continue
        kl = (np.exp(base)*(base-lp)).sum(-1)
        ALLKL.setdefault(f, []).append(kl.mean())
        nll = -lp[np.arange(len(lp)), win[half+1:]].mean()
        print(f"win {w} R={R} {f:16s} KL {kl.mean():.6f} p99 {np.quantile(kl,.99):.5f} ppl {np.exp(nll):.4f} top1 {(base.argmax(-1)==lp.argmax(-1)).mean():.4f} ({time.time()-t0:.0f}s)", flush=True)

for f, v in ALLKL.items():
    print(f'MEAN R={R} {f:16s} KL {np.mean(v):.6f} over {len(v)} windows', flush=True)
