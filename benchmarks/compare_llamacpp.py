"""mixqrt against llama.cpp: same model, same text, same machine, same thread count, one run.

Updates the tables of docs/results.md (between its `mixqrt:results-*` markers; the prose around them is
written by hand), writes the raw results to docs/data/results.json and the plot to docs/results.png (PPL
against model bytes). Every measurement runs in its own child process (`--worker SYSTEM --task TASK`, one
JSON line on stdout), so peak RSS is per system and a crash costs one row, not the run.

    python benchmarks/compare_llamacpp.py                       # all systems, 8 chunks, 2 threads
    python benchmarks/compare_llamacpp.py --chunks 1 --systems mixqrt:f32,llamacpp:F32 --no-speed
    python benchmarks/compare_llamacpp.py --extra-recipe 2356:imatrix=/tmp/imat.dat --extra-recipe auto:budget_bytes=330e6
    python benchmarks/compare_llamacpp.py --extra-recipe "2356t:calibrate=self+$T:damp=0.1"  # GPTQ-calibrated
    python benchmarks/compare_llamacpp.py --report-only         # rebuild the report from the cache

Systems are `mixqrt:RECIPE[:key=value...]` (key=value pairs go to quantize_model or get_recipe,
whichever takes that keyword; RECIPE may also be a path to a ready .mxq) and `llamacpp:TYPE`.
Results are cached per task in /tmp/mixqrt-compare/results/, keyed by system, settings, file
identities and a hash of the mixqrt sources and built extensions; an interrupted run resumes where it
stopped, `--fresh` measures everything again. Perplexity is mixqrt.commands.evaluate.perplexity for both
systems (llama.cpp's logits are fed through a logits_fn), KL is against mixqrt f32's saved log-probs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixqrt.quantize.recipes import DEFAULT_RECIPE  # noqa: E402
from _common import (CpuMeter, ROOT, file_id, machine_info, peak_rss_bytes, tree_hash,  # noqa: E402
                     update_doc, write_json)

DEFAULT_TEXT = str(Path(__file__).resolve().parents[1] / "tests" / "data" / "wikitext-2-test.txt")
MIXQRT_RECIPES = ["f32", "q8", "q4", "q4a", "2356t", "2356", "2356-q3u", "2356-q8embed", "2356-f32norm", "2356-bound"]
LCPP_FTYPES = {"F32": 0, "Q8_0": 7, "Q6_K": 18, "Q4_K_M": 15, "Q3_K_M": 12, "Q2_K": 10}
RECIPE_NOTES = {"f32": "reference", "q8": "INT8 uniform", "q4": "4-bit uniform", "2356": "the 2356 mix",
                "q4a": "the default: every-matrix-q4 bytes, placed per tensor by the measured sensitivity",
                "2356a": "2356t's bytes, placed per tensor by the measured sensitivity",
                "2356t": "2356 with the tied embedding stored once (q4) and 2356c's FFN",
                "2356-q3u": "ablation: uniform q3u FFN instead of q3p", "2356-q8embed": "ablation: q8 embedding",
                "2356-f32norm": "ablation: f32 norms instead of q5g", "2356-bound": "ablation: one global q5g range",
                "2356-minmax": "ablation: plain min/max quantizer, no error-minimising search",
                "2356-norot": "ablation: no Hadamard rotation (the 2356 of 2026-12-02)"}
BASE = "mixqrt:f32"
GOAL_KEYS = ("mixqrt:2356", "mixqrt:" + DEFAULT_RECIPE)   # goals are checked for these and every --extra-recipe
QUANT_CODE = ("mixqrt/quantize", "mixqrt/formats", "mixqrt/io", "mixqrt/generation/tokenizer.py", "mixqrt/_kernels/src/quant",
              "mixqrt/_kernels/_quant.pyx")


# ----------------------------------------------------------------------------------- systems
@dataclass(frozen=True)
class System:
    kind: str                 # "mixqrt" | "llamacpp" | "machine"
    name: str                 # recipe, .mxq path, or llama.cpp type
    opts: tuple = ()          # (("imatrix", "/path"), ...) for mixqrt variants
    extra: bool = False       # given by --extra-recipe

    @property
    def key(self) -> str:
        return ":".join([self.kind, self.name] + [f"{k}={v}" for k, v in self.opts])

    @property
    def label(self) -> str:
        if self.kind == "llamacpp":
            return f"llama.cpp {self.name}"
        name = Path(self.name).stem if self.name.endswith(".mxq") else self.name
        return name + "".join(f"+{k}({'+'.join(Path(x).name for x in v.split('+'))})" for k, v in self.opts)


def parse_system(text: str, extra: bool = False) -> System:
    """'mixqrt:2356', 'mixqrt:2356:imatrix=/x.dat', 'llamacpp:Q4_K_M' (also 'llama.cpp:', 'lcpp:')."""
    text = text.strip()
    if text in ("machine", "machine:bandwidth"):
        return System("machine", "bandwidth")
    kind, _, rest = text.partition(":")
    kind = {"llama.cpp": "llamacpp", "lcpp": "llamacpp", "mxq": "mixqrt"}.get(kind.lower(), kind.lower())
    if kind not in ("mixqrt", "llamacpp") or not rest:
        raise ValueError(f"system {text!r} must look like mixqrt:RECIPE[:key=value...] or llamacpp:TYPE")
    if kind == "llamacpp":
        typ = rest.upper()
        if typ not in LCPP_FTYPES:
            raise ValueError(f"llama.cpp type {rest!r} unknown; known: {', '.join(LCPP_FTYPES)}")
        return System(kind, typ)
    name, *parts = rest.split(":")
    opts = []
    for p in parts:
        k, eq, v = p.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise ValueError(f"system {text!r}: option {p!r} must look like key=value")
        opts.append((k.strip().replace("-", "_"), v.strip()))
    return System(kind, name.strip(), tuple(opts), extra)


def select_systems(spec: str, extras=()) -> list[System]:
    """--systems 'all' | 'mixqrt' | 'llamacpp' | comma list of system names; plus --extra-recipe."""
    out: list[System] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item in ("all", "mixqrt"):
            out += [System("mixqrt", r) for r in MIXQRT_RECIPES]
        if item in ("all", "llamacpp", "llama.cpp"):
            out += [System("llamacpp", t) for t in LCPP_FTYPES]
        if item not in ("all", "mixqrt", "llamacpp", "llama.cpp"):
            out.append(parse_system(item))
    for e in extras:
        out.append(parse_system(e if e.startswith(("mixqrt:", "mxq:")) else "mixqrt:" + e, extra=True))
    seen, uniq = set(), []
    for s in out:
        if s.key not in seen:
            seen.add(s.key)
            uniq.append(s)
    return uniq


def coerce(v: str):
    """'12' -> 12, '330e6' -> 330000000, '0.5' -> 0.5, '300M' -> 300000000, other text stays text."""
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)([kKmMgG]?)", v)
    if m:
        x = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
        return int(x) if x == int(x) and ("." not in v or m.group(2) or "e" in v) else x
    return {"true": True, "false": False}.get(v.lower(), v)


def sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name)[:80]


# ----------------------------------------------------------------------------------- workers (child side)
def _tokens_sha(toks, n: int) -> str:
    import numpy as np
    return hashlib.sha256(np.asarray(toks[:n], dtype=np.int64).tobytes()).hexdigest()[:16]


def prepare_mixqrt(sysm: System, s: dict) -> dict:
    if sysm.name.endswith(".mxq"):
        return {"path": os.path.abspath(sysm.name), "file_bytes": os.path.getsize(sysm.name), "quantized": False}
    import inspect

    from mixqrt.quantize.convert import quantize_model
    from mixqrt.quantize.recipes import get_recipe
    qkw, rkw = {}, {}
    qsig = inspect.signature(quantize_model).parameters
    rsig = inspect.signature(get_recipe).parameters
    for k, v in sysm.opts:
        if k in qsig:
            qkw[k] = coerce(v)
        elif k in rsig:
            rkw[k] = coerce(v)
        else:
            raise SystemExit(f"{sysm.key}: neither quantize_model ({', '.join(qsig)}) nor get_recipe "
                             f"({', '.join(rsig)}) takes {k!r}")
    try:
        rec = get_recipe(sysm.name, **rkw)
        spec = rec.spec()
    except ValueError:            # a recipe only quantize_model knows how to build ("auto" + budget_bytes)
        if rkw:
            raise
        rec, spec = sysm.name, {"name": sysm.name}
    # path-valued options (an imatrix file) are identified by size and mtime, not only by name
    opt_ids = {k: (file_id(v) if isinstance(v, str) and os.path.exists(v) else v) for k, v in {**qkw, **rkw}.items()}
    if "calibrate" in qkw:        # calibrate=self+/path/text.txt: `mixqrt quantize --calibrate` names, '+'-joined
        from mixqrt.quantize.calibtext import parse_sources
        names = str(qkw["calibrate"]).split("+")
        opt_ids["calibrate"] = [n if n == "self" else file_id(n) for n in names]
        qkw["calibrate"] = parse_sources(names)
    h = sha({"spec": spec, "opts": opt_ids, "src": file_id(s["model"]), "code": s["quant_code"]})[:12]
    out = Path(s["cache_dir"]) / "mxq" / f"{safe(sysm.label)}-{h}.mxq"
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds = None
    if not out.exists() or s.get("requantize"):
        t = time.perf_counter()
        rep = quantize_model(s["model"], rec, str(out), progress=False, **qkw)
        seconds = time.perf_counter() - t
        spec = rep.recipe
        for old in out.parent.glob(f"{safe(sysm.label)}-*.mxq"):   # an older quantizer's file: keep /tmp bounded
            if re.fullmatch(re.escape(safe(sysm.label)) + r"-[0-9a-f]{12}\.mxq", old.name) and old != out:
                old.unlink()
    return {"path": str(out), "file_bytes": out.stat().st_size, "quantized": seconds is not None,
            "quantize_seconds": seconds, "recipe": spec}


def gguf_layout(path: str) -> dict:
    """Tensor bytes, token_embd bytes, whether an output.weight exists, and the KV shape."""
    import mmap

    from mixqrt.io.gguf import read_gguf_header
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        meta, tensors = read_gguf_header(m, Path(path))
    arch = meta["general.architecture"]
    n_head = int(meta[f"{arch}.attention.head_count"])
    return {"tensor_bytes": sum(t[3] for t in tensors.values()),
            "token_embd_bytes": tensors["token_embd.weight"][3] if "token_embd.weight" in tensors else 0,
            "has_output": "output.weight" in tensors, "n_layer": int(meta[f"{arch}.block_count"]),
            "n_kv_head": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
            "head_dim": int(meta[f"{arch}.embedding_length"]) // n_head,
            "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False))}


def prepare_llamacpp(sysm: System, s: dict) -> dict:
    out = Path(s["lcpp_dir"]) / f"{s['lcpp_prefix']}-{sysm.name}.gguf"
    seconds = None
    if not out.exists():
        import ctypes

        import llama_cpp
        out.parent.mkdir(parents=True, exist_ok=True)
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = LCPP_FTYPES[sysm.name], True, int(s["threads"])
        tmp = out.with_name(out.name + ".part")
        t = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(s["model"].encode(), str(tmp).encode(), ctypes.byref(p))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize({sysm.name}) returned {rc}")
        os.replace(tmp, out)
        seconds = time.perf_counter() - t
    return {"path": str(out), "file_bytes": out.stat().st_size, "quantized": seconds is not None,
            "quantize_seconds": seconds, "gguf": gguf_layout(str(out))}


def ppl_mixqrt(sysm: System, s: dict) -> dict:
    from mixqrt.pipeline import LoadedModel
    m = LoadedModel(s["path"], threads=s["threads"])
    with open(s["text"], encoding="utf-8") as f:
        text = f.read()
    from mixqrt.commands.evaluate import encode_text
    toks, bos = encode_text(m.tokenizer, text)
    return _ppl(lambda ids: m.logits(ids), toks, bos, s)


def ppl_llamacpp(sysm: System, s: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama
    T = int(s["threads"])
    llm = Llama(s["path"], n_ctx=s["ctx"], n_batch=s["ctx"], n_ubatch=s["ctx"], n_threads=T, n_threads_batch=T,
                logits_all=True, verbose=False)
    with open(s["text"], encoding="utf-8") as f:
        text = f.read()
    add_bos = bool(s.get("add_bos"))
    toks = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    bos = llm.token_bos() if add_bos else None

    def logits_fn(ids):
        llm.reset()                     # a fresh context per chunk (the KV cache is cleared from 0 by eval)
        llm.eval([int(i) for i in ids])
        return np.array(llm.scores[:len(ids)], dtype=np.float32)

    return _ppl(logits_fn, toks, bos, s)


def _ppl(logits_fn, toks, bos, s) -> dict:
    from mixqrt.commands.evaluate import perplexity

    def show(i, v):
        print(f"[{i + 1}]{v:.4f}", end=" ", flush=True, file=sys.stderr)

    with CpuMeter(s["threads"]) as cpu:
        r = perplexity(logits_fn, toks, ctx=s["ctx"], chunks=s["chunks"], bos_id=bos, save_logits=s.get("save_logits"),
                       kl_base=s.get("kl_base"), progress=False, on_chunk=show)
    print(file=sys.stderr)
    d = r.to_dict()
    d.update(kld_mean=r.kld_mean, kld_p99=r.kld_p99, same_top_pct=r.same_top_pct, text_tokens=len(toks),
             tokens_sha=_tokens_sha(toks, r.chunks * r.ctx), cpu_utilisation=cpu.utilisation,
             seconds_per_chunk=r.seconds / r.chunks)
    return d


def bench_prompt(vocab: int, n: int):
    """mixqrt.commands.bench's prompt: the same ids for both systems."""
    import numpy as np
    return np.random.default_rng(0).integers(100, min(vocab, 30000), size=n)


