"""Measure every quantization format on the real Qwen2.5-Coder-0.5B weights; update docs/quant-formats.md's tables.

    python benchmarks/formats.py [--model PATH] [--text PATH] [--out docs/quant-formats.md] [--quick]

Sections: (a) bits/weight and RMSE per format and tensor role (rows subsampled); (g) group size vs
RMSE for q3p/q2c; (l) how Q3P_LEVELS was chosen; (b) q3p vs q3u on the FFN: weight RMSE and KL of the
next-token distribution; (c) q2c k-means vs scikit-learn KMeans; (d) quantize/dequantize MB/s,
numpy reference vs fast path. Runtime: about 3-5 minutes on 2 cores. Only the tables between the page's
`mixqrt:formats-*` markers and docs/data/quant-formats.json are written; the page's text is hand-written.
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

from mixqrt.formats import codec as formats, kmeans, layout  # noqa: E402
from mixqrt.formats import dequantize, quantize  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import update_doc, write_json  # noqa: E402

F32 = np.float32
TEXT = ROOT / "tests" / "data" / "wikitext-2-test.txt"
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
        d16, m16, t, _ = formats._ref_minmax(X[:, None, :], np.array([G]), float(L[-1]))
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
        tok = open_source(str(model.path)).tokenizer
        ids = tok.encode(text)[:n]
        if len(ids) == n:
            return np.array(ids), "mixqrt.generation.tokenizer (from the GGUF)"
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
    ap.add_argument("--model", type=Path, default=None, help="source GGUF (default: the Qwen test model, mixqrt.testing)")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "quant-formats.md")
    ap.add_argument("--quick", action="store_true", help="fewer rows and tokens (smoke test)")
    args = ap.parse_args(argv)
    if args.model is None:
        from mixqrt.testing import model_path
        args.model = model_path("qwen")
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


def kl_ratio_line(kl) -> str:
    """q3p's mean KL against q3u's, per measured layer (the prose in docs/quant-formats.md judges it)."""
    per = [f"layer {L}: {100 * (1 - kl[(L, 'q3p')] / kl[(L, 'q3u')]):.1f}% lower"
           for (L, f) in kl if f == "q3p" and (L, "q3u") in kl]
    return "q3p's KL(f32 ‖ q) mean against q3u's: " + (", ".join(per) or "not measured") + " (negative: higher)."


def write_doc(args, sec, tokdesc, kl, layers, rows, ntok, elapsed, speed_shape):
    """Only the tables (between the page's mixqrt:formats-* markers) and docs/data/quant-formats.json are
    written; the text of docs/quant-formats.md is hand-written around them."""
    from mixqrt._kernels import _cpu
    import mixqrt.platform.isa
    run = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python benchmarks/formats.py" + (" --quick" if args.quick else ""),
           "seconds": round(elapsed), "cpu": _cpu.brand() or platform.processor(), "logical_cpus": os.cpu_count(),
           "isa": mixqrt.platform.isa.current(), "python": platform.python_version(), "numpy": np.__version__,
           "loadavg_end": os.getloadavg()[0], "rows": rows, "layers": layers, "kl_tokens": ntok, "kl_text": tokdesc,
           "q3p_levels": layout.Q3P_LEVELS.tolist(), "speed_slice": list(speed_shape),
           "kl_mean": {f"{L}/{f}": v for (L, f), v in kl.items()}}
    blocks = {
        "formats-run": "\n".join([
            f"- **Command:** `{run['command']}`, {run['date']}, {run['seconds']} s",
            f"- **Machine:** {run['cpu']} ({run['logical_cpus']} logical CPUs visible, ISA tier {run['isa']}), Python "
            f"{run['python']}, numpy {run['numpy']}; load average {run['loadavg_end']:.1f} at the end",
            f"- **Sample:** {rows} random rows per matrix ({rows}x4 for token_embd) from layers {layers}; every norm vector",
            f"- **KL text:** {tokdesc}",
            f"- **Q3P_LEVELS in force:** {run['q3p_levels']}"]),
        "formats-a": "\n".join(sec["a"]), "formats-g": "\n".join(sec["g"]), "formats-l": "\n".join(sec["l"]),
        "formats-b": "\n".join(sec["b"]), "formats-kl-ratio": kl_ratio_line(kl), "formats-c": "\n".join(sec["c"]),
        "formats-d": f"Slice: {speed_shape[0]}x{speed_shape[1]} float32 rows of blk.0.ffn_gate.\n\n" + "\n".join(sec["d"]),
    }
    write_json(args.out.parent / "data" / (args.out.stem + ".json"), run)
    update_doc(args.out, blocks, title="Quantization formats: measurements")

if __name__ == "__main__":
    sys.exit(main())
