"""Kernel benchmark: writes docs/kernels.md.

Measures, in one run: the machine's read bandwidth (C probe, every read pattern, 1 and 2 threads),
matvec (decode) time per format and shape with its effective bandwidth (packed bytes / time) and the
ratio to the honest bound (the best probe pattern, or the best effective rate any kernel or runtime
reached on weights that miss the LLC, whichever is higher), llama.cpp's decode of its own types on
the same machine in the same run (with --gguf), matmul at 512 rows (prefill) in GOP/s (2*N*K*T), numpy float32 BLAS on the
same shapes (in a subprocess with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset, threadpoolctl's report
recorded), and the hybrid-precision softmax (max error vs float64, speed vs exact).

    python benchmarks/kernels.py [--quick] [--out docs/kernels.md] [--gguf F32.gguf --gguf Q8_0.gguf ...]
    python benchmarks/kernels.py --make-gguf SRC.gguf     # requantize SRC to llama.cpp's types first

Weights are random packed bytes of the exact size (no quantization: the speed does not depend on
the values; the headers are set to small finite fp16 scales).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mixqrt import ops  # noqa: E402
from mixqrt.platform import isa
from mixqrt.formats import layout  # noqa: E402

SHAPES_05B = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]
SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]
MV_FMTS = ["q3x", "q6x", "q4x", "q3p", "q6", "q8", "q4", "q3u", "q2c", "f32", "f16", "bf16"]
FLOAT_FMTS = {"f32": 4, "f16": 2, "bf16": 2}
# weights at least this large miss the LLC (32 MiB here, 300 MB on a 16-core Xeon VM): only they
# bound DRAM reads
LLC_BYTES = max(64 << 20, 2 * __import__("mixqrt.platform.topology", fromlist=["llc_bytes"]).llc_bytes())
# mixqrt format -> llama.cpp's closest type (same bits per weight class)
LCPP_CLOSEST = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8": "Q8_0", "q6": "Q6_K", "q4": "Q4_0",
                "q3p": "Q3_K_S", "q3u": "Q3_K_S", "q2c": "Q2_K", "q6x": "Q6_K", "q4x": "Q4_0", "q3x": "Q3_K_S"}
LCPP_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q2_K": 10, "Q3_K_S": 11, "Q6_K": 18, "BF16": 32}
MM_FMTS = ["q3x", "q6x", "q4x", "q3p", "q6", "q8"]
THREADS = [1, 2]


class W:
    """Minimal packed weight (fmt, shape, raw) for the benchmark."""

    def __init__(self, fmt, shape, raw):
        self.fmt, self.shape, self.raw, self.meta = fmt, shape, raw, {}


def packed(fmt, n, k, rng):
    if fmt in FLOAT_FMTS:
        v = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        if fmt == "f16":
            v = v.astype(np.float16)
        elif fmt == "bf16":
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        return W(fmt, (n, k), v.reshape(-1).view(np.uint8))
    if fmt in layout.INTERLEAVED:   # the stored form of random base-format bytes (valid headers)
        w = packed(layout.INTERLEAVED[fmt][0], n, k, rng)
        return W(fmt, (n, k), layout.to_interleaved(fmt, w.raw, (n, k)))
    lay = layout.PACKED[fmt]
    raw = rng.integers(0, 256, size=lay.nbytes((n, k)), dtype=np.uint8)
    if lay.header:
        blocks = raw[: n * lay.row_bytes(k)].reshape(-1, lay.block_bytes)
        hdr = np.full((blocks.shape[0], lay.header // 2), 0.01, "<f2").view(np.uint8)
        blocks[:, : lay.header] = hdr
    return W(fmt, (n, k), raw)


def timeit(fn, min_time=0.25, max_reps=200):
    fn()
    ts = []
    t_end = time.perf_counter() + min_time
    while len(ts) < max_reps and (len(ts) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(min(ts))


BLAS_CHILD = r"""
import json, sys, time, numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
shapes = json.loads(sys.argv[1]); T = int(sys.argv[2]); threads = json.loads(sys.argv[3])
rng = np.random.default_rng(0)
out = {"info": [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads")} for d in threadpool_info()], "t": {}}
for n, k in shapes:
    w = rng.standard_normal((n, k), dtype=np.float32); x = rng.standard_normal((T, k), dtype=np.float32)
    for th in threads:
        with threadpool_limits(th):
            x @ w.T
            ts = []
            for _ in range(3):
                t0 = time.perf_counter(); x @ w.T; ts.append(time.perf_counter() - t0)
        out["t"][f"{n}x{k}@{th}"] = min(ts)
print(json.dumps(out))
"""


def blas(shapes, t, threads):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    r = subprocess.run([sys.executable, "-c", BLAS_CHILD, json.dumps(shapes), str(t), json.dumps(threads)],
                       env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


AB_SHAPES = [(4864, 896), (896, 4864), (3584, 3584), (18944, 3584), (3584, 18944), (151936, 896)]
AB_FMTS = ["q3p", "q6"]
TIER_SHAPES = [(4864, 896), (896, 4864), (3584, 3584)]
TIER_FMTS = ["q3p", "q6", "q8", "q4", "q2c"]


def lean_ab(rng, threads, rounds=5):
    """AVX-512 decode: the lean fused path vs the generic unpack path, interleaved in one process
    (best of `rounds` per variant: noise on a shared box only slows a run down)."""
    from mixqrt._kernels import _ops
    if "avx512" not in isa.available():
        return {}
    before = isa.current()
    isa.set_isa("avx512")
    old = _ops.set_lean_mv(True)
    out = {}
    for (n, k) in AB_SHAPES:
        for fmt in AB_FMTS:
            w = packed(fmt, n, k, rng)
            x = rng.standard_normal(k).astype(np.float32)
            for th in threads:
                ops.set_num_threads(th)
                best = {True: 1e9, False: 1e9}
                with ops.hot():
                    for _ in range(rounds):
                        for lean in (False, True):
                            _ops.set_lean_mv(lean)
                            _, b = timeit(lambda: ops.matmul(w, x), 0.05, 20)
                            best[lean] = min(best[lean], b)
                out[(fmt, n, k, th)] = (best[False], best[True], w.raw.size)
                print(f"decode A/B {fmt} {n}x{k} t{th}: unpack {w.raw.size / best[False] / 1e9:.1f} GB/s, "
                      f"lean {w.raw.size / best[True] / 1e9:.1f} GB/s", flush=True)
            del w
    _ops.set_lean_mv(old)
    isa.set_isa(before)
    ops.set_num_threads(ops.default_num_threads())
    return out


def tier_speeds(rng, threads, T=64):
    """Every ISA tier on the same weights: decode (T = 1) GB/s and prefill (T rows) GOP/s, best time,
    at each thread count."""
    before = isa.current()
    out = {}
    for (n, k) in TIER_SHAPES:
        for fmt in TIER_FMTS:
            w = packed(fmt, n, k, rng)
            x1 = rng.standard_normal(k).astype(np.float32)
            xt = rng.standard_normal((T, k)).astype(np.float32)
            for th in threads:
                ops.set_num_threads(th)
                for tier in isa.available():
                    if tier == "generic" and th > 1:
                        continue            # the readable spec: its speed is not a goal
                    isa.set_isa(tier)
                    _, b1 = timeit(lambda: ops.matmul(w, x1), 0.2)
                    _, bt = timeit(lambda: ops.matmul(w, xt), 0.2, 20 if tier != "generic" else 3)
                    out[(fmt, n, k, tier, th)] = (w.raw.size / b1 / 1e9, 2 * n * k * T / bt / 1e9)
                    print(f"tier {tier} t{th} {fmt} {n}x{k}: decode {out[(fmt, n, k, tier, th)][0]:.1f} GB/s, "
                          f"T={T} {out[(fmt, n, k, tier, th)][1]:.0f} GOP/s", flush=True)
            del w
    isa.set_isa(before)
    ops.set_num_threads(ops.default_num_threads())
    return out


def make_ggufs(src: str, out_dir: str, threads: int = 2) -> list[str]:
    """llama.cpp's types of SRC (requantized with allow_requantize), made once into out_dir."""
    import ctypes

    import llama_cpp
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for typ, ftype in LCPP_FTYPES.items():
        out = os.path.join(out_dir, f"{os.path.splitext(os.path.basename(src))[0]}-{typ}.gguf")
        if not os.path.exists(out):
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype, p.allow_requantize, p.nthread = ftype, True, threads
            tmp = out + ".part"
            rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(p))
            if rc != 0:
                print(f"llama_model_quantize({typ}) returned {rc}: skipped", flush=True)
                continue
            os.replace(tmp, out)
        paths.append(out)
    return paths


def gguf_type_and_bytes(path: str) -> tuple[str, int]:
    """(llama.cpp type from the file name, bytes one decode step reads: every tensor but token_embd,
    unless token_embd is also the output projection, as in tied models)."""
    import gguf
    r = gguf.GGUFReader(path)
    names = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(names.values())
    if "output.weight" in names:
        total -= names.get("token_embd.weight", 0)
    typ = os.path.splitext(os.path.basename(path))[0].rsplit("-", 1)[-1]
    return typ, total


def llamacpp_decode(paths, threads, tokens=16, rounds=2):
    """{(type, threads): (tok/s best of rounds, bytes per step)} for llama.cpp's decode of each GGUF."""
    from llama_cpp import Llama
    out = {}
    prompt = list(range(1000, 1016))
    for path in paths:
        typ, nbytes = gguf_type_and_bytes(path)
        for th in threads:
            llm = Llama(model_path=path, n_ctx=64 + tokens, n_threads=th, n_threads_batch=th, n_batch=16,
                        use_mmap=True, verbose=False)
            llm.eval(prompt)
            best = 0.0
            for _ in range(rounds):
                llm._ctx.kv_cache_seq_rm(-1, len(prompt), -1)
                llm.n_tokens = len(prompt)
                t = time.perf_counter()
                for _ in range(tokens):
                    llm.eval([1000])
                best = max(best, tokens / (time.perf_counter() - t))
            out[(typ, th)] = (best, nbytes)
            print(f"llama.cpp {typ} t{th}: {best:.1f} tok/s = {best * nbytes / 1e9:.1f} GB/s", flush=True)
            del llm
    return out


def softmax_study(rng):
    from mixqrt._kernels import _ops
    rows = []
    for n in (128, 1024, 32768):
        x = (rng.standard_normal((8, n)) * 12).astype(np.float32)
        ref = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True).astype(np.float64))
        ref /= ref.sum(-1, keepdims=True)
        res = {}
        for fast in (True, False):
            y = x.copy()
            _ops.softmax_(y, fast)
            err = np.max(np.abs(y - ref) / np.maximum(ref, 1e-30))
            med, _ = timeit(lambda: _ops.softmax_(x.copy(), fast), 0.1)
            res[fast] = (err, med)
        rows.append((n, res))
    xs = np.linspace(-87, 88, 200001).astype(np.float32)
    got = np.array([_ops.expf_fast(float(v)) for v in xs[::20]])
    ref = np.exp(xs[::20].astype(np.float64))
    exp_err = float(np.max(np.abs(got - ref) / ref))
    return rows, exp_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="0.5B shapes only, fewer formats")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   "docs", "kernels.md"))
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp GGUF to decode in the same run "
                    "(the type is the file name's last '-' part, as --make-gguf writes it); repeatable")
    ap.add_argument("--make-gguf", default=None, help="requantize this GGUF to llama.cpp's types into "
                    "/tmp/mixqrt-kernels-gguf (once) and decode them all")
    args = ap.parse_args()
    if args.make_gguf:
        args.gguf += make_ggufs(args.make_gguf, "/tmp/mixqrt-kernels-gguf")
    rng = np.random.default_rng(0)
    shapes = SHAPES_05B + ([] if args.quick else SHAPES_7B)
    mv_fmts = MV_FMTS[:3] if args.quick else MV_FMTS
    threads = [t for t in THREADS if t <= max(THREADS)]
    t_start = time.time()
    print(f"isa: {isa.explain()}", flush=True)

    probes = {th: ops.read_bandwidth_patterns(1 << 30, th, 2) for th in threads}
    print("read bandwidth GB/s:", {th: {k: round(v / 1e9, 1) for k, v in p.items()} for th, p in probes.items()},
          flush=True)
    lcpp = llamacpp_decode(args.gguf, threads) if args.gguf else {}

    mv = {}
    for (n, k) in shapes:
        for fmt in mv_fmts:
            w = packed(fmt, n, k, rng)
            x = rng.standard_normal(k).astype(np.float32)
            for th in threads:
                ops.set_num_threads(th)
                med, best = timeit(lambda: ops.matmul(w, x), 0.2 if n * k < 5e7 else 0.5)
                mv[(fmt, n, k, th)] = (med, best, w.raw.size)
                print(f"matvec {fmt} {n}x{k} t{th}: {med * 1e6:.0f} us  {w.raw.size / med / 1e9:.1f} GB/s", flush=True)
            del w
    # the probe again at the end (a busy moment can only lower a probe): best per pattern
    for th in threads:
        for name, v in ops.read_bandwidth_patterns(1 << 30, th, 2).items():
            probes[th][name] = max(probes[th].get(name, 0.0), v)
    bw, bw_note = {}, {}
    for th in threads:
        eff = [(nb / best, f"mixqrt {fmt} {n} x {k}") for (fmt, n, k, t), (_, best, nb) in mv.items()
               if t == th and nb >= LLC_BYTES]
        eff += [(tps * nb, f"llama.cpp {typ} decode") for (typ, t), (tps, nb) in lcpp.items() if t == th]
        top = max(eff, default=(0.0, ""))
        probe_best = max(probes[th].values())
        bw[th] = max(probe_best, top[0])
        if top[0] > probe_best:
            bw_note[th] = (f"{top[1]} read {top[0] / 1e9:.1f} GB/s, above the best probe pattern "
                           f"({probe_best / 1e9:.1f} GB/s): the probe under-reads here; the bound is that rate")
        print(f"bound t{th}: {bw[th] / 1e9:.1f} GB/s {bw_note.get(th, '')}", flush=True)

    T = 512
    mm_shapes = [s for s in shapes if s[0] < 100000]
    mm = {}
    for (n, k) in mm_shapes:
        x = rng.standard_normal((T, k)).astype(np.float32)
        for fmt in MM_FMTS:
            w = packed(fmt, n, k, rng)
            for th in threads:
                ops.set_num_threads(th)
                med, best = timeit(lambda: ops.matmul(w, x), 0.0, 3)
                mm[(fmt, n, k, th)] = best
                print(f"matmul T={T} {fmt} {n}x{k} t{th}: {best * 1e3:.1f} ms  {2 * n * k * T / best / 1e9:.0f} GOP/s",
                      flush=True)
            del w
    ops.set_num_threads(ops.default_num_threads())
    bl = blas(mm_shapes, T, threads)
    print("blas:", bl["info"], flush=True)
    sm, exp_err = softmax_study(rng)
    ab = lean_ab(rng, threads)
    tiers = tier_speeds(rng, threads)
    elapsed = time.time() - t_start
    write_md(args.out, bw, mv, mm, bl, sm, exp_err, shapes, mm_shapes, mv_fmts, threads, T, elapsed, ab, tiers,
             probes=probes, bw_note=bw_note, lcpp=lcpp)
    print(f"wrote {args.out} in {elapsed:.0f} s")