def speed_mixqrt(sysm: System, s: dict) -> dict:
    import mixqrt.commands.bench as mb
    from mixqrt.pipeline import LoadedModel
    # the bandwidth is measured once for every system (task 'machine'); skipping bench's own probe
    # also keeps its 1 GiB buffer out of this process's peak RSS
    mb.measure_bandwidth = lambda *args, **kwargs: float("nan")   # any signature bench() calls it with
    m = LoadedModel(s["path"], threads=s["threads"])
    with CpuMeter(s["threads"]) as cpu:
        row = mb.bench(m, threads=(s["threads"],), n_prompt=s["n_prompt"], n_gen=s["n_gen"],
                       ttft_prompt=s["ttft_prompt"], repeats=s["repeats"], progress=False)[0]
    return {"pp_tok_s": row["pp_tok_s"], "tg_tok_s": row["tg_tok_s"], "ttft_s": row["ttft_s"],
            "peak_rss_bytes": max(row["peak_rss_bytes"], peak_rss_bytes()), "cpu_utilisation": cpu.utilisation,
            "decode_bytes_per_token": row["decode_bytes_per_token"], "tensor_bytes": row["model_bytes"],
            "load_seconds": m.load_seconds}


def speed_llamacpp(sysm: System, s: dict) -> dict:
    """The same loop as mixqrt.commands.bench.bench: warm-up of 32 tokens; per repeat pp (eval of the prompt
    after reset), TTFT (eval of the first ttft_prompt tokens + argmax), tg (greedy one-token evals)."""
    import statistics

    import numpy as np
    import llama_cpp
    T, n_prompt, n_gen, n_ttft = int(s["threads"]), s["n_prompt"], s["n_gen"], s["ttft_prompt"]
    t = time.perf_counter()
    llm = llama_cpp.Llama(s["path"], n_ctx=max(n_prompt, n_ttft + n_gen) + 16, n_batch=max(512, n_prompt),
                          n_ubatch=512, n_threads=T, n_threads_batch=T, logits_all=False, verbose=False)
    load = time.perf_counter() - t
    vocab = llm.n_vocab()
    prompt = [int(i) for i in bench_prompt(vocab, n_prompt)]

    def argmax_last() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    pp, tg, ttft = [], [], []
    with CpuMeter(T) as cpu:
        llm.reset()
        llm.eval(prompt[:32])
        for _ in range(s["repeats"]):
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompt)
            pp.append(n_prompt / (time.perf_counter() - t))
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompt[:n_ttft])
            tok = argmax_last()
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(n_gen):
                llm.eval([tok])
                tok = argmax_last()
            tg.append(n_gen / (time.perf_counter() - t))
    g = s["gguf"]
    # weights read per decoded token: all but the embedding table, unless it is also the output
    # projection (tied: no output.weight), plus the f16 K and V rows attended to (mixqrt.commands.bench counts
    # its f32 cache the same way, at the same context length)
    weights = g["tensor_bytes"] - (g["token_embd_bytes"] if g["has_output"] else 0)
    kv = 2 * g["n_layer"] * g["n_kv_head"] * g["head_dim"] * 2 * (n_ttft + n_gen // 2)
    return {"pp_tok_s": statistics.median(pp), "tg_tok_s": statistics.median(tg), "ttft_s": statistics.median(ttft),
            "peak_rss_bytes": peak_rss_bytes(), "cpu_utilisation": cpu.utilisation,
            "decode_bytes_per_token": weights + kv, "tensor_bytes": g["tensor_bytes"], "load_seconds": load}


def bandwidth(sysm: System, s: dict) -> dict:
    from mixqrt.commands.bench import measure_bandwidth
    return {"read_bandwidth_bytes_s": measure_bandwidth(int(s["threads"])), "threads": s["threads"]}


TASKS = {("mixqrt", "prepare"): prepare_mixqrt, ("llamacpp", "prepare"): prepare_llamacpp,
         ("mixqrt", "ppl"): ppl_mixqrt, ("llamacpp", "ppl"): ppl_llamacpp,
         ("mixqrt", "speed"): speed_mixqrt, ("llamacpp", "speed"): speed_llamacpp,
         ("machine", "bandwidth"): bandwidth}


def worker_main(system: str, task: str, settings: str) -> int:
    sysm = parse_system(system)
    fn = TASKS.get((sysm.kind, task))
    if fn is None:
        raise SystemExit(f"no task {task!r} for {sysm.kind}")
    out = fn(sysm, json.loads(settings))
    sys.stdout.flush()
    print("\n" + json.dumps(out, default=float), flush=True)
    return 0


# ----------------------------------------------------------------------------------- parent side
class Runner:
    """Runs tasks in child processes; results cached as JSON files keyed by everything they depend on."""

    def __init__(self, a, env_threads: int):
        self.a = a
        self.dir = Path(a.cache_dir) / "results"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MIXQRT_NUM_THREADS"):
            self.env[k] = str(env_threads)
        self.log: list[dict] = []

    def run(self, sysm: System, task: str, settings: dict, key: dict, valid=lambda r: True) -> dict:
        key = {"task": task, "system": sysm.key, **key}
        path = self.dir / f"{task}-{safe(sysm.key)}-{sha(key)[:12]}.json"
        if path.exists() and not (self.a.fresh and task != "prepare"):
            try:
                res = json.loads(path.read_text())["result"]
                if valid(res):
                    self.log.append({"system": sysm.key, "task": task, "cached": True, "seconds": 0})
                    return res
            except (ValueError, KeyError):
                pass
        if self.a.report_only:
            return self._latest(task, sysm, key) or {"error": "not measured (--report-only)"}
        print(f"== {task} {sysm.key}", file=sys.stderr, flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", sysm.key, "--task", task,
               "--settings", json.dumps(settings)]
        t = time.perf_counter()
        res = self._child(cmd)
        sec = time.perf_counter() - t
        self.log.append({"system": sysm.key, "task": task, "cached": False, "seconds": sec})
        if "error" not in res:
            res["task_seconds"] = sec
            tmp = path.with_suffix(".part")
            tmp.write_text(json.dumps({"key": key, "result": res}, indent=1, default=float))
            os.replace(tmp, path)
        else:
            print(f"!! {task} {sysm.key} failed: {res['error']}", file=sys.stderr, flush=True)
        return res

    # fields that change with the code or files, not with what was asked for
    _VOLATILE = ("file", "runtime", "quant_code", "kl_base", "model")

    def _latest(self, task: str, sysm: System, key: dict) -> dict | None:
        """--report-only: the newest cached result with the same settings, even if the code has changed
        since (the sources are being edited by others; a report is still wanted)."""
        want = {k: v for k, v in key.items() if k not in self._VOLATILE}
        for path in sorted(self.dir.glob(f"{task}-{safe(sysm.key)}-*.json"), key=lambda p: -p.stat().st_mtime):
            try:
                d = json.loads(path.read_text())
            except ValueError:
                continue
            if {k: v for k, v in d["key"].items() if k not in self._VOLATILE} == want:
                self.log.append({"system": sysm.key, "task": task, "cached": True, "seconds": 0})
                return dict(d["result"], stale_code=True)
        return None

    def _child(self, cmd) -> dict:
        tail: list[str] = []
        out: list[str] = []
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                 cwd=ROOT)
        except OSError as e:
            return {"error": str(e)}

        def pump():                       # show the child's progress live, keep the tail for errors
            for line in p.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                tail.append(line.rstrip())
                del tail[:-15]

        threads = [threading.Thread(target=pump, daemon=True),
                   threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)]
        for th in threads:
            th.start()
        try:
            p.wait(timeout=self.a.task_timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return {"error": f"timed out after {self.a.task_timeout} s"}
        for th in threads:
            th.join(10)
        for line in reversed("".join(out).strip().splitlines()):
            try:
                res = json.loads(line)
                if isinstance(res, dict) and p.returncode == 0:
                    return res
            except ValueError:
                continue
        msg = " | ".join(x for x in tail[-3:] if x.strip()) or "no output"
        return {"error": f"exit {p.returncode}: {msg}"}


def measure(a, systems: list[System], info: dict) -> dict:
    """All tasks, in order: prepare, perplexity (f32 base first), bandwidth, speed."""
    T = a.threads
    runner = Runner(a, T)
    code = tree_hash("mixqrt")
    qcode = tree_hash(*QUANT_CODE)
    text_id = hashlib.sha256(Path(a.text).read_bytes()).hexdigest()[:16]
    base_set = {"model": os.path.abspath(a.model), "threads": T, "cache_dir": a.cache_dir, "quant_code": qcode,
                "lcpp_dir": a.lcpp_dir, "lcpp_prefix": a.lcpp_prefix, "requantize": a.requantize}
    runtime = {"mixqrt": code, "llamacpp": info.get("llama_cpp_python")}
    want_kl = not a.no_kl and not a.no_ppl
    base = parse_system(BASE)
    todo = list(systems)
    if want_kl and base not in todo:
        todo.insert(0, base)                      # KL needs the f32 log-probs even if f32 is not listed
    results = {s.key: {"system": s} for s in todo}

    prep = {}
    for s in todo:
        key = {"model": file_id(a.model), "quant_code": qcode if s.kind == "mixqrt" else None,
               "lcpp": [a.lcpp_dir, a.lcpp_prefix] if s.kind == "llamacpp" else None}
        r = runner.run(s, "prepare", base_set, key, valid=lambda r: os.path.exists(r.get("path", "")))
        prep[s.key] = r
        results[s.key]["prepare"] = r

    if not a.no_ppl:
        ppl_set = {**base_set, "text": os.path.abspath(a.text), "chunks": a.chunks, "ctx": a.ctx}
        ppl_key = {"text": text_id, "chunks": a.chunks, "ctx": a.ctx, "threads": T}
        base_key = base_logits = None
        order = ([base] if want_kl else []) + [s for s in todo if not (want_kl and s == base)]
        for s in order:
            pr = prep[s.key]
            if "error" in pr:
                results[s.key]["ppl"] = {"error": "not prepared: " + pr["error"]}
                continue
            key = {**ppl_key, "file": file_id(pr["path"]), "runtime": runtime[s.kind]}
            st = {**ppl_set, "path": pr["path"], "add_bos": pr.get("gguf", {}).get("add_bos", False)}
            valid = lambda r: True  # noqa: E731
            if want_kl and s == base:
                base_key = sha(key)[:16]
                base_logits = str(Path(a.cache_dir) / f"base-f32-{base_key}.logits")
                st["save_logits"] = base_logits
                valid = lambda r, p=base_logits: os.path.exists(p)  # noqa: E731
            elif want_kl:
                if base_logits is None or not os.path.exists(base_logits):
                    key["kl_base"] = None
                else:
                    key["kl_base"] = base_key
                    st["kl_base"] = base_logits
            results[s.key]["ppl"] = runner.run(s, "ppl", st, key, valid)

    if not a.no_speed:
        speed_set = {**base_set, "n_prompt": a.n_prompt, "n_gen": a.n_gen, "ttft_prompt": a.ttft_prompt,
                     "repeats": a.repeats}
        bw = runner.run(System("machine", "bandwidth"), "bandwidth", base_set,
                        {"threads": T, "runtime": code, "cpu": info.get("cpu_model")})
        info["read_bandwidth_bytes_s"] = bw.get("read_bandwidth_bytes_s")
        for s in systems:
            pr = prep[s.key]
            if "error" in pr:
                results[s.key]["speed"] = {"error": "not prepared: " + pr["error"]}
                continue
            key = {"file": file_id(pr["path"]), "runtime": runtime[s.kind], "threads": T, "n_prompt": a.n_prompt,
                   "n_gen": a.n_gen, "ttft": a.ttft_prompt, "repeats": a.repeats}
            st = {**speed_set, "path": pr["path"], "gguf": pr.get("gguf")}
            r = runner.run(s, "speed", st, key)
            results[s.key]["speed"] = r
        # the honest bound: the probe, or the best effective rate any system reached in this run
        from mixqrt.commands.bench import honest_bound
        probe = info.get("read_bandwidth_bytes_s")
        eff = [r["tg_tok_s"] * r["decode_bytes_per_token"] for r in (results[s.key].get("speed") or {} for s in systems)
               if "error" not in r and r.get("tg_tok_s") and r.get("decode_bytes_per_token")]
        if probe:
            bwv, info["bandwidth_note"] = honest_bound(probe, eff)
            info["probe_bandwidth_bytes_s"], info["read_bandwidth_bytes_s"] = probe, bwv
            for s in systems:
                r = results[s.key].get("speed") or {}
                if "error" not in r and r.get("tg_tok_s"):
                    r["bandwidth_ratio"] = r["tg_tok_s"] * r["decode_bytes_per_token"] / bwv
    if want_kl and base not in systems:
        results[BASE]["implicit"] = True
    info["task_log"] = runner.log
    return results


# ----------------------------------------------------------------------------------- report
def _get(results, key, task, field):
    r = results.get(key, {}).get(task) or {}
    v = r.get(field)
    return None if (v is None or "error" in r or (isinstance(v, float) and v != v)) else v


def _f(v, spec="{:.2f}", missing="–"):
    return missing if v is None else spec.format(v)


def agreement(results):
    """(mixqrt f32 PPL, llama.cpp F32 PPL, relative difference) or None."""
    m, l_ = _get(results, BASE, "ppl", "ppl"), _get(results, "llamacpp:F32", "ppl", "ppl")
    if m is None or l_ is None:
        return None
    return m, l_, abs(m - l_) / l_


def _fastest(results, field):
    best = None
    for k, r in results.items():
        v = _get(results, k, "speed", field)
        if k.startswith("llamacpp:") and v is not None and (best is None or v > best[1]):
            best = (k.split(":", 1)[1], v)
    return best


def goals(results, cand: str) -> list[dict]:
    """The issue's goals for one mixqrt system: (a) bytes <= Q2_K, (b) PPL <= Q3_K_M,
    (e) KL to the f32 logits <= Q3_K_M's, (c) decode >= 1.2x llama.cpp's fastest type, (d) prompt >=
    1.0x llama.cpp's fastest type."""
    out = []
    c, q2 = _get(results, cand, "prepare", "file_bytes"), _get(results, "llamacpp:Q2_K", "prepare", "file_bytes")
    out.append({"goal": "(a) file size <= llama.cpp Q2_K", "ok": None if None in (c, q2) else c <= q2,
                "gap": "not measured" if None in (c, q2) else
                f"{c / 2**20:.1f} MiB vs {q2 / 2**20:.1f} MiB ({100 * (c / q2 - 1):+.1f} %)"})
    c, q3 = _get(results, cand, "ppl", "ppl"), _get(results, "llamacpp:Q3_K_M", "ppl", "ppl")
    ce, q3e = _get(results, cand, "ppl", "ppl_err"), _get(results, "llamacpp:Q3_K_M", "ppl", "ppl_err")
    out.append({"goal": "(b) PPL no worse than llama.cpp Q3_K_M", "ok": None if None in (c, q3) else c <= q3,
                "gap": "not measured" if None in (c, q3) else
                f"{c:.3f} ± {ce:.3f} vs {q3:.3f} ± {q3e:.3f} ({100 * (c / q3 - 1):+.2f} %)"})
    for tag, field, factor, what in (("(c)", "tg_tok_s", 1.2, "decode"), ("(d)", "pp_tok_s", 1.0, "prompt")):
        c, best = _get(results, cand, "speed", field), _fastest(results, field)
        g = {"goal": f"{tag} {what} tok/s >= {factor:.1f}x llama.cpp's fastest type"}
        if c is None or best is None:
            g.update(ok=None, gap="not measured")
        else:
            g.update(ok=c >= factor * best[1], gap=f"{c:.1f} vs {factor:.1f} x {best[1]:.1f} ({best[0]}) = "
                     f"{factor * best[1]:.1f} tok/s: {c / best[1]:.2f}x (needs {factor:.2f}x)")
        out.append(g)
    c, q3 = _get(results, cand, "ppl", "kld_mean"), _get(results, "llamacpp:Q3_K_M", "ppl", "kld_mean")
    out.append({"goal": "(e) KL to f32 no worse than llama.cpp Q3_K_M", "ok": None if None in (c, q3) else c <= q3,
                "gap": "not measured" if None in (c, q3) else f"{c:.4f} vs {q3:.4f} ({100 * (c / q3 - 1):+.1f} %)"})
    return out


def _verdict(ok) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[ok]


def lost_sentences(results, cand: str, label: str) -> list[str]:
    out = []
    for g in goals(results, cand):
        if g["ok"] is False:
            out.append(f"{label} loses {g['goal'][4:]}: {g['gap']}.")
        elif g["ok"] is None:
            out.append(f"{label}: {g['goal']} was not measured in this run.")
    return out


def summary_lines(results) -> list[str]:
    ag = agreement(results)
    lines = ["", "=" * 100]
    if ag:
        m, l_, rel = ag
        lines.append(f"f32 AGREEMENT: mixqrt f32 PPL {m:.4f}  vs  llama.cpp F32 PPL {l_:.4f}  ->  relative difference "
                     f"{100 * rel:.3f} %  (acceptance <= 0.5 %: {'PASS' if rel <= 0.005 else 'FAIL'})")
    else:
        lines.append("f32 agreement: not measured (needs mixqrt:f32 and llamacpp:F32 perplexities)")
    for k in results:
        if k.startswith("mixqrt:") and (k in GOAL_KEYS or results[k]["system"].extra):
            for g in goals(results, k):
                lines.append(f"{results[k]['system'].label:>14s} {g['goal']:50s} {_verdict(g['ok']):5s} {g['gap']}")
    lines.append("=" * 100)
    return lines


def _order(results, systems):
    keys = [s.key for s in systems]
    if BASE in results and BASE not in keys:
        keys.insert(0, BASE)
    return sorted(keys, key=lambda k: (k.startswith("llamacpp:"), results[k]["system"].extra))


def _run_block(a, results, info) -> list[str]:
    """Provenance of the run: command, machine, date, model, text, settings, warnings."""
    bw = info.get("read_bandwidth_bytes_s")
    chunks_done = next((r["ppl"]["chunks"] for r in results.values() if "chunks" in (r.get("ppl") or {})), a.chunks)
    scored = next((r["ppl"]["tokens"] for r in results.values() if "tokens" in (r.get("ppl") or {})), None)
    log = info.get("task_log", [])
    L = [f"- **Command:** `{info['command']}`",
         f"- **Machine:** {info.get('cpu_model')} ({info.get('cpu_vendor')}), {info.get('usable_cpus')} usable cores "
         f"of {info.get('logical_cpus')} logical, {_f(info.get('ram_bytes') and info['ram_bytes'] / 2**30, '{:.0f}')} GiB RAM, "
         f"mixqrt ISA tier {info.get('isa')}; bandwidth bound {_f(bw and bw / 1e9, '{:.1f}')} GB/s at "
         f"{a.threads} threads (best probe pattern "
         f"{_f(info.get('probe_bandwidth_bytes_s') and info['probe_bandwidth_bytes_s'] / 1e9, '{:.1f}')} GB/s, or the "
         f"best effective decode rate of any system in this run when higher"
         f"{'; ' + info['bandwidth_note'] if info.get('bandwidth_note') else ''}); load average at start {' / '.join(f'{x:.2f}' for x in info['loadavg'])}",
         f"- **Date:** {info['date_utc']}; **git commit:** {info['git_commit']}; llama-cpp-python "
         f"{info.get('llama_cpp_python')}",
         f"- **Model:** `{os.path.basename(a.model)}`; **text:** `{os.path.basename(a.text)}`, {chunks_done} chunk(s) "
         f"of {a.ctx} tokens ({_f(scored, '{:d}')} tokens scored per system)",
         f"- **Threads:** {a.threads}; speed = median of {a.repeats} repeats; pp{a.n_prompt}, tg{a.n_gen}, "
         f"TTFT on a {a.ttft_prompt}-token prompt",
         f"- **Run time:** {info['wall_seconds'] / 60:.1f} min ({sum(1 for t in log if not t['cached'])} tasks "
         f"measured, {sum(1 for t in log if t['cached'])} from the cache in {a.cache_dir})"
         + ("; rebuilt from the cache with --report-only" if a.report_only else "")]
    stale = sorted({results[k]["system"].label for k in results for t in ("prepare", "ppl", "speed")
                    if (results[k].get(t) or {}).get("stale_code")})
    if stale:
        L += ["", f"> **Note:** --report-only used results measured with older mixqrt sources for: {', '.join(stale)}."]
    busy = busy_warning(results, info, a.threads)
    if busy:
        L += ["", f"> **WARNING: {busy}** Speed, TTFT and CPU columns are not trustworthy; rerun on a quiet "
              "machine (`--fresh`, or delete the speed results in the cache)."]
    return L


def _agreement_block(results) -> list[str]:
    ag = agreement(results)
    if not ag:
        return ["Not measured in this run (needs mixqrt:f32 and llamacpp:F32 perplexities)."]
    m, l_, rel = ag
    same = _get(results, BASE, "ppl", "tokens_sha") == _get(results, "llamacpp:F32", "ppl", "tokens_sha")
    return [f"**mixqrt f32 PPL {m:.4f} vs llama.cpp F32 PPL {l_:.4f}: relative difference {100 * rel:.3f} % "
            f"-> {'PASS' if rel <= 0.005 else 'FAIL'}.** Token ids of the scored chunks "
            f"{'identical' if same else 'DIFFER'}; KL(mixqrt f32 || llama.cpp F32) mean "
            f"{_f(_get(results, 'llamacpp:F32', 'ppl', 'kld_mean'), '{:.5f}')}, same top token "
            f"{_f(_get(results, 'llamacpp:F32', 'ppl', 'same_top_pct'), '{:.2f}')} %."]


def _goals_block(results, keys, lab) -> list[str]:
    cands = [k for k in keys if k in GOAL_KEYS or (k.startswith("mixqrt:") and results[k]["system"].extra)]
    if not cands:
        return ["No 2356 system in this run."]
    L = ["| mixqrt system | goal | result | measured (gap) |", "|---|---|:---:|---|"]
    lost = []
    for k in cands:
        for g in goals(results, k):
            L.append(f"| {lab[k]} | {g['goal']} | **{_verdict(g['ok'])}** | {g['gap']} |")
        lost += lost_sentences(results, k, lab[k])
    return L + ["", "**What lost:** " + (" ".join(lost) if lost else "nothing; every goal passed.")]


def _note(results, k) -> str:
    note = RECIPE_NOTES.get(results[k]["system"].name, "") if k.startswith("mixqrt:") else "llama.cpp type"
    if results[k]["system"].extra:
        note = "--extra-recipe" + ("; GPTQ-calibrated, `mixqrt quantize --calibrate`" if any(
            o == "calibrate" for o, _ in results[k]["system"].opts) else "")
    if results[k].get("implicit"):
        note += " (KL base only)"
    errs = [f"{t}: {results[k][t]['error']}" for t in ("prepare", "ppl", "speed") if "error" in (results[k].get(t) or {})]
    if errs:
        note += " — FAILED " + "; ".join(e.replace("|", "/")[:160] for e in errs)
    return note


def _all_block(a, results, keys, lab) -> list[str]:
    f32 = _get(results, BASE, "ppl", "ppl")
    L = [f"| system | what | file MiB | PPL ± err | ΔPPL vs f32 | KL mean | KL p99 | same top % | "
         f"pp{a.n_prompt} tok/s | tg{a.n_gen} tok/s | TTFT ms | peak RSS MiB | CPU % | B/token ÷ bandwidth |",
         "|---|---|" + "---:|" * 12]
    for k in keys:
        ppl, err = _get(results, k, "ppl", "ppl"), _get(results, k, "ppl", "ppl_err")
        rss = _get(results, k, "speed", "peak_rss_bytes")
        L.append(f"| {lab[k]} | {_note(results, k)} | {_f(_mib(results, k), '{:.1f}')} | "
                 f"{_f(ppl, '{:.3f}')}{'' if err is None else f' ± {err:.3f}'} | "
                 f"{_f(None if None in (ppl, f32) else 100 * (ppl / f32 - 1), '{:+.2f} %')} | "
                 f"{_f(_get(results, k, 'ppl', 'kld_mean'), '{:.4f}')} | {_f(_get(results, k, 'ppl', 'kld_p99'), '{:.3f}')} | "
                 f"{_f(_get(results, k, 'ppl', 'same_top_pct'), '{:.1f}')} | {_f(_get(results, k, 'speed', 'pp_tok_s'), '{:.1f}')} | "
                 f"{_f(_get(results, k, 'speed', 'tg_tok_s'), '{:.1f}')} | {_f(_ms(results, k), '{:.0f}')} | "
                 f"{_f(rss and rss / 2**20, '{:.0f}')} | "
                 f"{_f(_pct(_get(results, k, 'speed', 'cpu_utilisation')), '{:.0f}')} | "
                 f"{_f(_get(results, k, 'speed', 'bandwidth_ratio'), '{:.2f}')} |")
    return L


def _ablation_block(results, keys, lab) -> list[str]:
    abl = [k for k in keys if k.startswith("mixqrt:2356-")]
    b_ppl, b_mib = _get(results, "mixqrt:2356", "ppl", "ppl"), _mib(results, "mixqrt:2356")
    if not abl or b_ppl is None:
        return ["No ablation of 2356 in this run."]
    L = ["| recipe | what changes | PPL | vs 2356 | size vs 2356 |", "|---|---|---:|---:|---:|"]
    for k in abl:
        ppl, mib = _get(results, k, "ppl", "ppl"), _mib(results, k)
        L.append(f"| {lab[k]} | {RECIPE_NOTES.get(results[k]['system'].name, '')} | {_f(ppl, '{:.3f}')} | "
                 f"{_f(None if ppl is None else 100 * (ppl / b_ppl - 1), '{:+.2f} %')} | "
                 f"{_f(None if mib is None or b_mib is None else mib - b_mib, '{:+.1f} MiB')} |")
    return L


def report_blocks(a, systems, results, info) -> dict[str, str]:
    """The generated tables of docs/results.md, by marker name (the prose around them is hand-written)."""
    keys = _order(results, systems)
    lab = {k: results[k]["system"].label for k in keys}
    article = [f"| system | model size MiB | first-token latency ms ({a.ttft_prompt}-token prompt) | PPL | "
               "CPU utilisation % |", "|---|---:|---:|---:|---:|"]
    for k in keys:
        article.append(f"| {lab[k]} | {_f(_mib(results, k), '{:.1f}')} | {_f(_ms(results, k), '{:.0f}')} | "
                       f"{_f(_get(results, k, 'ppl', 'ppl'), '{:.3f}')} | "
                       f"{_f(_pct(_get(results, k, 'speed', 'cpu_utilisation')), '{:.0f}')} |")
    blocks = {"results-run": _run_block(a, results, info), "results-agreement": _agreement_block(results),
              "results-goals": _goals_block(results, keys, lab), "results-article-table": article,
              "results-all": _all_block(a, results, keys, lab), "results-ablations": _ablation_block(results, keys, lab)}
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def report_json(a, systems, results, info) -> dict:
    """Everything the tables show, raw: settings, machine, and per system its prepare/ppl/speed results."""
    keys = _order(results, systems)
    settings = {k: getattr(a, k, None) for k in ("model", "text", "chunks", "ctx", "threads", "n_prompt", "n_gen",
                                                 "ttft_prompt", "repeats")}
    return {"info": info, "settings": settings, "agreement": agreement(results),
            "systems": {k: {"label": results[k]["system"].label, "what": _note(results, k),
                            "extra": results[k]["system"].extra,
                            **{t: results[k].get(t) for t in ("prepare", "ppl", "speed")},
                            "goals": goals(results, k) if k.startswith("mixqrt:") else None} for k in keys}}


def json_path(out) -> Path:
    """docs/results.md -> docs/data/results.json."""
    return Path(out).parent / "data" / (Path(out).stem + ".json")


def write_report(a, systems, results, info) -> None:
    """The raw results as JSON next to the page, then the page's generated tables in place; then the
    families table of docs/results.md from every results*.json beside it."""
    write_json(json_path(a.out), report_json(a, systems, results, info))
    update_doc(a.out, report_blocks(a, systems, results, info),
               title="mixqrt vs llama.cpp: one model, one text, one machine, one run")
    main_page = ROOT / "docs" / "results.md"
    if Path(a.out).parent.resolve() == main_page.parent.resolve() and main_page.exists():
        update_doc(main_page, {"results-families": "\n".join(families_block(json_path(main_page).parent))})


def families_block(data_dir: Path) -> list[str]:
    """One row per model and mixqrt goal system (the default recipe, 2356t, 2356a and auto, calibrated or not) of every
    docs/data/results*.json: bytes against Q2_K, KL and PPL against Q3_K_M, f32 agreement."""
    L = ["| model | mixqrt system | MiB (Q2_K MiB) | KL to f32 (Q3_K_M) | PPL (Q3_K_M) | same top token | "
         "f32 PPL vs llama.cpp F32 | run |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for f in sorted(data_dir.glob("results*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        sy = d.get("systems", {})
        q2, q3 = sy.get("llamacpp:Q2_K", {}), sy.get("llamacpp:Q3_K_M", {})
        ag = d.get("agreement")
        agree = f"{ag[0]:.3f} vs {ag[1]:.3f} ({100 * ag[2]:.2f} %)" if ag else "–"
        model = Path(d.get("settings", {}).get("model") or "?").stem
        for k, v in sy.items():
            if not k.startswith(("mixqrt:" + DEFAULT_RECIPE, "mixqrt:2356t", "mixqrt:2356a", "mixqrt:auto")):
                continue
            pp, pq3 = v.get("ppl") or {}, q3.get("ppl") or {}
            L.append(f"| {model} | {v.get('label', k)} | "
                     f"{_f((v.get('prepare') or {}).get('file_bytes') and v['prepare']['file_bytes'] / 2**20, '{:.1f}')} "
                     f"({_f((q2.get('prepare') or {}).get('file_bytes') and q2['prepare']['file_bytes'] / 2**20, '{:.1f}')}) | "
                     f"{_f(pp.get('kld_mean'), '{:.4f}')} ({_f(pq3.get('kld_mean'), '{:.4f}')}) | "
                     f"{_f(pp.get('ppl'), '{:.3f}')} ({_f(pq3.get('ppl'), '{:.3f}')}) | "
                     f"{_f(pp.get('same_top_pct'), '{:.1f} %')} | {agree} | "
                     f"[{f.name}](data/{f.name}), {d.get('info', {}).get('date_utc', '?')} |")
    return L


def busy_warning(results, info, threads: int) -> str | None:
    """A sentence when the machine was visibly shared during the run (load average above the cores,
    or a speed run whose threads were busy less than 70 % of the time)."""
    cores = info.get("usable_cpus") or os.cpu_count() or 1
    loads = [info["loadavg"][0]] + ([info["loadavg_end"][0]] if info.get("loadavg_end") else [])
    utils = {results[k]["system"].label: _get(results, k, "speed", "cpu_utilisation") for k in results}
    low = {k: v for k, v in utils.items() if v is not None and v < 0.7}
    parts = []
    if max(loads) > 1.25 * cores:
        parts.append(f"load average {max(loads):.1f} on {cores} cores")
    if low:
        parts.append(f"{len(low)} speed run(s) kept their {threads} threads busy < 70 % of the time "
                     f"(lowest: {min(low.values()) * 100:.0f} %, {min(low, key=low.get)})")
    return ("the machine was shared during this run: " + "; ".join(parts) + ".") if parts else None


def _mib(results, k):
    v = _get(results, k, "prepare", "file_bytes")
    return None if v is None else v / 2**20


def _ms(results, k):
    v = _get(results, k, "speed", "ttft_s")
    return None if v is None else 1000 * v


def _pct(v):
    return None if v is None else 100 * v


def write_plot(path, systems, results, title: str = "") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'mixqrt[bench]'): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    styles = {"mixqrt": ("o", "tab:blue", "mixqrt recipes"), "extra": ("^", "tab:green", "mixqrt --extra-recipe"),
              "llamacpp": ("s", "tab:orange", "llama.cpp types")}
    pts = []
    for k in _order(results, systems):
        s = results[k]["system"]
        x, y = _mib(results, k), _get(results, k, "ppl", "ppl")
        if x is not None and y is not None:
            pts.append((s, x, y))
    if not pts:
        plt.close(fig)
        return
    # an ablation far off (2356-bound: 3x f32's PPL) would squash every other point into one line:
    # such points sit on the top edge, labelled with their value
    cap = 1.6 * min(y for _, _, y in pts)
    ys = []
    for s, x, y in pts:
        kind = "extra" if s.extra else s.kind
        mk, col, name = styles[kind]
        off = y > cap
        name_ = s.label.replace("llama.cpp ", "")
        if any(o == "calibrate" for o, _ in s.opts):     # the option text is in the table; the plot says what it is
            name_ = s.name + " calibrated"
        ax.scatter([x], [min(y, cap)], marker="^" if off else mk, color=col, s=55, label="_off" if off else name, zorder=3,
                   facecolors="none" if off else col)
        ax.annotate(name_ + (f" (PPL {y:.1f}, off scale)" if off else ""), (x, min(y, cap)), textcoords="offset points",
                    xytext=(5, -11 if s.kind == "llamacpp" or off else 4), fontsize=8, color=col)
        ys.append(min(y, cap))
    h, lb = ax.get_legend_handles_labels()
    uniq = dict(zip(lb, h))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right")
    from matplotlib.ticker import FuncFormatter, NullFormatter
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.set_xticks([t for t in (250, 300, 350, 400, 450, 500, 600, 700, 800, 1000, 1250, 1500, 2000, 2500, 3000)
                   if lo <= t <= hi] or [lo, hi])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if max(ys) / min(ys) > 3:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_xlabel("model file size, MiB (log scale)")
    ax.set_ylabel("perplexity, wikitext-2 test (lower is better)")
    ax.set_title(f"{title}: mixqrt vs llama.cpp, same text, same machine")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="source GGUF for every system (default: the test model "
                   "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, mixqrt.testing)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="perplexity text (default wikitext-2 test)")
    p.add_argument("--chunks", type=int, default=8, help="512-token chunks scored per system (default 8; "
                   "wikitext-2 test has ~600)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=2, help="threads for every system (default 2)")
    p.add_argument("--systems", default="all", help="comma list: all | mixqrt | llamacpp | mixqrt:RECIPE | "
                   "llamacpp:TYPE (default all: " + ", ".join(MIXQRT_RECIPES) + " and " + ", ".join(LCPP_FTYPES) + ")")
    p.add_argument("--extra-recipe", action="append", default=[], metavar="NAME[:imatrix=PATH]",
                   help="another mixqrt variant (repeatable); key=value options go to quantize_model/get_recipe")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--ttft-prompt", type=int, default=128, help="prompt length for time to first token")
    p.add_argument("-r", "--repeats", type=int, default=3, help="speed repeats (median)")
    p.add_argument("--no-ppl", action="store_true", help="skip perplexity/KL")
    p.add_argument("--no-speed", action="store_true", help="skip pp/tg/TTFT/RSS")
    p.add_argument("--no-kl", action="store_true", help="no KL (skips the f32 log-probs file, ~78 MB per chunk)")
    p.add_argument("--fresh", action="store_true", help="ignore cached results (quantized files are still reused: they are keyed by a hash of the quantizer's sources)")
    p.add_argument("--requantize", action="store_true", help="quantize the mixqrt recipes again")
    p.add_argument("--report-only", action="store_true", help="write the report from cached results, run nothing")
    p.add_argument("--cache-dir", default="/tmp/mixqrt-compare")
    p.add_argument("--lcpp-dir", default="/tmp/lcpp", help="requantized llama.cpp GGUFs (made if missing)")
    p.add_argument("--lcpp-prefix", default="qwen", help="their names: DIR/PREFIX-TYPE.gguf")
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "results.png"), help="'' for no plot")
    p.add_argument("--task-timeout", type=int, default=7200, help="seconds per child task")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.model is None:
        from mixqrt.testing import model_path
        a.model = str(model_path("qwen"))
    if a.worker:
        return worker_main(a.worker, a.task, a.settings)
    for f in (a.model, a.text):
        if not os.path.exists(f):
            p.error(f"{f} does not exist")
    try:
        systems = select_systems(a.systems, a.extra_recipe)
    except ValueError as e:
        p.error(str(e))
    t0 = time.time()
    info = machine_info()
    args = [x for x in (argv or sys.argv[1:]) if x != "--report-only"]   # the command that measured it
    info["command"] = "python benchmarks/compare_llamacpp.py " + " ".join(shlex.quote(x) for x in args)
    results = measure(a, systems, info)
    info["wall_seconds"] = time.time() - t0
    info["loadavg_end"] = os.getloadavg()
    write_report(a, systems, results, info)
    if a.plot:
        write_plot(a.plot, systems, results, Path(a.model).stem)
    print("\n".join(summary_lines(results)), flush=True)
    print(f"wrote {a.out}, {json_path(a.out)}" + (f" and {a.plot}" if a.plot else "") + f" in {info['wall_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
