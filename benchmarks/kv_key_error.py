"""Query-weighted key error of q4 key layouts, and the value error of scale encodings, on the real keys
and values of one 2k WikiText-2 window (docs/long-context.md, "Third round"). The score error of a key
is sum_c q_c dk_c; with errors independent per channel its variance is sum_c E[q_c^2] dk_c^2, so each
channel's squared key error is weighted by the mean squared query of that channel (its query heads,
every row of the window), summed over every layer and KV head. numpy, not timed.

    python benchmarks/kv_key_error.py [MODEL.mxq]
"""
import sys
from pathlib import Path

import numpy as np

import mixqrt
from mixqrt.kv import ref

F32 = np.float32
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "wikitext-2-test.txt"


def keys_variant(x, sub_a, sub_b):
    """Per channel over 64 positions: f16 step and min of the block; the min moves up a (0..15 steps) per
    sub_a positions, the step becomes (b + 1) / 16 per sub_b, each searched for the least squared error."""
    out = np.empty_like(x)
    for b0 in range(0, 64 * (len(x) // 64), 64):
        k = x[b0:b0 + 64]
        ks = ref.f16r((k.max(0) - k.min(0)) / F32(15))
        km = ref.f16r(k.min(0))
        pos = ks > 0
        div = np.where(pos, ks, F32(1))
        for sb in range(0, 64, sub_b):
            xb = k[sb:sb + sub_b]
            best = brec = None
            for db in range(16):
                tot = np.zeros(x.shape[1])
                rec = np.empty_like(xb)
                for sa in range(0, sub_b, sub_a):
                    xa = xb[sa:sa + sub_a]
                    a0 = np.where(pos, np.clip(np.floor((xa.min(0) - km) / div), 0, 15), 0)
                    be = bq = None
                    for da in range(3):
                        sc, mn = ks * F32(db + 1) / 16, km + ks * np.minimum(a0 + da, 15)
                        inv = np.where(sc > 0, 1 / np.where(sc > 0, sc, 1), 0)
                        q = np.clip(np.rint((xa - mn) * inv), 0, 15) * sc + mn
                        e = ((q - xa) ** 2).sum(0)
                        if be is None:
                            be, bq = e, q
                        else:
                            t = e < be
                            be, bq = np.where(t, e, be), np.where(t, q, bq)
                    tot += be
                    rec[sa:sa + sub_a] = bq
                if best is None:
                    best, brec = tot, rec.copy()
                else:
                    t = tot < best
                    best, brec = np.where(t, tot, best), np.where(t, rec, brec)
            out[b0 + sb:b0 + sb + sub_b] = brec
    return out


def values_variant(v, steps_per_octave):
    """NF4 values per position after the rotation; the scale f16 (0) or an 8-bit code rounded up."""
    v = ref.fwht(v)
    a = np.abs(v).max(1)
    if not steps_per_octave:
        vs = ref.f16r(a / 127)
    else:
        e = np.ceil(np.log2(np.maximum(a / 127, 1e-30)) * steps_per_octave)
        vs = (2.0 ** (e / steps_per_octave)).astype(F32)
    y = v / np.where(vs > 0, vs, 1)[:, None]
    codes = (y[..., None] > (ref.VLEV[1:] + ref.VLEV[:-1]) / 2).sum(-1)
    return ref.VLEV[codes] * vs[:, None], v


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from long_context import default_mxq
    m = mixqrt.load(sys.argv[1] if len(sys.argv) > 1 else default_mxq())
    net = m.model
    ids = np.asarray(m.tokenizer.encode(TEXT.read_text()[:20000]), np.int64)[:2048]
    cache = net.make_cache(2048, kv_type="f32")
    qe = {}
    orig = type(net).attend

    def attend(self, li, q, c, pos0, out=None):
        qe.setdefault(li, []).append((q.astype(np.float64) ** 2).sum(0))
        return orig(self, li, q, c, pos0) if out is None else orig(self, li, q, c, pos0, out)

    type(net).attend = attend
    net(ids, cache, 0, last_only=True)
    type(net).attend = orig
    keys = {"min and step per 32 (the second round)": (32, 32), "min per 16, step per 32": (16, 32),
            "min and step per 16": (16, 16), "min per 8, step per 32": (8, 32)}
    ke, ve = dict.fromkeys(keys, 0.0), {0: 0.0, 16: 0.0, 12: 0.0, 8: 0.0}
    for li in range(len(cache.keys)):
        q2 = np.sum(qe[li], 0)
        hkv = cache.keys[li].shape[0]
        g = q2.shape[0] // hkv
        for h in range(hkv):
            w = q2[h * g:(h + 1) * g].sum(0)
            x = cache.keys[li][h, 64:2048].astype(np.float16).astype(F32)
            for name, (sa, sb) in keys.items():
                ke[name] += (((keys_variant(x, sa, sb) - x) ** 2).sum(0) * w).sum()
            v = cache.values[li][h, 64:2048].astype(np.float16).astype(F32)
            for spo in ve:
                qv, vr = values_variant(v, spo)
                ve[spo] += ((qv - vr) ** 2).sum()
    base = ke["min and step per 32 (the second round)"]
    for name, e in ke.items():
        print(f"keys, {name}: {e / base:.3f}")
    for spo, e in ve.items():
        print(f"value scale {'f16' if not spo else f'8 bits, steps of 2^(1/{spo})'}: {e / ve[0]:.3f}")


if __name__ == "__main__":
    main()
