"""Measure every quantization format on the real Qwen2.5-Coder-0.5B weights and write docs/formats.md.

    python benchmarks/formats.py [--model PATH] [--text PATH] [--out docs/formats.md] [--quick]

Sections: (a) bits/weight and RMSE per format and tensor role (rows subsampled); (g) group size vs
RMSE for q3p/q2c; (l) how Q3P_LEVELS was chosen; (b) q3p vs q3u on the FFN: weight RMSE and KL of the
next-token distribution; (c) q2c k-means vs scikit-learn KMeans; (d) quantize/dequantize MB/s,
numpy reference vs fast path. Runtime: about 3-5 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mixqrt.quant import formats, kmeans, layout  # noqa: E402
from mixqrt.quant import dequantize, quantize  # noqa: E402

F32 = np.float32
MODEL = Path.home() / ".cache" / "mixqrt-test-models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2-test.txt"
QFMTS = ["q2c", "q3p", "q3u", "q4", "q5g", "q6", "q8", "f16", "bf16"]
ROLES = ["token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "norms"]


def rmse(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)))


# ----------------------------------------------------------------------------- model access
class Model:
    def __init__(self, path: Path):
        import gguf
        self.r = gguf.GGUFReader(str(path))
        self.t = {t.name: t for t in self.r.tensors}

    def get(self, name: str) -> np.ndarray:
        import gguf
        t = self.t[name]
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=F32)

    def role_of(self, name: str) -> str | None:
        if name == "token_embd.weight":
            return "token_embd"
        if "norm" in name:
            return "norms"
        m = re.match(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$", name)
        return m.group(1) if m else None


def sample_roles(model: Model, rows: int, layers, rng) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {r: [] for r in ROLES}
    for name in model.t:
        role = model.role_of(name)
        if role is None or role == "norms" and "bias" in name:
            continue
        if role not in ("token_embd", "norms") and int(name.split(".")[1]) not in layers:
            continue
        w = model.get(name)
        if w.ndim == 2:
            w = w[np.sort(rng.choice(w.shape[0], min(rows * (4 if role == "token_embd" else 1), w.shape[0]),
                                     replace=False))]
        out[role].append(w)
    return out


# ----------------------------------------------------------------------------- (a) RMSE by role
def table_roles(samples, full_shapes: dict[str, set]) -> list[str]:
    norms = samples["norms"]
    lo, hi = formats.bind_range(norms)
    lines = ["| format | bpw (896-col rows) | " + " | ".join(ROLES) + " |", "|---" * (len(ROLES) + 2) + "|"]
    for fmt in QFMTS:
        lay = layout.PACKED.get(fmt)      # per-row bytes: the q5g 8-byte trailer is once per tensor
        bpw = (lay.row_bytes(896) if lay else layout.expected_nbytes(fmt, (1, 896))) * 8 / 896
        cells = []
        for role in ROLES:
            err, n = 0.0, 0
            for w in samples[role]:
                opts = {"lo": lo, "hi": hi} if fmt == "q5g" and role == "norms" else {}
                y = dequantize(quantize(w, fmt, **opts))
                err += float(np.sum((y.astype(np.float64) - w) ** 2))
                n += w.size
            cells.append(f"{np.sqrt(err / n):.2e}")
        label = "q5g (norms: bound range over all norms; others: own range)" if fmt == "q5g" else fmt
        lines.append(f"| {label} | {bpw:.3f} | " + " | ".join(cells) + " |")
    own = []
    for role in ROLES:
        err, n = 0.0, 0
        for w in samples[role]:
            y = dequantize(quantize(w, "q5g"))
            err += float(np.sum((y.astype(np.float64) - w) ** 2)); n += w.size
        own.append(f"{np.sqrt(err / n):.2e}")
    lines.append("| q5g, each tensor's own range | 5.000 | " + " | ".join(own) + " |")
    std = [f"{np.sqrt(np.mean(np.concatenate([w.ravel() for w in samples[r]]).astype(np.float64) ** 2)):.2e}"
           for r in ROLES]
    lines.append("| (rms of the weights) | | " + " | ".join(std) + " |")
    src = ["/".join(sorted(full_shapes.get(r, {"?"}))) for r in ROLES]
    lines.append("| (GGUF source type) | | " + " | ".join(src) + " |")
    return lines


# ----------------------------------------------------------------------------- (g) group size
def group_rmse(fmt: str, w: np.ndarray, G: int) -> float:
    X = w.reshape(-1, G)
    if fmt == "q2c":
        codes, d, m, lut, _, _ = kmeans.quantize_blocks(X, np.full(len(X), G))
        y = d.astype(F32)[:, None] * np.take_along_axis(lut, codes.astype(np.intp), 1).astype(F32) + m.astype(F32)[:, None]
    else:
        L = layout.Q3P_LEVELS.astype(F32) if fmt == "q3p" else np.arange(8, dtype=F32)
        d16, m16, t, _ = formats._ref_minmax(fmt, X[:, None, :], np.array([G]), float(L[-1]))
        if fmt == "q3p":
            q = (t[..., None] > (L[:-1] + L[1:]) * F32(0.5)).sum(-1)
        else:
            q = np.clip(np.rint(t), 0, 7).astype(int)
        y = (d16.astype(F32)[..., None] * L[q] + m16.astype(F32)[..., None])[:, 0]
    return rmse(y, X)


def table_groups(samples) -> list[str]:
    lines = ["| format | G | bpw | RMSE ffn (gate+up+down) | RMSE token_embd |", "|---|---|---|---|---|"]
    ffn = [w for r in ("ffn_gate", "ffn_up", "ffn_down") for w in samples[r]]
    emb = samples["token_embd"]
    for fmt, bits, hdr in (("q3p", 3, 32), ("q3u", 3, 32), ("q2c", 2, 64)):
        for G in (32, 64, 128):
            e_f = np.sqrt(np.mean([group_rmse(fmt, w[:, : w.shape[1] // 128 * 128], G) ** 2 for w in ffn]))
            e_e = np.sqrt(np.mean([group_rmse(fmt, w[:, : w.shape[1] // 128 * 128], G) ** 2 for w in emb]))
            lines.append(f"| {fmt} | {G} | {bits + hdr / G:.3f} | {e_f:.3e} | {e_e:.3e} |")
    return lines


# ----------------------------------------------------------------------------- (l) q3p levels
def table_levels(samples) -> list[str]:
    ffn = [w for r in ("ffn_gate", "ffn_up", "ffn_down") for w in samples[r]]
    u = []
    for w in ffn:
        X = w.reshape(-1, 64).astype(np.float64)
        mn, mx = X.min(1, keepdims=True), X.max(1, keepdims=True)
        u.append(((X - mn) / np.where(mx > mn, mx - mn, 1)).ravel())
    u = np.concatenate(u)
    c = np.linspace(0, 1, 8)
    for _ in range(100):                                 # Lloyd-Max with both endpoints pinned
        idx = np.searchsorted((c[:-1] + c[1:]) / 2, u)
        for j in range(1, 7):
            c[j] = u[idx == j].mean()
    chosen = layout.Q3P_LEVELS.copy()
    cands = {"article: fine centre, 2 coarse per tail": [0, 8, 13, 16, 19, 22, 27, 35],
             "uniform": [0, 9, 18, 27, 36, 45, 54, 63]}
    for T in (35, 63, 127):
        cands[f"Lloyd-Max, top {T}"] = list(np.round(c * T).astype(int))
    lines = [f"Lloyd-Max levels of the normalised group values (0..1): {np.round(c, 4).tolist()}", "",
             "| table | levels | RMSE ffn |", "|---|---|---|"]
    try:
        for name, tab in cands.items():
            layout.Q3P_LEVELS = np.array(tab, dtype=np.uint8)
            e = np.sqrt(np.mean([rmse(dequantize(quantize(w, "q3p")), w) ** 2 for w in ffn]))
            mark = " (chosen)" if np.array_equal(layout.Q3P_LEVELS, chosen) else ""
            lines.append(f"| {name}{mark} | {[int(v) for v in tab]} | {e:.4e} |")
    finally:
        layout.Q3P_LEVELS = chosen
    e = np.sqrt(np.mean([rmse(dequantize(quantize(w, "q3u")), w) ** 2 for w in ffn]))
    lines.append(f"| q3u (uniform 0..7, for reference) | {list(range(8))} | {e:.4e} |")
    return lines


# ----------------------------------------------------------------------------- (b) FFN KL
def tokens_for(model: Model, text: str, n: int) -> tuple[np.ndarray, str]:
    try:
        from mixqrt.io import open_source
        tok = open_source(str(MODEL)).tokenizer
        ids = tok.encode(text)[:n]
        if len(ids) == n:
            return np.array(ids), "mixqrt.tokenizer (from the GGUF)"
    except Exception:  # noqa: BLE001 - the tokenizer is another module; fall back to greedy
        pass
    vocab = {bytes(model.r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace"): j
             for j, i in enumerate(model.r.fields["tokenizer.ggml.tokens"].data)}
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + k); k += 1
    enc = dict(zip(bs, map(chr, cs)))
    s = "".join(enc[b] for b in text.encode("utf-8"))
    ids, i = [], 0
    while i < len(s) and len(ids) < n:
        for L in range(min(24, len(s) - i), 0, -1):
            if s[i:i + L] in vocab:
                ids.append(vocab[s[i:i + L]]); i += L
                break
        else:
            i += 1
    return np.array(ids), "greedy longest match over the GGUF token list"


def rmsnorm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def logsoftmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def table_kl(model: Model, text_path: Path, ntok: int, layers) -> tuple[list[str], str, dict]:
    text = text_path.read_text(encoding="utf-8")[:20000]
    ids, how = tokens_for(model, text, ntok)
    emb = model.get("token_embd.weight")
    head = model.get("output.weight") if "output.weight" in model.t else emb
    onorm = model.get("output_norm.weight")
    x = emb[ids].astype(np.float64)
    res = {}
    lines = ["| layer | format | RMSE gate/up/down | KL(f32 ‖ q) mean | KL p99 | top-1 agree |", "|---|---|---|---|---|---|"]
    for L in layers:
        wn = model.get(f"blk.{L}.ffn_norm.weight")
        W = {r: model.get(f"blk.{L}.{r}.weight") for r in ("ffn_gate", "ffn_up", "ffn_down")}

        def ffn(Wd):
            a = rmsnorm(x, wn)
            g, u = a @ Wd["ffn_gate"].T.astype(np.float64), a @ Wd["ffn_up"].T.astype(np.float64)
            h = x + (g / (1 + np.exp(-g)) * u) @ Wd["ffn_down"].T.astype(np.float64)
            return logsoftmax((rmsnorm(h, onorm).astype(F32) @ head.T).astype(np.float64))
        base = ffn(W)
        pb = np.exp(base)
        for fmt in ("q3u", "q3p", "q4", "q2c"):
            Wq = {r: dequantize(quantize(w, fmt)) for r, w in W.items()}
            lq = ffn(Wq)
            kl = np.sum(pb * (base - lq), axis=-1)
            e = "/".join(f"{rmse(Wq[r], W[r]):.2e}" for r in W)
            agree = float(np.mean(base.argmax(-1) == lq.argmax(-1)))
            res[(L, fmt)] = float(kl.mean())
            lines.append(f"| {L} | {fmt} | {e} | {kl.mean():.3e} | {np.percentile(kl, 99):.3e} | {agree:.3f} |")
    return lines, f"{len(ids)} tokens of {text_path.name}, tokenized by {how}", res


# ----------------------------------------------------------------------------- (c) k-means speed
def table_kmeans(samples, ngroups: int) -> list[str]:
    X = np.concatenate([w.reshape(-1, 128) for w in samples["token_embd"]])[:ngroups]
    t = time.perf_counter(); qt = quantize(X, "q2c"); t_fast = time.perf_counter() - t
    t = time.perf_counter(); quantize(X, "q2c", impl="ref"); t_ref = time.perf_counter() - t
    sse_m = np.sum((dequantize(qt).astype(np.float64) - X) ** 2, axis=1)
    lines = ["| implementation (single thread) | groups | time | per group | SSE |", "|---|---|---|---|---|",
             f"| mixqrt q2c fast path (C, sort + Lloyd + pack) | {len(X)} | {t_fast * 1e3:.1f} ms | "
             f"{t_fast / len(X) * 1e6:.2f} µs | 1.000 |",
             f"| mixqrt q2c numpy reference (vectorised over groups) | {len(X)} | {t_ref * 1e3:.1f} ms | "
             f"{t_ref / len(X) * 1e6:.2f} µs | 1.000 |"]
    try:
        from sklearn.cluster import KMeans
    except ImportError:
        lines.append("| scikit-learn KMeans | - | not installed | | |")
        return lines
    n_sk = min(len(X), 300)
    sse_s = np.zeros(n_sk)
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1):   # one core, like the C path; 128 points gain nothing from threads
        t = time.perf_counter()
        for i in range(n_sk):
            km = KMeans(n_clusters=4, init="k-means++", n_init=1, random_state=0).fit(
                X[i].reshape(-1, 1).astype(np.float64))
            sse_s[i] = km.inertia_
        t_sk = time.perf_counter() - t
    ratio = float(np.sum(sse_m[:n_sk]) / np.sum(sse_s))
    lines.append(f"| scikit-learn {__import__('sklearn').__version__} KMeans(4, k-means++, n_init=1), one fit per group "
                 f"| {n_sk} | {t_sk * 1e3:.1f} ms | {t_sk / n_sk * 1e6:.1f} µs | "
                 f"mixqrt SSE / sklearn SSE = {ratio:.3f} |")
    lines.append("")
    lines.append(f"Speed-up of the fast path per group: **{(t_sk / n_sk) / (t_fast / len(X)):.0f}x** over "
                 f"scikit-learn; the numpy reference alone is {(t_sk / n_sk) / (t_ref / len(X)):.0f}x.")
    return lines


# ----------------------------------------------------------------------------- (d) throughput
def table_speed(w: np.ndarray) -> list[str]:
    mb = w.nbytes / 1e6
    lines = ["| format | quantize ref MB/s | quantize fast MB/s | dequantize ref MB/s | dequantize fast MB/s | "
             "embedding rows (64) µs |", "|---|---|---|---|---|---|"]
    ids = np.random.default_rng(0).integers(0, w.shape[0], 64)
    for fmt in QFMTS:
        def best(fn, reps=3):
            ts = []
            for _ in range(reps):
                t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
            return min(ts)
        qt = quantize(w, fmt)
        qr = best(lambda: quantize(w, fmt, impl="ref"), 1 if fmt == "q2c" else 2)
        qf = best(lambda: quantize(w, fmt))
        dr = best(lambda: dequantize(qt, impl="ref"))
        df = best(lambda: dequantize(qt))
        er = best(lambda: formats.dequantize_rows(qt, ids), 5)
        lines.append(f"| {fmt} | {mb / qr:.0f} | {mb / qf:.0f} | {mb / dr:.0f} | {mb / df:.0f} | {er * 1e6:.0f} |")
    return lines


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "formats.md")
    ap.add_argument("--quick", action="store_true", help="fewer rows and tokens (smoke test)")
    args = ap.parse_args(argv)
    rows, ntok = (16, 16) if args.quick else (128, 128)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    model = Model(args.model)
    nlayers = 1 + max(int(n.split(".")[1]) for n in model.t if n.startswith("blk."))
    layers = sorted({0, nlayers // 3, 2 * nlayers // 3, nlayers - 1})
    samples = sample_roles(model, rows, layers, rng)
    full: dict[str, set] = {}
    for n, t in model.t.items():
        role = model.role_of(n)
        if role and not n.endswith("bias"):
            full.setdefault(role, set()).add(t.tensor_type.name)
    sec = {}
    sec["a"] = table_roles(samples, full); print("\n".join(sec["a"]), flush=True)
    sec["g"] = table_groups(samples); print("\n".join(sec["g"]), flush=True)
    sec["l"] = table_levels(samples); print("\n".join(sec["l"]), flush=True)
    sec["b"], tokdesc, kl = table_kl(model, args.text, ntok, [0, nlayers // 2]); print("\n".join(sec["b"]), flush=True)
    sec["c"] = table_kmeans(samples, 4000 if not args.quick else 200); print("\n".join(sec["c"]), flush=True)
    ffn = model.get("blk.0.ffn_gate.weight")[: 2048 if not args.quick else 64]
    sec["d"] = table_speed(ffn); print("\n".join(sec["d"]), flush=True)
    elapsed = time.perf_counter() - t0
    write_doc(args, sec, tokdesc, kl, layers, rows, ntok, elapsed, ffn.shape)
    print(f"wrote {args.out} in {elapsed:.0f} s")
    return 0


def write_doc(args, sec, tokdesc, kl, layers, rows, ntok, elapsed, speed_shape):
    from mixqrt._kernels import _cpu
    import mixqrt.isa
    l0 = [k for k in kl if k[1] == "q3p"]
    ratios = [1 - kl[(L, "q3p")] / kl[(L, "q3u")] for (L, _) in l0]
    per = ", ".join(f"layer {L}: {100 * r:.1f}% lower" for (L, _), r in zip(l0, ratios))
    if max(ratios) >= 0.35:
        verdict = f"**roughly holds** here ({per})"
    elif min(ratios) > 0:
        verdict = (f"**does not hold** here: q3p's KL is lower than q3u's, but only by {per}, "
                   f"not 41%")
    else:
        verdict = f"**does not hold** here ({per}; negative means q3p is worse)"
    doc = TEMPLATE.format(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{_cpu.brand() or platform.processor()} ({os.cpu_count()} logical CPUs visible, ISA tier "
                f"{mixqrt.isa.current()}), Python {platform.python_version()}, numpy {np.__version__}; "
                f"load average {os.getloadavg()[0]:.1f} at the end (the 2 cores are shared with other work, "
                f"so timings vary run to run, sklearn's by up to ~5x)",
        command="python benchmarks/formats.py" + (" --quick" if args.quick else ""),
        elapsed=f"{elapsed:.0f}", rows=rows, layers=layers, ntok=ntok, tokdesc=tokdesc,
        levels=layout.Q3P_LEVELS.tolist(), verdict=verdict, speed_shape=f"{speed_shape[0]}x{speed_shape[1]}",
        a="\n".join(sec["a"]), g="\n".join(sec["g"]), l="\n".join(sec["l"]), b="\n".join(sec["b"]),
        c="\n".join(sec["c"]), d="\n".join(sec["d"]))
    args.out.write_text(doc, encoding="utf-8")


TEMPLATE = """# Quantization formats: measurements