def table_rows(shapes, fmts, cells) -> list[str]:
    """Markdown rows `| N x K | fmt | cells(fmt, n, k)... |` for every shape and format."""
    return [f"| {n} x {k} | {fmt} | " + " | ".join(cells(fmt, n, k)) + " |" for (n, k) in shapes for fmt in fmts]


def hand_text(path) -> str:
    """The page's hand-written sections: everything between its intro and '## Machine of this run'.
    The page is their only copy; a rerun keeps them and replaces what follows."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return "## Design\n\n(no hand-written sections yet)\n\n"
    head = text.split("\n## Machine of this run", 1)[0]
    i = head.find("\n## ")
    return head[i + 1:].rstrip("\n") + "\n\n" if i >= 0 else ""


def write_md(path, bw, mv, mm, bl, sm, exp_err, shapes, mm_shapes, mv_fmts, threads, T, elapsed, ab=None, tiers=None,
             probes=None, bw_note=None, lcpp=None):
    from mixqrt._kernels import _cpu
    L = []
    L.append("# Kernels: design and measurements\n")
    L.append("The sections from *Machine of this run* on are generated by `python benchmarks/kernels.py` (numbers "
             "from its last run; do not edit them by hand). The sections before it are written by hand and kept "
             "as they are by a rerun; the dated measurements behind them are in docs/lab/ (see *History*).\n")
    L.append(hand_text(path))
    L.append("## Machine of this run\n")
    L.append(f"- CPU: {_cpu.brand()} ({_cpu.vendor()}), {len(os.sched_getaffinity(0))} CPUs in our affinity mask, "
             f"python {platform.python_version()}, numpy {np.__version__}")
    L.append(f"- ISA tier: {isa.explain()}")
    L.append("- honest bandwidth bound: "
             + ", ".join(f"{th} thread{'s' if th > 1 else ''}: **{bw[th] / 1e9:.1f} GB/s**" for th in threads)
             + " (the best read pattern of the probe, or the best effective rate a kernel or runtime reached "
             "in this run on weights that miss the LLC, whichever is higher)")
    for th, note in (bw_note or {}).items():
        L.append(f"- NOTE ({th} thread{'s' if th > 1 else ''}): {note}")
    L.append(f"- load average at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    L.append(f"- run time {elapsed:.0f} s; the machine is shared, so numbers are medians (matvec) or best of 3 "
             "(matmul) and still noisy.\n")
    if probes:
        names = list(probes[threads[0]])
        L.append("## Read-bandwidth probe\n")
        L.append("`ops.read_bandwidth_patterns(1 GiB, threads, 2)` at the start and at the end of the run, best of "
                 "the two per pattern, GB/s. One 2 MiB-aligned `MADV_HUGEPAGE` buffer, threads pinned one per "
                 "CPU; `N stream` = N independent sequential streams per thread (the thread's slice cut in N), "
                 "`pf` = software prefetch, `nt` = non-temporal loads (vmovntdqa), `il16k` = the threads take "
                 "16 KiB chunks in turn instead of one contiguous slice each. `ops.read_bandwidth` is the "
                 "best of them.\n")
        L.append("| pattern | " + " | ".join(f"{th}t GB/s" for th in threads) + " |")
        L.append("|---|" + "---|" * len(threads))
        for name in names:
            L.append(f"| {name} | " + " | ".join(f"{probes[th].get(name, float('nan')) / 1e9:.1f}" for th in threads)
                     + " |")
        L.append("")
    if lcpp:
        L.append("## llama.cpp decode in the same run\n")
        L.append("Each GGUF decodes 16 tokens after a 16-token prompt, best of 2 rounds; GB/s = tok/s x the "
                 "bytes one decode step reads (every tensor but token_embd, unless token_embd is the tied "
                 "output projection); ratio = that / the bound above. These rates count towards the bound.\n")
        L.append("| llama.cpp type | closest mixqrt format | MB per step | " + " | ".join(
            f"{th}t tok/s | {th}t GB/s | {th}t ratio" for th in threads) + " |")
        L.append("|---|---|---|" + "---|" * (3 * len(threads)))
        for typ in dict.fromkeys(t for t, _ in lcpp):
            close = ", ".join(f for f, tt in LCPP_CLOSEST.items() if tt == typ) or "-"
            nb = lcpp[(typ, threads[0])][1]
            cells = []
            for th in threads:
                tps = lcpp[(typ, th)][0]
                cells += [f"{tps:.1f}", f"{tps * nb / 1e9:.1f}", f"{tps * nb / bw[th]:.2f}"]
            L.append(f"| {typ} | {close} | {nb / 1e6:.0f} | " + " | ".join(cells) + " |")
        L.append("")
    L.append("## Matvec (decode, T = 1)\n")
    L.append("Effective bandwidth = packed bytes (scales included) / median time; ratio = that / the honest "
             f"bound at the same thread count. Weights under {LLC_BYTES >> 20} MiB stay in the 32 MiB LLC between "
             "repetitions, so their ratio can exceed 1 without meaning anything about DRAM; only the larger "
             "ones (151936 x 896, the 7B FFN shapes) read memory.\n")
    hdr = "| shape N x K | fmt | " + " | ".join(f"{th}t µs | {th}t GB/s | {th}t ratio" for th in threads) + " |"
    L.append(hdr)
    L.append("|" + "---|" * (2 + 3 * len(threads)))
    def mv_cells(fmt, n, k):
        med = {th: mv[(fmt, n, k, th)][0] for th in threads}
        nb = mv[(fmt, n, k, threads[0])][2]
        return [c for th in threads for c in (f"{med[th] * 1e6:.0f}", f"{nb / med[th] / 1e9:.1f}",
                                               f"{nb / med[th] / bw[th]:.2f}")]
    L += table_rows(shapes, mv_fmts, mv_cells)
    L.append("")
    L.append(f"## Matmul (prefill, T = {T} rows of X)\n")
    L.append("GOP/s = 2·N·K·T / best time. BLAS: numpy float32 `x @ w.T` on the same shape, run in a child "
             "process with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset; threadpoolctl reports: "
             + "; ".join(f"`{d.get('internal_api')} {d.get('version')} {d.get('architecture')}`" for d in bl["info"])
             + ".\n")
    hdr = "| shape N x K | " + " | ".join(f"{f} {th}t" for th in threads for f in MM_FMTS) + " | " + \
        " | ".join(f"BLAS f32 {th}t" for th in threads) + " |"
    L.append(hdr)
    L.append("|" + "---|" * (1 + len(threads) * (len(MM_FMTS) + 1)))
    for (n, k) in mm_shapes:
        g = 2 * n * k * T / 1e9
        cells = [f"{g / mm[(f, n, k, th)]:.0f}" for th in threads for f in MM_FMTS]
        cells += [f"{g / bl['t'][f'{n}x{k}@{th}']:.0f}" for th in threads]
        L.append(f"| {n} x {k} | " + " | ".join(cells) + " |")
    L.append("")
    if ab:
        L.append("## AVX-512 decode: lean path vs unpack path\n")
        L.append("Same random packed weights, the two decode paths alternated in one process "
                 "(`_ops.set_lean_mv(True/False)`, pool in hot mode), best of 5 rounds each; GB/s = packed "
                 "bytes / time. The lean path is the default; `MIXQRT_LEAN_MV=0` (or `_ops.set_lean_mv(False)`) "
                 "selects the unpack path. q6 with an odd number of 32-chunks per row, or with rows short enough "
                 "that 4 rows fit in 4 KB (K = 896), always takes the unpack path, so both columns of those "
                 "rows measure the same code.\n")
        L.append("| shape N x K | fmt | " + " | ".join(f"{th}t unpack GB/s | {th}t lean GB/s | {th}t speed-up"
                                                     for th in threads) + " |")
        L.append("|" + "---|" * (2 + 3 * len(threads)))
        def ab_cells(fmt, n, k):
            out = []
            for th in threads:
                old_t, new_t, nb = ab[(fmt, n, k, th)]
                out += [f"{nb / old_t / 1e9:.1f}", f"{nb / new_t / 1e9:.1f}", f"{old_t / new_t:.2f}x"]
            return out
        L += table_rows(AB_SHAPES, AB_FMTS, ab_cells)
        L.append("")
    if tiers:
        tl = sorted({key[3] for key in tiers}, key=["generic", "avx2", "avx512"].index)
        cols = [(t, th) for th in threads for t in tl if (TIER_FMTS[0],) + TIER_SHAPES[0] + (t, th) in tiers]
        L.append("## ISA tiers side by side\n")
        L.append("Every tier on the same weights (`isa.set_isa`), best time: decode GB/s (packed bytes / time, "
                 "T = 1) and prefill GOP/s at T = 64 rows, at 1 and 2 threads (generic at 1 thread only). The "
                 "AVX2 tier is what a CPU without AVX-512 (or `MIXQRT_ISA=avx2`) runs.\n")
        L.append("| shape N x K | fmt | " + " | ".join(f"{t} {th}t decode GB/s" for t, th in cols) + " | "
                 + " | ".join(f"{t} {th}t T=64 GOP/s" for t, th in cols) + " |")
        L.append("|" + "---|" * (2 + 2 * len(cols)))
        L += table_rows(TIER_SHAPES, TIER_FMTS, lambda fmt, n, k: [f"{tiers[(fmt, n, k, t, th)][0]:.1f}" for t, th in cols]
                        + [f"{tiers[(fmt, n, k, t, th)][1]:.0f}" for t, th in cols])
        L.append("")
    L.append("## Hybrid-precision softmax\n")
    L.append(f"Fast exp (range [-87, 88], Cody-Waite + degree-6 polynomial): max relative error {exp_err:.2e} "
             f"({exp_err / 2 ** -24:.1f} float32 ulp-ish units of 2^-24) over the range. Softmax of rows of "
             "N(0, 12²) logits, max relative error per element vs float64, median time per 8 rows:\n")
    L.append("| n | hybrid max rel err | hybrid µs | exact (libm expf) max rel err | exact µs |")
    L.append("|---|---|---|---|---|")
    for n, res in sm:
        L.append(f"| {n} | {res[True][0]:.2e} | {res[True][1] * 1e6:.1f} | {res[False][0]:.2e} | {res[False][1] * 1e6:.1f} |")
    L.append("")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
