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
from mixqrt import isa, ops  # noqa: E402
from mixqrt.quant import layout  # noqa: E402

SHAPES_05B = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]
SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]
MV_FMTS = ["q3p", "q6", "q8", "q4", "q3u", "q2c", "f32", "f16", "bf16"]
FLOAT_FMTS = {"f32": 4, "f16": 2, "bf16": 2}
LLC_BYTES = 64 << 20    # weights at least this large miss the LLC (32 MiB here): only they bound DRAM reads
# mixqrt format -> llama.cpp's closest type (same bits per weight class)
LCPP_CLOSEST = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8": "Q8_0", "q6": "Q6_K", "q4": "Q4_0",
                "q3p": "Q3_K_S", "q3u": "Q3_K_S", "q2c": "Q2_K"}
LCPP_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q2_K": 10, "Q3_K_S": 11, "Q6_K": 18, "BF16": 32}
MM_FMTS = ["q3p", "q6", "q8"]
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


def write_md(path, bw, mv, mm, bl, sm, exp_err, shapes, mm_shapes, mv_fmts, threads, T, elapsed, ab=None, tiers=None,
             probes=None, bw_note=None, lcpp=None):
    from mixqrt._kernels import _cpu
    L = []
    L.append("# Kernels: design and measurements\n")
    L.append("Generated by `python benchmarks/kernels.py` (numbers below are from the last run; the prose "
             "sections are kept in the script). Do not edit the tables by hand.\n")
    L.append(DESIGN)
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