Generated by `{command}` on {date} ({elapsed} s). Machine: {machine}.
The tables are regenerated by that command; the prose around them was written against this run.

Weights: Qwen2.5-Coder-0.5B-Instruct from its Q4_K_M GGUF, dequantized to float32. That "f32" already
carries the GGUF's own quantization error, and RMSE below is measured against it: where the GGUF type is
Q5_0/Q8_0 (symmetric 32-blocks), q6/q8 can reproduce it exactly, so their zero errors say nothing about
true bf16 weights. Rows are subsampled: {rows} random rows per matrix ({rows}x4 for token_embd) from
layers {layers}; every norm vector. Formats and byte layouts: mixqrt/quant/layout.py; rounding rules:
mixqrt/quant/formats.py and kmeans.py.

## The formats in one screen

API: `mixqrt.quant.quantize(w, fmt, impl="fast"|"ref", lo=, hi=) -> QTensor`, `dequantize(qt)`,
`dequantize_rows(qt, ids)` (embedding lookup, reads only those rows), `bind_range(arrays)` (q5g),
`FORMATS[name]` (bits, group_size, block_bytes, kind, quantize, dequantize, layout).

| format | per group | codes | notes |
|---|---|---|---|
| q8 | d = amax/127 (fp16, toward zero) | -127..127 | symmetric |
| q6 | d = x_ext / -32 (fp16, toward zero; may be negative) | q - 32 in -32..31 | sign trick: the largest-magnitude element takes level -32, so all 64 levels are used; elements beyond +31.5 d on the other side clip (error up to one step) |
| q4, q3u | m = fp16(min), d = (max - m)/(2^b - 1) toward zero | 0..2^b-1 | asymmetric min/max |
| q3p | as q3u with top = Q3P_LEVELS[7] | nearest of Q3P_LEVELS | table {levels}, section (l) |
| q2c | m = fp16(c0), d = (c3 - m)/255, lut = rint((c - m)/d) | nearest of 4 codebook levels | deterministic 1-D k-means; falls back to the uniform codebook (0, 85, 170, 255) when that has lower SSE |
| q5g | one (lo, hi) float32 per tensor, from bind_range | 0..31 | "dynamic range binding" |

