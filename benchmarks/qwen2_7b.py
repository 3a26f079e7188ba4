"""Qwen2-7B at full size: synthetic checkpoint -> quantize (2356, q8, q4) -> bench -> docs/lab/qwen2-7b.md's tables.

    python benchmarks/qwen2_7b.py                       # everything; finished steps are reused
    python benchmarks/qwen2_7b.py --redo bench --n-gen 16
    python benchmarks/qwen2_7b.py --doc-only            # redo docs/lab/qwen2-7b.md's tables from results.json
    python benchmarks/qwen2_7b.py --delete-checkpoint   # remove the 15 GB folder at the end

Work files live in --work (default /tmp/mixqrt-7b): the checkpoint folder, one .mxq per recipe, a
log per step and results.json (each step's measurements; a step already there is skipped unless
named in --redo). Every heavy step runs in its own subprocess so its peak RSS (wait4's ru_maxrss),
CPU time and wall time belong to that step alone; a sampler reads /proc/PID/status every 0.2 s to
split the resident set into anonymous memory (what the process allocated) and file pages (mmapped
checkpoint or .mxq pages, which the kernel can drop under pressure).

Only the tables between the page's `mixqrt:qwen7b-*` markers are generated (benchmarks/_common.update_doc);
the text around them is written by hand. results.json is also copied to docs/data/qwen2-7b.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "benchmarks")]

import mixqrt.testing.synthetic as sc  # noqa: E402
from _common import gguf_decode_bytes, last_json as _last_json, update_doc, write_json  # noqa: E402

RECIPES = ("2356", "q8", "q4")
ARTICLE_ROWS = {   # the article's Qwen2-7B table (docs/design.md; Xeon Silver 4310, 64 GB DDR4-2666)
    "f16": {"label": "FP16 original", "size": "13.8 GB", "ttft": "OOM", "ppl": "-", "cpu": "-", "temp": "-"},
    "q8": {"label": "INT8 uniform", "size": "3.4 GB", "ttft": "4280", "ppl": "12.7", "cpu": "100", "temp": "95"},
    "2356": {"label": "2356 mixed", "size": "2.7 GB", "ttft": "1790", "ppl": "9.2", "cpu": "82", "temp": "78"},
    "q4": {"label": "4-bit uniform", "size": "1.8 GB", "ttft": "2150", "ppl": "15.3", "cpu": "98", "temp": "89"},
}
PIPE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import mixqrt
pipe = mixqrt.Pipeline(sys.argv[1], progress=False)
t_load = time.perf_counter() - t0
msgs = [{"role": "user", "content": "Explain in one paragraph why decode speed on a CPU is bound by memory bandwidth."}]
t = time.perf_counter()
first, pieces, last = None, [], None
for r in pipe.stream(msgs, max_new_tokens=int(sys.argv[2]), temperature=0):
    if first is None:
        first = time.perf_counter() - t
    pieces.append(r.text)
    last = r
print(json.dumps({"load_s": t_load, "first_piece_s": first, "total_s": time.perf_counter() - t,
                  "prompt_tokens": last.prompt_tokens, "generated_tokens": last.generation_tokens,
                  "ttft_s": last.ttft_s, "gen_tps": last.generation_tps, "finish_reason": last.finish_reason,
                  "text": "".join(pieces)}))
"""


# -- measuring a subprocess --------------------------------------------------------------------