DESIGN = """## Design

**Integer path.** Every packed format is computed as
`y = Σ_c (dw_c·dx_c)·isum_c + (m_c − off·dw_c)·s_c`, where a chunk c is 32 weights, `isum_c = Σ U_i·a_i`
is the exact integer dot of the *unsigned* levels `U = L[q] + off` (off = 128 for q8, 32 for q6, 0
otherwise) with the int8 activations `a` (quantized once per call, per block of 32: `d = amax/127`,
`a = rint(x·127/amax)`, `s = d·Σa`, the llama.cpp q8 + bsums scheme). Unsigned levels let vpdpbusd
(u8 × s8) do the multiply; the zero point / min / level offset is corrected from the block sums `s`.
Non-uniform levels go through an in-register table: q3p's fixed 8-entry table (an argument, from
`layout.Q3P_LEVELS` or `QTensor.meta["q3p_levels"]`) and q2c's per-block 4-entry codebook via vpshufb.
T-MAC lookup was not implemented. It had been dismissed because decode "reached the bandwidth roof", but
that roof came from a one-pattern probe that under-read the machine (llama.cpp's F32 decode of the 0.5B
model read ~57 GB/s at 2 threads against a 38-40 GB/s "bound"): against the honest bound below, q3p decode
is not at the roof, so the dismissal no longer holds (see Open items).

**Honest bandwidth bound** (`src/ops/bw.c`, `bw_avx2.c`, `bw_avx512.c`; `ops.read_bandwidth_patterns`).
The probe reads one 2 MiB-aligned, `MADV_HUGEPAGE` buffer (pages written first, so no fault is timed)
on threads pinned one per CPU, each thread timing itself from a common barrier, with several patterns:
one sequential stream (scalar, AVX-512), 2/4/8 independent streams per thread with and without software
prefetch, AVX2 and AVX-512 wide loads, non-temporal loads (vmovntdqa), and threads taking 16 / 256 KiB
chunks in turn; wide-load patterns are offered only where cpuid + xgetbv say the CPU runs them (never a
SIGILL on an older CPU, whatever `MIXQRT_ISA` forces). `ops.read_bandwidth` is the best pattern. The bound
that `mixqrt bench` and the benchmarks divide by is that, or the best effective rate (bytes read per token
x tok/s, or packed bytes / time for a matvec whose weights miss the LLC) any runtime reached in the same
run, whichever is higher; a runtime above the probe is reported as the probe being wrong. Measured here
(all under a load average of 10-15 from other jobs): one sequential stream per thread read *faster* than
2-8 interleaved streams in every probe run (1 thread: 13.0 vs 3.5-8.1 GB/s in one run), and the same held
for a 4-row float decode kernel (4 row streams sharing each x load, prefetched 0.5-4 KB ahead): 0.4-0.6x
of the one-row loop on the 151936 x 896 f32/f16 lm_head at 1 and 2 threads, with and without software
prefetch. It stays as an opt-in (`MIXQRT_FLOAT_MV=1`, `_ops.set_float_mv`) for a quiet re-measure.

**AVX-512 tier** (`src/ops/kern_avx512.c`): two chunks (64 codes) per zmm, unpacked with vpermb (q3u, q6:
one masked load of the block, vpermb places the 2-bit plane / nibbles / high-bit bytes per qword),
per-qword shifts (vpsrlvq / vprolvq) and masks, vptestmb + masked add for the 3rd bit, vpternlog to merge
q6's planes, vpshufb for levels (q3p: the pack3c unpack below); then one vpdpbusd, one vcvtdq2ps and one FMA with the (dw × dx) lane
vector; the offset term is a second FMA with a precomputed `s` lane vector. Decode runs fused from the
packed bytes, two rows per iteration sharing the activation loads. T = 2-7 unpacks a tile of 4 rows
once into L1-resident u8 levels and reuses it for every token; T >= 8 (batched decode of 8 sequences,
and prefill) uses the VNNI GEMM below.

**q3p decode (pack3c, `mv_q3c`; .mxq version 2).** q3p's codes are packed contiguously (code i at bits
3i..3i+2, a 64-weight block = 4 bytes of (d, m) + 24 bytes of codes, the same 3.5 bpw). Per block and
row: one 32-byte load, one vpermb giving each qword the 3 bytes of its 8 codes, one vpmultishiftqb
putting code 8j+b in the low bits of byte b, one vpermb on a 64-entry table (level of i & 7 at every i,
so the bits above a code need no mask), one vpdpbusd. The planar layout (2-bit plane + 1-bit plane)
needed a vinserti64x4, vpsrlvq, vpand, two scalar loads into a mask register, a masked add and a
vpshufb for the same. The float work is shared by a 4-row tile: the four 16-lane int32 sums are folded
by unpacklo/hi + add into one vector (lane 4j + r = row r's partial sum of 128-bit lane j: j < 2 chunk
A, else chunk B), converted once and scaled by (d_r x dx_chunk), with the 4 rows' (d, m) from one
vcvtph2ps of their gathered headers; rows up to 160 pairs keep the dx lane vectors in scratch. Same
prefetch as `mv_lean`. The AVX2 tier unpacks pack3c with a vpshufb (each code's 16-bit window as a
word), vpmullw by 2^(13 - shift), vpsrlw 13 and one vpackuswb. Variants, single thread, thread CPU
time, random bytes (`benchmarks/q3p_decode_variants.c`, GB/s = packed bytes / time, one run on the
loaded box, 07:10 UTC):

| variant | 4864 x 896 | 896 x 4864 | 3584 x 3584 | 3584 x 18944 (DRAM, no prefetch) |
|---|---|---|---|---|
| A planar layout, per-row float (the lean path before) | 11.8 | 12.0 | 10.9 | 8.7 |
| B pack3c, per-row float | 13.3 | 15.9 | 14.0 | 9.3 |
| C pack3c, 4-row float | 15.2 | 17.7 | 16.5 | 10.5 |
| D planar, 4-row float | 11.4 | 13.0 | 11.4 | 9.1 |
| E pack3c with a row's scales stored apart from its codes | 14.8 | 17.2 | 15.4 | 8.9 |
| F C with the tile's scales gathered into a transposed scratch | 10.0 | 13.1 | 9.6 | 6.8 |
| H C with dx lane vectors from scratch (as built, <= 160 pairs) | 16.0 | 16.9 | 16.8 | 9.7 |

So pack3c + the 4-row float work is ~1.3-1.5x the planar lean kernel on cache-resident weights; the
4-row fold alone does nothing on the planar layout (D), a second layout change that moves the scales
out of the blocks (E, the "scales stored together" idea) is not better than C, and gathering scales by
scalar loads (F) loses. VBMI2's vpexpandb would replace the first vpermb by a load, but the tier does
not require VBMI2. Through `ops.matmul` (1 thread, thread CPU time, main vs this branch in alternated
processes on the same random weights): 9728 x 896 8.1-10.6 -> 11.0-14.4 GB/s, 4864 x 896 8.4 -> 11.6-14.1,
3584 x 3584 8.7-10.8 -> 13.9, 3584 x 18944 8.6-9.1 -> 12.0-15.6.

**AVX-512 lean decode** (`mv_lean`, default for q3u and q6 with long rows; q3p had it before pack3c):
the same integer sums with fewer instructions and less L1. The bit planes are broadcast qwords / 128-bit
lanes merged with one vinserti64x4 (no vpermb); q3's high bits are loaded straight into a mask register
(kmovq) for the masked add; a pair's two fp16 scales are converted once as an xmm; the activation side
keeps 4 floats per 64 weights (dx of both chunks, and the offset term's s pre-multiplied) instead of
two zmm, and the offset term accumulates in an xmm lane. Four rows per iteration share the activation
loads. Each row stream is prefetched 1.5 KB ahead inside the loop, continuing into the same row of the
next 4-row tile past the row's end; tiles of at most 4 KB (short rows, K = 896) are prefetched whole,
16 KB ahead, because 1.5 KB is too short a distance for a stream from DRAM. q6 with short rows (the 0.5B
model's attention and its 151936 x 896 lm_head) stays on the unpack path: there the lean path measured
0.84-0.9x at 2 threads (interleaved, best of 12), so it is routed only where it wins. The unpack path
stays as an option everywhere (`MIXQRT_LEAN_MV=0`, `_ops.set_lean_mv`); the A/B table below is
measured in every run.

**Generic tier** (`src/ops/generic.c`): unpack a row to u8 levels, scalar integer dot per chunk, the same
float combination; it is the readable spec and is what the numpy emulation in `tests/test_kernels_ref.py`
mirrors. **AVX2 tier** (`src/ops/kern_avx2.c`): one chunk (32 codes) per ymm, unpacked with a broadcast,
per-qword shifts (vpsrlvq) and masks, bit expansion (vpshufb + vpcmpeqb) for the 3rd/5th bits, vpshufb for
q3p/q2c levels; products with vpmaddubsw + vpmaddwd(ones). int16 saturation: levels <= 63 (q6/q4/q3*/q5g)
give pairs <= 2·63·127; q8 multiplies |c| by sign(a, c) (pairs <= 2·128·127), which is Σ c·a directly, so
AVX2 uses no q8 zero point at all (off = 0, mm = 0: no large offset products to cancel in float); q2c's table levels (up to 255) are split into `U & 0x7f` and `U & 0x80`, two vpmaddubsw summed
in int32. isum is therefore bit-identical to the generic tier (`test_extreme_levels_no_saturation` puts the
largest levels against |a| = 127 of one sign on every tier). Decode fused (2 rows, prefetch 8 rows ahead),
prefill with a 4-row unpacked tile, as in AVX-512.

**Float weights** (f32/f16/bf16): AVX-512 FMA dot, f16 via vcvtph2ps, bf16 by a 16-bit shift.

**Exactness.** isum is exact in every tier; only the order of the float combination differs. Tests check
(a) bit equality with the emulation on inputs built so that every float operation is exact (power-of-two
scales, activations on a power-of-two grid), (b) a float32 rounding bound `(2·nc+8)·2⁻²⁴·Σ|terms|` on
random inputs, (c) the activation-quantization bound vs float64 `W·x`, (d) sentinels around the output.

**Thread pool** (`src/ops/pool.c`): C threads started once (at `import mixqrt.ops`, restarted by
`set_num_threads`), pinned one per CPU of `os.sched_getaffinity`; rows are split in 16-row (decode) /
64-row (prefill) units; the caller thread is worker 0; the GIL is released for the whole product.
Idle workers spin `MIXQRT_SPIN_US` (default 100 µs) and then sleep on a futex; `ops.hot(True)` (or
`with ops.hot():`) makes them spin without sleeping (no futex wake per product). The model can turn it
on for the duration of each forward call of at most N tokens (`MIXQRT_HOT_MAX_T=N` or
`models.qwen2.HOT_MAX_T`; a decode step is ~100 products within ~100 ms), never between calls. It is
off by default: four alternated end-to-end A/Bs on the 7B 2356 file at 2 threads
(`benchmarks/decode_ab.py`, best rounds) went both ways, hot vs not 10.91 vs 11.63, 8.93 vs 9.71, 9.90
vs 8.92 tok/s, and 7.69 vs 7.29 in a contended window: within the noise, and spinning costs a core
when other processes want it (an earlier global hot mode made 2-thread decode much *slower* then).
One job at a time (mutex): a caller that finds the pool busy runs its job inline. Per Python thread,
`ops.local_threads(n)` (matmul, attention; the float ops always run on the caller): `None` = the pool,
`1` = on the calling thread without touching the pool (GIL released: several Python threads can run
products concurrently), `n` = at most n parts. The pool starts on first use, not at import. Default
thread count: `MIXQRT_NUM_THREADS`, else `runtime.topology.usable_cpus()` (affinity CPUs capped by the
cgroup quota, floored; what `mixqrt doctor` reports). While the pool has more than one thread,
threadpoolctl limits numpy's BLAS to one thread.

**Other ops** (`src/ops/misc_impl.h`, compiled once per tier and auto-vectorized without reassociation, so
all tiers give identical results): RMSNorm (float64 sum of squares), RoPE (HF rotate-half, cos/sin in
float64), SiLU·up, softmax, causal GQA attention over a float32 or float16 KV cache (C for T ≤ 8 query
rows, parallel over heads; batched BLAS products + a C causal softmax, on the pool, for prefill: no
boolean mask, no -inf through libm). The exp of SiLU/softmax runs in two passes (the fast polynomial on
the clamped input, vectorized; then libm for the rare out-of-range inputs), and the attention q·k dot uses
16-lane intrinsics with a fixed tree reduction (same per-lane operations in every tier, so results stay
bit-identical across tiers): gcc had left it scalar, decode attention at 100 positions went ~115 -> 27 µs.

**Hybrid-precision softmax**: `exp` is a Cody-Waite/polynomial fast path on [-87, 88]; any input outside
(after subtracting the row max, i.e. the underflow tail and -inf) takes libm `expf`, so denormal and zero
results are exact. `softmax(x, fast=False)` is the all-libm variant for comparison.

**Lessons measured.** (1) Masked loads (`vmovdqu8` with a mask) that miss the cache were ~10x slower
on this AMD part: plain loads are used wherever 64 bytes stay inside the tensor, masked only at the
very end. (2) Software prefetch 8 rows ahead took decode of LLC-missing tensors (q8 151936 x 896) from
~6 to ~24 GB/s single-threaded. (3) In prefill the scalar `Σ mm·s` loop was a serial FMA chain that
cost more than the vector work; it is now a vector dot. (4) That whole-rows-ahead prefetch overflowed
L1 on long rows: for ffn_down (3584 x 18944, 4.1 KB per q3p row) 8 rows ahead is 33 KB of prefetched
weights next to 38 KB of activation vectors in a 48 KB L1, and ffn_down ran at ~0.6x gate_up's speed
per byte (10 vs 16 GB/s at 1 thread). Prefetching a fixed 1.5 KB ahead per row stream and shrinking
the activation side (lean path) brought it level with gate_up; a sweep of the distance (0.5-32 KB,
interleaved, 7B shapes) put 1.5-2 KB best for long rows and the next tile's rows best for short ones,
which the "same row, next tile" rule gives both.

## Decode / prefill end to end (Qwen2.5-Coder-0.5B, `2356` mix, measured by hand)

Not generated by this script (the lead reruns the tables above on a quiet machine). Model: q6 qkv/o_proj,
q3p gate_up/down, q6 lm_head 151936 x 896 (110 MB), q2c embedding; ~283 MB read per token. Decode: 64-token
prefill, then single-token steps; pp512: one 512-token prompt, `last_only=True`.

Before this round (load average ~2.5 from other jobs on the 2-core box): decode **54.3 tok/s** at 1 thread,
**72.8 tok/s** at 2 threads (19.3 tok/s in a run where the other core was busy); pp512 **77.6 tok/s** at 1
thread, **143 tok/s** at 2 threads. Decode profile (1 thread, 21.3 ms/token): matmul 18.3 ms (97 calls;
lm_head alone 4-6 ms = 20-28 GB/s, q3p gate_up 11.7 GB/s: compute-bound on the 3-bit unpack at 1 thread),
attention 1.3 ms (24 calls, ~54 µs each), SiLU 0.56 ms, Python/other ~1 ms. pp512 profile (1 thread,
4.7 s): matmul 3.16 s (~116 GOP/s), attention 1.12 s (46 ms/layer: boolean mask + -inf through libm expf +
a scalar exp), SiLU 0.37 s.

Changes: decode attention q·k dot vectorized (100 positions, 14 heads: ~115 -> 27 µs per call, measured
back to back), vectorized exp in SiLU/softmax, causal softmax in C on the pool for prefill (no mask
array), per-QTensor cache of the matmul argument unpacking (~5 µs of Python per product), attention
scratch from the per-thread arena instead of malloc, opt-in `ops.hot()`.

After: the box was then at load average 9-11 (other engineers' jobs on both cores), which gave decode
18.8 / 10.0 tok/s and pp512 47.6 / 52.8 tok/s at 1 / 2 threads: numbers not comparable with the ones
above and not a regression signal; the end-to-end before/after must be re-measured on a quiet machine
(recipe: `quantize_model(gguf, '2356', out)`, `mixqrt.load(out).model`, `make_cache(512)`,
64-token prefill, 64 timed steps at `ops.set_num_threads(1)` and `(2)`). At 2 threads the matmuls alone
need ~21 GB/s effective for 75 tok/s; the idle-machine matvec table above (lm_head 3.5 ms at 2 threads in
a quiet moment = 31 GB/s, per-layer products ~23-38 GB/s) says that is within reach once the non-matmul
~3.8 ms/token (now ~1.5 ms) is gone.

**q3p pack3c end to end** (2026-12-03, loaded box, load average 5-7; separate processes alternated
under the bench lock, each the best of 3 x 32 greedy steps after a 64-token prefill; "before" = the
commit before pack3c on its version 1 file, "after" = pack3c on a version 2 file of the same RTN
quantization; both decode the same tokens). Run 1 (06:59): 1 thread 15.9 -> 19.3 tok/s best (medians
15.5 -> 18.3), 2 threads 10.6 -> 13.8 (9.7 -> 12.2). Run 2 (08:01): 1 thread 19.4 -> 20.9 (17.6 ->
18.8), 2 threads 11.6 -> 11.5 (11.2 -> 11.0). pp512 in alternated processes (07:27): 2 threads 104.6
-> 103.7 tok/s best, 1 thread 106.9 -> 100.9 (within the run-to-run spread of 86-107); forced AVX2
tier decode (`MIXQRT_ISA=avx2`): 1 thread 11.6 -> 12.9, 2 threads 9.3 -> 10.0. At these loads a
decode step is 3-5x slower than on an idle box (54 tok/s at 1 thread quiet), so the kernels' compute
gain (1.3-2x in the tables above) shows only partly; the 0.80-of-bound target needs a quiet
re-measure. 7B shapes (`mixqrt bench` of a 2356 quantization of the synthetic Qwen2-7B checkpoint,
3622 MB read per token, 08:05): 1.93 tok/s at 1 thread (0.34 of the 20.5 GB/s probe), 1.83 at 2
threads (0.40 of 16.7 GB/s), load average ~6.5.

## GEMM for prefill and batched decode (AVX-512, T >= 8) and prefill attention (measured by hand)

Measured by hand before the tables below were regenerated (prose kept in `benchmarks/kernels.py`).

**Matmul.** `gemm_fmt` in `src/ops/kern_avx512.c`, used for `T >= mq_gemm_min_t` (default 8;
`_ops.set_gemm_min_t(t)`, `t <= 0` turns it off; smaller T keep the 4-row tile path; a threshold of 3
was the default for part of 2026-12-03: the thread-time table below favours it at T = 3-4, but on the
real 0.5B model in a quiet window `benchmarks/decode_batch.py` gave B=4 steps of 58-61 ms with the
4-row tile against 65 ms with the GEMM, so 8 stays). Per call each
thread first interleaves the int8 activations of groups of gt tokens (gt = 2 for T <= 2, 4 for
T <= 4, else 8; `[group][k4][token]` u32, zero tokens pad the last group; dx and s as
`[group][chunk][token]`). Then for a tile of 16 weight rows and a K slice of 16 chunks (512 k) the
packed codes are unpacked once into a VNNI tile: per k4 step one 64-byte zmm = 16 rows x 4
consecutive levels, plus per chunk a 16-lane dw and mm vector. The unpack (`gemm_unpack_pair`) puts
each row's pair of chunks in one zmm with the decode path's `unpack_pair`, transposes the 16 rows as a
16 x 16 dword matrix (64 shuffles) and stores 16 zmm; the scales of q3p/q3u/q6 come from one
`vpgatherdd` per chunk over the 16 row headers. (It stored the tile element by element before: 16
scalar stores per row and pair, which made the unpack cost more than the products for a few tokens.)
Micro-kernel, per chunk: 8 k4 steps x (one weight load, gt `vpdpbusd` with a 4-byte activation
broadcast per token) into gt int32 accumulators (16 rows each), then per token
`acc = fma(cvt(isum), dw*dx, acc); acc = fma(mm, s, acc)` (the generic tier's order, chunk by
chunk); accumulators go through a 64-B-aligned scratch between K slices and are written with a
16-lane masked store (N tails; no masked loads anywhere: rows past the tile end get zero levels and
zero dw/mm in the tile). isum stays exact (u8 x s8, q2c levels up to 255; q8 as code ^ 0x80 with
128 x the chunk's activation sum subtracted in integers, so its sums are the exact signed ones, as in
every tier). Threads split N as before (64-row units).

Batched decode (the engine's [B, D] products), single thread, `time.thread_time`, a 512 x 896 tensor
(L2-resident, so this is the compute cost), best of 400 calls, 2026-12-03 (loaded box, two runs):

| T | q3p 4-row tile | q3p GEMM | q6 4-row tile | q6 GEMM |
|---|---:|---:|---:|---:|
| 1 (fused decode) | 20 µs | | 23 µs | |
| 2 | 39 | 37 | 39 | 40 |
| 3 | 48 | 43 | 50 | 49 |
| 4 | 54 | 44 | 62 | 50 |
| 8 | (GEMM) | 60 | (GEMM) | 66 |
| 16 | | 99 | | 106 |

Before the vectorized unpack the GEMM took 69-90 µs at T = 2-8 on the same tensor (it was used for
T >= 8 only): ~18 % less at T = 8, ~40 % less at T = 2-4. A step of 8 sequences costs ~3x a step of
one in these products: the 64 MACs of a `vpdpbusd` are the same work at any T, and T = 1 reads each
weight once while T = 8 multiplies it eight times. What lost: a q3p/q3u micro-kernel that folds
the two chunks of a block (they share one (d, m)) before the scale FMAs, 6 vector ops per pair and
token instead of 8, measured 2-9 % faster on these products (thread-time A/B), but its float order
differs from the generic tier's chunk-by-chunk order, and on the real 0.5B model one batched greedy
token fell 0.105 below the teacher-forced argmax (test_real_pipeline allows 0.05): reverted.

Single-thread matmul, T = 512, GOP/s = 2NKT / *thread CPU time* (`time.thread_time`, `ops.local_threads(1)`;
wall time on the shared box was 2-3x noisier), old 4-row tile vs new, interleaved runs, medians of 5:

| shape N x K | q3p old | q3p new | q6 old | q6 new | q8 old | q8 new | q2c old | q2c new |
|---|---|---|---|---|---|---|---|---|
| 896 x 896 | 162 | 444 | 160 | 446 | 106 | 347 | 160 | 429 |
| 1152 x 896 | 168 | 462 | 161 | 456 | 156 | 414 | 162 | 453 |
| 9728 x 896 | 154 | 535 | 161 | 520 | 137 | 482 | 154 | 509 |
| 896 x 4864 | 162 | 423 | 140 | 366 | 114 | 370 | 144 | 396 |

**Prefill attention** (`ops._attention_blas`, ops.py): blocked causally over 128-query blocks (block
[i0, i1) only scores keys [0, pos0 + i1): ~5/8 of the products and softmax work at pos0 = 0), 2-D
`np.dot` per kv head (always sgemm; the stacked `np.matmul` with a transposed operand was slower).
T = 512, 14/2 heads, BLAS on 1 thread: ~50 -> ~27 ms per layer (medians, loaded box; 9 ms in a quiet
moment). Running the kv heads on Python threads was tried and not measurably faster here (removed).
`silu_mul` of the two halves of the fused gate-up buffer runs row by row in C (`_ops.silu_mul_rows`)
instead of copying both halves (0.5 s of `ascontiguousarray` per pp512 at 1 thread).

**End to end pp512** (Qwen2.5-Coder-0.5B `2356`, 512-token prompt, `last_only=True`, one process,
old/new alternated, load average 6-8 from other jobs on the 2-core box, so absolute numbers are
low and noisy):

| pool threads | before (4-row tile, old attention/SiLU) | after | matmul share after |
|---|---|---|---|
| 1 (`OPENBLAS_NUM_THREADS=1`) | 90 tok/s (runs 90, 95, 77) | **227 tok/s** (248, 227, 166) | 1.67 s of 2.47 s: ~220 GOP/s wall |
| 2 | 74 tok/s (75, 75, 58, 73) | **193 tok/s** (190, 241, 196, 152) | 2.38 s of 3.72 s (profile run) |

GOP/s here = 2 x 358 M matmul MACs x 512 (the 0.5B model without its embedding; lm_head runs for one
token) / time. The 2-thread row is slower than the 1-thread one because both cores were shared with
other jobs (load average ~8): the per-thread CPU-time numbers above (~450-530 GOP/s) put the
matmuls at ~0.4 s per pp512 on two idle cores, so the >= 450 tok/s target needs a quiet re-measure
(`python /tmp`-style A/B: alternate `_ops.set_gemm_min_t(0)` / `(8)` in one process).

Caveat: at `set_num_threads(1)` numpy's BLAS is not limited (by design of `_limit_blas`), and on the
loaded box 2-thread OpenBLAS calls in attention spiked to ~20 ms each (3.3 s of attention per pp512 vs
0.56 s with `OPENBLAS_NUM_THREADS=1`): the 1-thread row is measured with `OPENBLAS_NUM_THREADS=1`.

## Open items

- Prefill attention runs BLAS products per kv head on one thread (causally blocked); a C flash-style
  kernel on the pool would use both cores.
- The lean decode path exists for AVX-512 only; the AVX2 tier keeps one chunk per ymm with the
  whole-rows-ahead prefetch (see the tier table for what that costs on a CPU without AVX-512).
- q8, q4 and q2c decode still use the unpack path (they carry under 5 % of 2356's decode bytes).
- q3p decode after pack3c (~15-18 GB/s per core on cache-resident weights, single thread) is still
  compute-bound against one core's DRAM rate: per block and row it is 3 shuffles + vpdpbusd + ~2 float
  ops, shuffle-port bound. Storing the scales apart from the codes (variant E above) did not help.
- T-MAC lookup was not tried: q3p's levels are a non-linear table, so the bit-plane decomposition
  T-MAC relies on does not apply; a 2-weight table (64 entries of int16 per activation pair) would be
  K x 128 bytes per call, out of L1 for K >= 896. Row repacking (Q4_0x8-style 16 rows x 4 k per zmm,
  the GEMM tile's layout, float work once per 16 rows) was not tried either: it needs a layout with N
  padded to 16 in every tier and in the batched paths. Note the measurement above: interleaving rows
  costs read bandwidth on this machine unless the interleaved rows sit in one contiguous stream, which
  is what a repacked layout gives and a 4-row tile over separate rows does not.
- q6 with short rows (K = 896: the 0.5B attention and lm_head, ~45 % of 2356's decode bytes) still
  runs the unpack path. `mv_q6f` (mv_lean's q6 unpack + mv_q3c's 4-row float fold) is built and tested
  but opt-in (`MIXQRT_Q6_FOLD=1`, `_ops.set_q6_fold`): 1.2-1.5x the unpack path in thread CPU time at
  1 thread (1152 x 896 13.0-15.7 -> 18.7-19.4 GB/s, 151936 x 896 7.4-9.4 -> 9.4-11.1), but end to end
  on the 0.5B 2356 decode it lost, alternated in one process (5 rounds of 24 tokens, load average ~9):
  best 13.8 vs 16.2 tok/s at 1 thread, 9.8 vs 11.2 at 2 threads; like mv_lean before it, 4 row streams
  of short DRAM rows read slower than the unpack path's 2. In the same run the q3p kernel (mv_q3c)
  beat q3p through the 2-row unpack path (also pack3c): 16.2 vs 14.7 and 11.2 vs 11.0 tok/s.
- f32 decode: mixqrt's one-row AVX-512 loop vs llama.cpp's F32 is in the llama.cpp table of each run;
  the 4-row variant lost (above).

"""


if __name__ == "__main__":
    main()