Scales are rounded toward zero (and nudged one fp16 step up when that reproduces the block maximum
exactly), which makes quantize(dequantize(q)) a fixed point. The C fast path is bit-exact with the
numpy reference on every ISA tier (tests/test_quant.py).

## (a) RMSE by tensor role

bpw counts every scale, offset and codebook (rows of 896; q5g's 8-byte (lo, hi) trailer is per tensor).

{a}

Reading it: q3p beats q3u at equal size on every matrix role; q4 roughly halves q3's error; q2c costs
about 1.8x q3p's error for 1 bit less. The norms column is the article's "dynamic range binding" (docs/design.md): one
(lo, hi) over every RMSNorm vector of the model makes q5g's step (hi - lo)/31 as coarse as the widest
vector needs, so on norms it is worse than q5g per tensor and than per-group q4 at the same 5.0 bpw.
Norm vectors are 0.01% of the weights: keeping them f32/bf16 costs nothing measurable, and that is what
we recommend to the recipe; q5g with a bound range stays available for the "2356" recipe as specified.

## (g) Group size: RMSE vs bits per weight

{g}

Going from G=64 to G=32 buys q3p about 12% RMSE for +0.5 bpw, a poor trade next to q4 (+1.5 bpw,
~2.5x lower error); G=128 saves 0.25 bpw for ~11% more error, so G=64 is the knee for q3p/q3u. For q2c
the 8-byte header (d, m, lut) weighs more: G=64 costs +0.5 bpw (3.0 bpw, q3p's territory, where q3p is
40% better) for only ~5% lower error, so q2c keeps G=128 (2.5 bpw). These are the layout's group sizes.

## (l) How Q3P_LEVELS was chosen

Every FFN group of 64 is normalised to u = (w - min) / (max - min) in [0, 1] (both ends are always
hit); a Lloyd-Max quantizer with its ends pinned to 0 and 1 gives the 6 inner levels; scaled to an
integer top and rounded they become the u8 table. Measured RMSE on the same FFN rows:

{l}

The article's table (4 fine centre levels, 2 coarse per tail, top 35) is *worse than uniform*: its
centre steps (3) are too fine and its outer steps (8) too coarse for group-normalised weights. The
measured optimum is only mildly non-uniform (outer gaps ~1.5x the inner). Top 63 is chosen
({levels}): within 0.4% of top 127, and 63 x 127 x 2 stays far below int16 saturation for kernels
that pair u8 levels with s8 activations in vpmaddubsw.

## (b) q3p vs q3u on the FFN: weight RMSE and output KL

Setup: {tokdesc}. For a layer L, x = embedding rows, a = rmsnorm(x) * ffn_norm, h = x +
down(silu(gate a) * up a); logits = output_norm(h) @ output^T (tied embedding); KL(p_f32 || p_q) of the
softmax over the full vocabulary, per token, with all three FFN matrices in the given format. This
isolates one FFN block; it is not the end-to-end model KL (that is mixqrt ppl --kl-base).

{b}

Verdict on the article's "41% lower FFN output KL" for asymmetric piecewise 3-bit: it {verdict}.
The direction is right with the measured level table (q3p is better than q3u at the same 3.5 bpw in
weight RMSE on every role, by 3-7%, and in this KL), the size is not. With the article's own level table q3p
is no better than q3u even in weight RMSE (section l). Caveats: one FFN block as a proxy, a 0.5B model
(the article used Qwen2-7B), {ntok} tokens.

## (c) q2c k-means vs scikit-learn

Same data (groups of 128 values from token_embd rows), same k = 4, k-means++ init, one run per group.

{c}

The article claims 3.7x over scikit-learn from AVX-512 distance computations. Ours is much larger and
for a different reason: in 1-D, k-means is a sort plus prefix sums (cluster means are differences of
prefix sums, assignments are 3 binary searches), so a Lloyd iteration is O(log n) after the sort,
while scikit-learn pays its Python/threadpool setup per fit. A fair reading is "per-group k-means
costs microseconds, not milliseconds", not a SIMD win. SSE: scikit-learn keeps float64 centroids,
mixqrt rounds them to fp16 d/m and a u8 lut and derandomises the init; still its total SSE is no
worse (the ratio in the last row; below 1 means mixqrt's is lower: a single sklearn run with random
k-means++ seeding lands in worse local optima on some groups than the median-first, D^2-quantile init).

## (d) Throughput ({speed_shape} float32 FFN slice; MB/s of float32 input or output)

{d}

The fast path is portable C; the only ISA-specific code so far is the f16 format's conversion (F16C,
avx2 and avx512 tiers). Every tier is checked bit-exact against the numpy reference in the tests. Where
"fast" is not much faster than "ref" (q8, f16 on the generic tier) numpy's own SIMD loops are doing
well; AVX2 unpack/quantize loops are the next step if loading time ever matters. Dequantization here is only for tests, loading and
embedding rows: matmul kernels read the packed bytes directly. "embedding rows" is
dequantize_rows for 64 random rows, which touches only those rows' bytes.
"""


if __name__ == "__main__":
    sys.exit(main())