def _status(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def build_id() -> dict:
    """Which code a measurement ran: HEAD, whether the tree is dirty, and when the kernels were built
    (other engineers rebuild them while this runs)."""
    out = {}
    try:
        out["head"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                                     text=True).stdout.strip()
        out["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                                           capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    sos = list((_ROOT / "mixqrt" / "_kernels").glob("_ops*.so"))
    if sos:
        out["ops_so_built"] = time.strftime("%H:%M:%S", time.gmtime(sos[0].stat().st_mtime))
    return out


def run_measured(cmd: list[str], log: Path, *, watch: Path | None = None, env=None) -> dict:
    """Run cmd; stdout is returned, stderr goes to log. Peak RSS from wait4, anon/file split sampled."""
    load0, started = os.getloadavg()[0], time.strftime("%H:%M:%S")
    t0 = time.perf_counter()
    with open(log, "w") as err, open(log.with_suffix(".out"), "w+") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=_ROOT)
        peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        early, temps = [], set()
        done = threading.Event()

        def sample():
            while not done.is_set():
                s = _status(p.pid)
                for k in peaks:
                    peaks[k] = max(peaks[k], s.get(k, 0))
                if watch is not None:
                    if watch.exists() and not early:
                        early.append((time.perf_counter() - t0, watch.stat().st_size))
                    temps.update(q.name for q in watch.parent.glob(f".{watch.name}.*"))
                done.wait(0.2)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read()
    cpu = ru.ru_utime + ru.ru_stime
    # 1-minute load average before and at the end: other jobs on this shared machine steal cores
    return {"cmd": " ".join(cmd), "rc": p.returncode, "build": build_id(), "started": started,
            "loadavg": [load0, os.getloadavg()[0]], "wall_s": wall, "cpu_s": cpu,
            "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "max_rss_bytes": ru.ru_maxrss * 1024,
            "peak_anon_bytes": peaks["RssAnon"], "peak_file_bytes": peaks["RssFile"],
            "major_faults": ru.ru_majflt, "stdout": stdout,
            "output_seen_while_running": early[0] if early else None, "temps_seen": sorted(temps)}


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -- steps -------------------------------------------------------------------------------------

def step_checkpoint(work: Path, res: dict, log) -> Path:
    ck = work / "qwen2-7b-synthetic"
    if sc.is_complete(ck):
        res.setdefault("checkpoint", {})["path"] = str(ck)
    else:
        log(f"writing the synthetic checkpoint to {ck} (~15 GB)")
        r = run_measured([sys.executable, str(_ROOT / "benchmarks" / "synthetic_checkpoint.py"), "--out", str(ck)],
                         work / "checkpoint.log")
        if r["rc"] != 0:
            raise SystemExit(f"checkpoint generation failed:\n{_tail(work / 'checkpoint.log')}")
        r.pop("stdout")
        res["checkpoint"] = dict(r, path=str(ck))
    files = sorted(ck.glob("model-*.safetensors"))
    res["checkpoint"].update(bytes=sum(p.stat().st_size for p in files), shards=len(files),
                             params=sum(sc._nvalues(s) for _, s, _ in sc.tensor_specs(sc.QWEN2_7B_CONFIG)))
    return ck


def step_quantize(ck: Path, work: Path, recipe: str, res: dict, log) -> None:
    out = work / f"qwen2-7b-{recipe}.mxq"
    if out.exists():
        out.unlink()
    log(f"quantize {recipe} -> {out}")
    r = run_measured([sys.executable, "-m", "mixqrt", "quantize", str(ck), "--recipe", recipe, "-o", str(out),
                      "--json", "-q"], work / f"quantize-{recipe}.log", watch=out)
    rep = _last_json(r.pop("stdout"))
    r["log_tail"] = _tail(work / f"quantize-{recipe}.log") if r["rc"] else ""
    if r["rc"] == 0 and out.exists():
        leftovers = [p.name for p in work.glob(f".{out.name}.*")]
        r.update(ok=True, path=str(out), file_bytes=out.stat().st_size,
                 tensor_bytes=rep.get("total_bytes") if rep else None,
                 bits_per_weight=rep.get("bits_per_weight") if rep else None,
                 by_role=rep.get("by_role") if rep else None, temp_leftovers=leftovers)
        # atomic: written under a temporary name, and the final name, if seen before exit, already whole
        seen = r["output_seen_while_running"]
        r["atomic"] = bool(r["temps_seen"]) and not leftovers and (seen is None or seen[1] == r["file_bytes"])
    else:
        r["ok"] = False
    res.setdefault("quantize", {})[recipe] = r


def step_dry_run(ck: Path, recipe: str, res: dict) -> None:
    from mixqrt.quantize.convert import quantize_model
    rep = quantize_model(str(ck), recipe, None, progress=False, dry_run=True)
    res.setdefault("dry_run", {})[recipe] = {"tensor_bytes": rep.total_bytes, "bits_per_weight": rep.bits_per_weight}


def step_bench(work: Path, recipe: str, threads: int, res: dict, a, log) -> None:
    mxq = work / f"qwen2-7b-{recipe}.mxq"
    log(f"bench {recipe} -t {threads} -p {a.n_prompt} -n {a.n_gen} -r {a.reps}")
    r = run_measured([sys.executable, "-m", "mixqrt", "bench", str(mxq), "-t", str(threads), "-p", str(a.n_prompt),
                      "-n", str(a.n_gen), "-r", str(a.reps), "--json", "-q"],
                     work / f"bench-{recipe}-t{threads}.log")
    row = _last_json(r.pop("stdout"))
    r["log_tail"] = _tail(work / f"bench-{recipe}-t{threads}.log") if r["rc"] else ""
    r.update(ok=r["rc"] == 0 and isinstance(row, dict), row=row if isinstance(row, dict) else None,
             threads=threads, cpu_util=r["cpu_s"] / r["wall_s"] / threads)
    res.setdefault("bench", {}).setdefault(recipe, {})[str(threads)] = r


def step_pipeline(work: Path, recipe: str, res: dict, a, log) -> None:
    mxq = work / f"qwen2-7b-{recipe}.mxq"
    log(f"Pipeline({mxq}).stream, {a.pipe_tokens} tokens")
    r = run_measured([sys.executable, "-c", PIPE_SCRIPT, str(mxq), str(a.pipe_tokens)],
                     work / f"pipeline-{recipe}.log")
    out = _last_json(r.pop("stdout"))
    r["log_tail"] = _tail(work / f"pipeline-{recipe}.log") if r["rc"] else ""
    r.update(ok=r["rc"] == 0 and isinstance(out, dict), result=out)
    res.setdefault("pipeline", {})[recipe] = r


# -- llama.cpp on the same weights (stretch) ---------------------------------------------------

def write_base_gguf(ck: Path, out: Path, qtype: str = "F16", tok_gguf: Path | None = None) -> None:
    """The checkpoint as llama.cpp's converter writes it (F16 or Q8_0 matrices, F32 vectors), streamed: the
    header and tensor table first, then one tensor at a time; the tokenizer metadata comes from a Qwen GGUF."""
    import gguf
    import numpy as np

    from mixqrt.io import open_source
    from mixqrt.io.gguf import GGUFSource, add_config_to_gguf, hf_to_gguf_name

    from mixqrt.testing import model_path
    tsrc = GGUFSource(tok_gguf or model_path("qwen"))       # the Qwen tokenizer: the test model's
    meta = tsrc.metadata
    src = open_source(ck)
    cfg = src.config
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_name("Qwen2-7B-synthetic")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "F16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    add_config_to_gguf(w, cfg)
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    for i in range(len(tokens), cfg["vocab_size"]):          # padding rows, as the converter adds
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "qwen2"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([str(m) for m in meta["tokenizer.ggml.merges"]])
    w.add_bos_token_id(151643)
    w.add_eos_token_id(151645)
    w.add_pad_token_id(151643)
    w.add_add_bos_token(False)
    w.add_chat_template(sc.QWEN2_CHATML)
    plan = []
    for name, shape, _ in sc.tensor_specs(cfg):
        g = hf_to_gguf_name(name)
        if len(shape) == 1:
            kind = "F32"
            w.add_tensor_info(g, shape, np.dtype(np.float32), 4 * shape[0])
        elif qtype == "F16":
            kind = "F16"
            w.add_tensor_info(g, shape, np.dtype(np.float16), 2 * sc._nvalues(shape))
        else:
            kind = "Q8_0"
            bshape = (shape[0], shape[1] // 32 * 34)       # gguf takes a quantized tensor's byte shape
            w.add_tensor_info(g, bshape, np.dtype(np.uint8), bshape[0] * bshape[1],
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        plan.append((name, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind in plan:
        a = src.get(name)
        if kind == "Q8_0":
            a = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        w.write_tensor_data(a.astype(np.float16 if kind == "F16" else np.float32) if kind != "Q8_0" else a)
        del a
    w.close()
    src.close()
    os.replace(tmp, out)


def lcpp_quantize(inp: Path, out: Path, ftype: str) -> None:
    import ctypes

    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = os.cpu_count() or 2
    p.allow_requantize = True
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(tmp).encode(), ctypes.byref(p))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    os.replace(tmp, out)


def lcpp_bench(path: Path, threads: int, n_prompt: int, n_gen: int) -> dict:
    """TTFT (eval of an n_prompt-token prompt + argmax) and greedy decode tokens/s with llama-cpp-python."""
    import numpy as np
    from llama_cpp import Llama
    t = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=n_prompt + n_gen + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=n_prompt, use_mmap=True, verbose=False, logits_all=False)
    load = time.perf_counter() - t
    prompt = np.random.default_rng(0).integers(100, 30000, size=n_prompt).tolist()
    nv = llm.n_vocab()

    def last_argmax():          # the last row's logits (llm.scores is only filled with logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))))

    llm.eval(prompt[:16])                                    # warm-up: page the weights in
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    tok = last_argmax()
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_gen):
        llm.eval([tok])
        tok = last_argmax()
    tg = n_gen / (time.perf_counter() - t)
    return {"threads": threads, "load_s": load, "ttft_s": ttft, "pp_tok_s": n_prompt / ttft, "tg_tok_s": tg,
            "n_prompt": n_prompt, "n_gen": n_gen}


def step_llamacpp(ck: Path, work: Path, res: dict, a, threads, redo, log) -> None:
    lr = res.setdefault("llamacpp", {})
    f16 = work / f"qwen2-7b-synthetic-{a.lcpp_base}.gguf"
    me = [sys.executable, str(Path(__file__).resolve())]
    if not f16.exists() or "llamacpp" in redo:
        log(f"writing {f16} ({a.lcpp_base} GGUF, streamed)")
        r = run_measured(me + ["--internal", "gguf-base", str(ck), str(f16), a.lcpp_base], work / "lcpp-base.log")
        r.pop("stdout")
        lr["base"] = dict(r, type=a.lcpp_base, ok=r["rc"] == 0 and f16.exists(), file_bytes=f16.stat().st_size if f16.exists() else None)
    for ft in ("Q3_K_M", "Q2_K"):
        out = work / f"qwen2-7b-synthetic-{ft}.gguf"
        have = lr.get(ft, {})
        if f16.exists() and (not out.exists() or "llamacpp" in redo):
            log(f"llama_model_quantize {ft}")
            r = run_measured(me + ["--internal", "lcpp-quantize", str(f16), str(out), ft], work / f"lcpp-{ft}.log")
            r.pop("stdout")
            have = lr[ft] = dict(r, ok=r["rc"] == 0 and out.exists(),
                                 file_bytes=out.stat().st_size if out.exists() else None, bench={})
        if not out.exists():
            continue
        for t in threads:
            if not have.get("bench", {}).get(str(t), {}).get("ok") or "llamacpp" in redo:
                log(f"llama-cpp-python bench {ft} -t {t}")
                r = run_measured(me + ["--internal", "lcpp-bench", str(out), str(t), str(a.n_prompt), str(a.n_gen)],
                                 work / f"lcpp-bench-{ft}-t{t}.log")
                row = _last_json(r.pop("stdout"))
                r.update(ok=r["rc"] == 0 and isinstance(row, dict), row=row, cpu_util=r["cpu_s"] / r["wall_s"] / t,
                         log_tail=_tail(work / f"lcpp-bench-{ft}-t{t}.log") if r["rc"] else "")
                have.setdefault("bench", {})[str(t)] = r


def _internal(argv) -> int:
    what, rest = argv[0], argv[1:]
    if what == "gguf-base":
        write_base_gguf(Path(rest[0]), Path(rest[1]), rest[2])
    elif what == "lcpp-quantize":
        lcpp_quantize(Path(rest[0]), Path(rest[1]), rest[2])
    elif what == "lcpp-bench":
        print(json.dumps(lcpp_bench(Path(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))))
    return 0


def machine() -> dict:
    info = {"cpu": "?", "cores": os.cpu_count(), "mem_gb": None, "python": platform.python_version()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    try:
        from mixqrt.commands.doctor import report
        d = report()
        info["isa"] = d.get("isa") or d.get("isa_tier")
    except Exception as e:       # the doctor is nice to have, not needed
        info["isa"] = f"? ({type(e).__name__})"
    return info


# -- the document ------------------------------------------------------------------------------

def _gb(n):
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def _row(res, rec, t):
    b = res.get("bench", {}).get(rec, {}).get(str(t), {})
    return b.get("row") if b.get("ok") else None


def _pair(res, rec, key, fmt, threads=(1, 2), scale=1.0):
    vals = []
    for t in threads:
        r = _row(res, rec, t)
        vals.append("-" if r is None or r.get(key) is None else fmt.format(r[key] * scale))
    return " / ".join(vals)


def _bench(res, rec, t) -> dict:
    return res.get("bench", {}).get(rec, {}).get(str(t), {})


def _run_block(res) -> list[str]:
    m, ck, st = res.get("machine", {}), res.get("checkpoint", {}), res.get("settings", {})
    L = [f"- **Date:** {st.get('date', '?')}; **command:** `{st.get('command', '?')}`",
         f"- **Machine:** {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('mem_gb', '?')} GB RAM, "
         f"mixqrt ISA tier `{m.get('isa', '?')}`, Python {m.get('python', '?')}",
         f"- **Bench:** `mixqrt bench MODEL -t T -p {st.get('n_prompt', '?')} -n {st.get('n_gen', '?')} "
         f"-r {st.get('reps', '?')}`, one process per thread count; TTFT on a {min(128, st.get('n_prompt', 128))}-token prompt",
         f"- **Checkpoint:** {ck.get('shards', '?')} safetensors shards, {_gb(ck.get('bytes'))}"
         + (f", written in {ck['wall_s']:.0f} s at a peak RSS of {ck['max_rss_bytes'] / 2**20:.0f} MiB"
            if ck.get("wall_s") else "")]
    return L


def _article_block(res) -> list[str]:
    q, dr = res.get("quantize", {}), res.get("dry_run", {})
    L = ["| scheme | size (article) | size (measured .mxq) | bits/weight | TTFT ms (article) | TTFT ms (measured) | "
         "decode tok/s | peak RSS GB | CPU % (article) | CPU % (measured) | PPL (article) | PPL | temp C (article) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
         f"| FP16 original / f32 | 13.8 GB | f16 {_gb(dr.get('f16', {}).get('tensor_bytes'))}, f32 "
         f"{_gb(dr.get('f32', {}).get('tensor_bytes'))} (planned, not written) | 16 / 32 | OOM | not run | - | - | - | "
         "- | - | n/a | - |"]
    for rec in ("q8", "2356", "q4"):
        sd, qr = ARTICLE_ROWS[rec], q.get(rec, {})
        cpu, rss = [], []
        for t in (1, 2):
            b = _bench(res, rec, t)
            cpu.append(_f(100 * b["cpu_util"], "{:.0f}") if b.get("ok") else "-")
            # the bench row's peak (VmHWM reset after the bandwidth probe's 1 GiB buffer is freed);
            # wait4's ru_maxrss would count that buffer too
            peak = (b.get("row") or {}).get("peak_rss_bytes") or b.get("max_rss_bytes")
            rss.append(_f(peak / 1e9, "{:.2f}") if b.get("ok") else "-")
        L.append(f"| {sd['label']} (`{rec}`) | {sd['size']} | {_gb(qr.get('file_bytes')) if qr.get('ok') else 'failed'} | "
                 f"{_f(qr.get('bits_per_weight'), '{:.2f}')} | {sd['ttft']} | "
                 f"{_pair(res, rec, 'ttft_s', '{:.0f}', scale=1000)} | {_pair(res, rec, 'tg_tok_s', '{:.2f}')} | "
                 f"{' / '.join(rss)} | {sd['cpu']} | {' / '.join(cpu)} | {sd['ppl']} | n/a (synthetic) | {sd['temp']} |")
    return L


def _bandwidth_block(res) -> list[str]:
    L = ["| scheme | threads | bytes/token | read bandwidth | bound tok/s | measured tok/s | ratio | >= 0.6? | "
         "prefill tok/s | CPU % | load avg start/end | started | kernels built |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in ("q8", "2356", "q4"):
        for t in (1, 2):
            r = _row(res, rec, t)
            if r is None:
                continue
            b = _bench(res, rec, t)
            bound = r["read_bandwidth_bytes_s"] / r["decode_bytes_per_token"]
            L.append(f"| `{rec}` | {t} | {_gb(r['decode_bytes_per_token'])} | {r['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s | "
                     f"{bound:.2f} | {r['tg_tok_s']:.2f} | {r['bandwidth_ratio']:.2f} | "
                     f"{'yes' if r['bandwidth_ratio'] >= 0.6 else '**no**'} | {r['pp_tok_s']:.1f} | "
                     f"{100 * b['cpu_util']:.0f} | {b['loadavg'][0]:.1f} / {b['loadavg'][1]:.1f} | "
                     f"{b.get('started', '?')} | {b.get('build', {}).get('ops_so_built', '?')} |")
    return L


def _quantize_block(res) -> list[str]:
    L = ["| recipe | started | wall s | CPU s | peak RSS GB | peak anon GB | peak file GB | output | bits/weight | "
         "atomic | RSS < 6 GB? | load avg start/end |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec, qr in res.get("quantize", {}).items():
        if not qr.get("ok"):
            L.append(f"| `{rec}` | {qr.get('started', '?')} | {qr.get('wall_s', 0):.0f} | - | - | - | - | "
                     f"**failed (rc {qr.get('rc')})** | - | - | - | - |")
            continue
        la = qr.get("loadavg")
        L.append(f"| `{rec}` | {qr.get('started', '?')} | {qr['wall_s']:.0f} | {qr['cpu_s']:.0f} | "
                 f"{qr['max_rss_bytes'] / 1e9:.2f} | {qr['peak_anon_bytes'] / 1e9:.2f} | {qr['peak_file_bytes'] / 1e9:.2f} | "
                 f"{_gb(qr['file_bytes'])} | {_f(qr.get('bits_per_weight'), '{:.3f}')} | "
                 f"{'yes' if qr.get('atomic') else '**no**'} | {'yes' if qr['max_rss_bytes'] < 6e9 else '**no**'} | "
                 f"{f'{la[0]:.1f} / {la[1]:.1f}' if la else '-'} |")
    return L


def _by_role_block(res) -> list[str]:
    br = res.get("quantize", {}).get("2356", {}).get("by_role")
    if not br:
        return ["Not measured."]
    L = ["| role | formats | params | bytes | bits/weight |", "|---|---|---|---|---|"]
    for role, v in sorted(br.items(), key=lambda kv: -kv[1]["bytes"]):
        L.append(f"| {role} | {','.join(v['formats'])} | {v['params']:,} | {v['bytes']:,} | {v['bpw']:.3f} |")
    return L


def _pipeline_block(res) -> list[str]:
    pr = res.get("pipeline", {}).get("2356", {})
    if not pr.get("ok"):
        return ["Not run or failed: " + (pr.get("log_tail") or "no result").replace("\n", " ")[:600]]
    o = pr["result"]
    return ["| load s | prompt tokens | first piece s | ttft_s | tokens | total s | tok/s after the first | "
            "peak RSS GB | peak anon GB |", "|---|---|---|---|---|---|---|---|---|",
            f"| {o['load_s']:.2f} | {o['prompt_tokens']} | {o['first_piece_s']:.2f} | {o['ttft_s']:.2f} | "
            f"{o['generated_tokens']} | {o['total_s']:.2f} | {o['gen_tps']:.2f} | {pr['max_rss_bytes'] / 1e9:.2f} | "
            f"{pr['peak_anon_bytes'] / 1e9:.2f} |"]


def _llamacpp_block(res) -> list[str]:
    lr = res.get("llamacpp")
    if not lr:
        return ["Not run (`--llamacpp`)."]
    f = lr.get("base", {})
    L = [f"- {f.get('type')} GGUF: {_gb(f.get('file_bytes'))}, written in {f.get('wall_s', 0):.0f} s, peak RSS "
         f"{f.get('max_rss_bytes', 0) / 1e9:.2f} GB (anonymous {f.get('peak_anon_bytes', 0) / 1e9:.2f} GB).", ""] if f else []
    L += ["| llama.cpp type | file | bytes/token | quantize s | quantize peak RSS GB | TTFT ms (1t / 2t) | "
          "decode tok/s (1t / 2t) | bandwidth ratio (1t / 2t) | bench peak RSS GB |", "|---|---|---|---|---|---|---|---|---|"]
    for ft in ("Q3_K_M", "Q2_K"):
        e = lr.get(ft)
        if not e:
            continue
        bench, bpt = e.get("bench", {}), e.get("decode_bytes")

        def per_t(key, fmt, scale=1.0, row=True):
            out = []
            for t in (1, 2):
                b = bench.get(str(t), {})
                out.append(fmt.format((b["row"] if row else b)[key] * scale) if b.get("ok") else "-")
            return " / ".join(out)
        ratio = []
        for t in (1, 2):
            mine, b = _row(res, "2356", t), bench.get(str(t), {})
            ratio.append(f"{b['row']['tg_tok_s'] * bpt / mine['read_bandwidth_bytes_s']:.2f}"
                         if bpt and mine and b.get("ok") else "-")
        L.append(f"| {ft} | {_gb(e.get('file_bytes'))} | {_gb(bpt) if bpt else '-'} | {e.get('wall_s', 0):.0f} | "
                 f"{e.get('max_rss_bytes', 0) / 1e9:.2f} | {per_t('ttft_s', '{:.0f}', 1000)} | "
                 f"{per_t('tg_tok_s', '{:.2f}')} | {' / '.join(ratio)} | "
                 f"{per_t('max_rss_bytes', '{:.2f}', 1e-9, row=False)} |")
    return L


def _dry_run_block(res) -> list[str]:
    dr = res.get("dry_run", {})
    return ["| recipe | tensor bytes (`mixqrt quantize --dry-run`) |", "|---|---|"] + [
        f"| `{rec}` | {_gb(dr.get(rec, {}).get('tensor_bytes'))} |" for rec in ("f16", "f32")]


def _commands_block(res) -> list[str]:
    q, st = res.get("quantize", {}), res.get("settings", {})
    # WORK: the --work folder (a scratch path a reader cannot follow, so the page names it by role)
    L = ["```", "python benchmarks/synthetic_checkpoint.py --out WORK/qwen2-7b-synthetic"]
    L += [f"python -m mixqrt quantize WORK/qwen2-7b-synthetic --recipe {rec} -o WORK/qwen2-7b-{rec}.mxq"
          for rec in q]
    L += [f"python -m mixqrt bench WORK/qwen2-7b-{rec}.mxq -t 1 -p {st.get('n_prompt')} -n {st.get('n_gen')} "
          f"-r {st.get('reps')}   # and -t 2" for rec in q]
    L.append("python benchmarks/qwen2_7b.py      # all of the above + this page's tables")
    if res.get("llamacpp"):
        L.append("python benchmarks/qwen2_7b.py --llamacpp   # + the Q8_0 GGUF, llama.cpp Q3_K_M / Q2_K and their bench")
    return L + ["```"]


def doc_blocks(res: dict) -> dict[str, str]:
    """The generated tables of docs/lab/qwen2-7b.md, by marker name (the prose around them is hand-written)."""
    parts = {"qwen7b-run": _run_block, "qwen7b-article": _article_block, "qwen7b-bandwidth": _bandwidth_block,
             "qwen7b-quantize": _quantize_block, "qwen7b-by-role": _by_role_block, "qwen7b-pipeline": _pipeline_block,
             "qwen7b-llamacpp": _llamacpp_block, "qwen7b-dry-run": _dry_run_block, "qwen7b-commands": _commands_block}
    return {name: "\n".join(fn(res)) for name, fn in parts.items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--internal"]:
        return _internal(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/mixqrt-7b")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n-prompt", type=int, default=128, help="bench prompt tokens (TTFT is for min(128, this))")
    ap.add_argument("--n-gen", type=int, default=16, help="bench decode tokens (small: 7B on 2 cores is slow)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--pipe-tokens", type=int, default=8)
    ap.add_argument("--redo", default="", help="comma list of steps to rerun: quantize,bench,pipeline,dry_run")
    ap.add_argument("--skip", default="", help="comma list of steps to skip")
    ap.add_argument("--doc", default=str(_ROOT / "docs" / "lab" / "qwen2-7b.md"))
    ap.add_argument("--doc-only", action="store_true")
    ap.add_argument("--delete-checkpoint", action="store_true", help="remove the 15 GB checkpoint at the end")
    ap.add_argument("--llamacpp", action="store_true",
                    help="stretch: F16 GGUF of the same weights, llama.cpp Q3_K_M / Q2_K, llama-cpp-python bench")
    ap.add_argument("--lcpp-base", default="Q8_0", choices=("F16", "Q8_0"),
                    help="GGUF written from the checkpoint and requantized by llama.cpp (Q8_0: half the disk)")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rpath = work / "results.json"
    res = json.loads(rpath.read_text()) if rpath.exists() else {}
    redo, skip = set(filter(None, a.redo.split(","))), set(filter(None, a.skip.split(",")))
    recipes = [r for r in a.recipes.split(",") if r]
    threads = [int(t) for t in a.threads.split(",") if t]

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def save():
        tmp = rpath.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2, default=str))
        os.replace(tmp, rpath)

    if not a.doc_only:
        res["machine"] = machine()
        ck = step_checkpoint(work, res, log)
        save()
        if "dry_run" not in skip:
            for rec in ("f32", "f16"):
                if redo & {"dry_run"} or rec not in res.get("dry_run", {}):
                    step_dry_run(ck, rec, res)
            save()
        for rec in recipes:
            have = res.get("quantize", {}).get(rec, {})
            if "quantize" not in skip and ("quantize" in redo or not have.get("ok")
                                           or not (work / f"qwen2-7b-{rec}.mxq").exists()):
                step_quantize(ck, work, rec, res, log)
                save()
                res.get("bench", {}).pop(rec, None)         # a new file invalidates its bench rows
                res.get("pipeline", {}).pop(rec, None)
            if not res["quantize"].get(rec, {}).get("ok"):
                log(f"quantize {rec} failed; see {work}/quantize-{rec}.log")
                continue
            if "bench" not in skip:
                for t in threads:
                    if "bench" in redo or not res.get("bench", {}).get(rec, {}).get(str(t), {}).get("ok"):
                        step_bench(work, rec, t, res, a, log)
                        save()
            if "pipeline" not in skip and rec == "2356":
                if "pipeline" in redo or not res.get("pipeline", {}).get(rec, {}).get("ok"):
                    step_pipeline(work, rec, res, a, log)
                    save()
        if a.llamacpp:
            step_llamacpp(ck, work, res, a, threads, redo, log)
            save()
        res["settings"] = {"n_prompt": a.n_prompt, "n_gen": a.n_gen, "reps": a.reps, "pipe_tokens": a.pipe_tokens,
                           "date": time.strftime("%Y-%m-%d %H:%M"),
                           "command": " ".join(["python", "benchmarks/qwen2_7b.py"] + list(sys.argv[1:] if argv is None else argv))}
        save()
    for ft, e in res.get("llamacpp", {}).items():      # bytes per decode step of each llama.cpp file
        if isinstance(e, dict) and ft != "base" and not e.get("decode_bytes"):
            e["decode_bytes"] = gguf_decode_bytes(work / f"qwen2-7b-synthetic-{ft}.gguf")
    save()
    data = _ROOT / "docs" / "data" / (Path(a.doc).stem + ".json")
    write_json(data, res)
    update_doc(a.doc, doc_blocks(res), title="Qwen2-7B at full size on 2 cores")
    log(f"wrote the tables of {a.doc} and {data}")
    if a.delete_checkpoint:
        import shutil
        shutil.rmtree(work / "qwen2-7b-synthetic", ignore_errors=True)
        log("deleted the synthetic checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
