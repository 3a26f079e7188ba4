"""Qwen1.5-MoE-A2.7B-shaped mixture of experts: mixqrt against llama.cpp on the same random weights.

    python benchmarks/moe.py                     # 4 of the 24 layers (see --layers), everything
    python benchmarks/moe.py --layers 2 --n-gen 64 --n-prompt 128
    python benchmarks/moe.py --doc-only          # redo docs/moe.md's tables from its results.json

Writes one random-weight F16 GGUF of the shape (hidden 2048, 16 heads of 128, 60 routed experts top-4
of width 1408, a shared expert of 5632 with its sigmoid gate, Qwen2 vocabulary and tokenizer copied
from the Qwen test GGUF; qwen2moe in llama.cpp's own tensor names: blk.N.ffn_gate_inp,
ffn_{gate,up,down}_exps, ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp), quantizes it with llama.cpp's
llama-quantize to Q4_0 and Q3_K_M and with mixqrt's default recipe, then benches all three at the
same thread count in one run: file bytes, decode (tg) and prefill (pp) tokens/s (llama-bench for
llama.cpp, `mixqrt bench` for mixqrt), and mixqrt's resident memory after the decode steps against
its file size. The tools come from $MIXQRT_LLAMA_CPP_BIN (benchmarks/_common.llama_cpp_bin).

The full model is ~27 GB in F16 (~14.3 B parameters), more than this machine's RAM and a large part
of its disk: --layers N keeps N layers of the same shape (default 4, ~5.8 GB F16); the output says how
many. Per-layer speeds and sizes scale with the layer count; the embedding and output head (0.62 B
parameters) weigh more in a short model than in the full one, which the table's notes account for.

Only the tables between docs/moe.md's `mixqrt:moe-*` markers are generated (_common.update_doc); the
raw results go to docs/data/moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "benchmarks")]

from _common import last_json as _last_json, llama_cpp_bin, provenance, update_doc, write_json  # noqa: E402

FULL_LAYERS = 24
SHAPE = {"hidden": 2048, "n_head": 16, "n_head_kv": 16, "head_dim": 128, "n_expert": 60, "n_expert_used": 4,
         "expert_ff": 1408, "shared_ff": 5632, "vocab": 151936, "context": 8192, "rope_base": 1e6, "rms_eps": 1e-6}
DEFAULT_LAYERS = 4
TARGETS = {"decode": 1.5, "file": 0.8, "prefill": 1.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layer_params(s=SHAPE) -> int:
    h, e, ef, sf = s["hidden"], s["n_expert"], s["expert_ff"], s["shared_ff"]
    attn = 4 * h * s["n_head"] * s["head_dim"]
    return attn + e * 3 * ef * h + 3 * sf * h + e * h + h


# ----------------------------------------------------------------------------- the GGUF
def _vocab(n: int):
    """(tokens, types, merges, bos, eos, pre): the Qwen2 vocabulary of the Qwen test GGUF padded to n
    rows (as the converter pads), or for a small n the synthetic byte-level one (synthetic_gguf)."""
    if n >= 151646:
        from mixqrt.io.gguf import GGUFSource
        from mixqrt.testing import model_path
        meta = GGUFSource(model_path("qwen")).metadata
        tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
        for i in range(len(tokens), n):
            tokens.append(f"[PAD{i}]")
            types.append(5)                                        # gguf.TokenType.UNUSED
        return (tokens[:n], types[:n], [str(m) for m in meta["tokenizer.ggml.merges"]], 151643, 151645,
                meta.get("tokenizer.ggml.pre", "qwen2"))
    from mixqrt.testing.synthetic_gguf import _vocabulary
    tokens, types, merges = _vocabulary(min(n, 936))           # 256 bytes, 676 letter pairs, 4 specials
    tokens, types = tokens + [f"[PAD{i}]" for i in range(len(tokens), n)], types + [5] * (n - len(tokens))
    return tokens, types, merges, tokens.index("<|endoftext|>"), tokens.index("<|im_end|>"), "default"


def write_gguf(path: Path, layers: int, vocab: int, seed: int = 0, shape: dict | None = None) -> None:
    """The random-weight F16 GGUF (F32 vectors), streamed one tensor at a time; linears ~ N(0, 1/in).
    shape: keys of SHAPE to change (tests write a small one)."""
    import gguf
    import numpy as np

    s = dict(SHAPE, **(shape or {}), vocab=vocab)
    h, nh, hd, e, ef, sf = s["hidden"], s["n_head"], s["head_dim"], s["n_expert"], s["expert_ff"], s["shared_ff"]
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen2moe")
    w.add_name(f"Qwen1.5-MoE-A2.7B-shaped random ({layers} of {FULL_LAYERS} layers)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(sf)
    w.add_head_count(nh)
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_expert_count(e)
    w.add_expert_used_count(s["n_expert_used"])
    w.add_expert_feed_forward_length(ef)
    w.add_expert_shared_feed_forward_length(sf)
    tokens, types, merges, bos, eos, pre = _vocab(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(bos)
    w.add_add_bos_token(False)
    plan = [("token_embd.weight", (vocab, h), 1.0)]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (h,), None),
                 (p + "attn_q.weight", (nh * hd, h), h), (p + "attn_k.weight", (nh * hd, h), h),
                 (p + "attn_v.weight", (nh * hd, h), h),
                 (p + "attn_q.bias", (nh * hd,), 0), (p + "attn_k.bias", (nh * hd,), 0), (p + "attn_v.bias", (nh * hd,), 0),
                 (p + "attn_output.weight", (h, nh * hd), nh * hd), (p + "ffn_norm.weight", (h,), None),
                 (p + "ffn_gate_inp.weight", (e, h), h),
                 (p + "ffn_gate_exps.weight", (e, ef, h), h), (p + "ffn_up_exps.weight", (e, ef, h), h),
                 (p + "ffn_down_exps.weight", (e, h, ef), ef),
                 (p + "ffn_gate_inp_shexp.weight", (h,), h),
                 (p + "ffn_gate_shexp.weight", (sf, h), h), (p + "ffn_up_shexp.weight", (sf, h), h),
                 (p + "ffn_down_shexp.weight", (h, sf), sf)]
    plan += [("output_norm.weight", (h,), None), ("output.weight", (vocab, h), h)]
    for name, shape, _ in plan:
        f16 = len(shape) >= 2
        n = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(np.float16 if f16 else np.float32), n * (2 if f16 else 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, fan_in in plan:
        if fan_in is None:                                         # a norm: ~1
            a = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif fan_in == 0:                                          # a bias
            a = (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif len(shape) == 1:                                      # the shared expert's one-row gate
            a = (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)
        else:                                                      # F16 rows, one leading slice at a time
            a = np.empty(shape, dtype=np.float16)
            flat = a.reshape(-1, shape[-1])
            step = max(1, (1 << 24) // shape[-1])
            for r in range(0, flat.shape[0], step):
                blk = rng.standard_normal((min(step, flat.shape[0] - r), shape[-1]), dtype=np.float32)
                flat[r:r + len(blk)] = blk * np.float32(1.0 / np.sqrt(fan_in))
        w.write_tensor_data(a)
        del a
    w.close()
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- runs
def run(cmd, log_path: Path, timeout=None) -> tuple[int, str, float]:
    t = time.perf_counter()
    with open(log_path, "w") as err:
        p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=err, text=True, cwd=_ROOT,
                           timeout=timeout)
    return p.returncode, p.stdout, time.perf_counter() - t


def lcpp_bench(path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, work: Path) -> dict:
    """llama-bench -o json: pp and tg tokens/s (mean over reps, and its stddev)."""
    cmd = [llama_cpp_bin("llama-bench"), "-m", path, "-t", threads, "-p", n_prompt, "-n", n_gen, "-r", reps,
           "-o", "json"]
    rc, out, wall = run(cmd, work / f"llama-bench-{path.stem}.log")
    if rc:
        return {"ok": False, "rc": rc, "cmd": " ".join(map(str, cmd))}
    rows = json.loads(out)
    got = {"ok": True, "wall_s": wall, "cmd": " ".join(map(str, cmd))}
    for r in rows:
        key = "pp" if r.get("n_prompt") and not r.get("n_gen") else "tg"
        got[f"{key}_tok_s"], got[f"{key}_std"] = r.get("avg_ts"), r.get("stddev_ts")
    got["build"] = rows[0].get("build_commit") if rows else None
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                    help=f"layers of the A2.7B shape (the full model has {FULL_LAYERS}; default {DEFAULT_LAYERS} fits "
                         "a 24 GB / 65 GB-disk machine)")
    ap.add_argument("--vocab", type=int, default=SHAPE["vocab"],
                    help="vocabulary rows (default Qwen2's 151936; a small one uses a synthetic byte-level vocabulary)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default="/tmp/mixqrt-moe")
    ap.add_argument("--types", default="Q4_0,Q3_K_M", help="llama.cpp types to compare")
    ap.add_argument("--recipe", default=None, help="mixqrt recipe (default: mixqrt's default)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=PATTERN=FMT[,PATTERN=FMT]",
                    help="also quantize and bench the recipe with these --tensor-type overrides (repeatable), "
                         "e.g. experts-q3p=expert_gate=q3p,expert_up=q3p")
    ap.add_argument("--redo", default="", help="comma list: gguf,quantize,bench")
    ap.add_argument("--doc", default=str(_ROOT / "docs" / "moe.md"))
    ap.add_argument("--doc-only", action="store_true")
    ap.add_argument("--depth-fit", default="", metavar="L1,L2",
                    help="no benches: fit step time = fixed + layers x per-layer to the results of two --layers "
                         "runs already in --work (same vocabulary) and project the full 24-layer model's decode "
                         "and prefill per runtime into docs/moe.md's moe-projection table (labelled projected)")
    a = ap.parse_args(argv)
    from mixqrt.quantize.names import DEFAULT_RECIPE
    recipe = a.recipe or DEFAULT_RECIPE
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.depth_fit:
        pair = [int(v) for v in a.depth_fit.split(",")]
        if len(pair) != 2 or pair[0] == pair[1] or min(pair) < 1:
            raise SystemExit("--depth-fit wants two different layer counts, e.g. 1,4")
        runs = {n: json.loads((work / f"results-l{n}-v{a.vocab}.json").read_text()) for n in pair}
        block = depth_fit_block(runs, "python benchmarks/moe.py " + " ".join(sys.argv[1:] if argv is None else argv))
        update_doc(a.doc, {"moe-projection": block}, title="Mixture of experts: Qwen1.5-MoE-A2.7B shape against llama.cpp")
        print(block)
        return 0
    tag = f"l{a.layers}-v{a.vocab}"
    rpath = work / f"results-{tag}.json"
    res = json.loads(rpath.read_text()) if rpath.exists() else {}
    redo = set(filter(None, a.redo.split(",")))
    types = [t for t in a.types.split(",") if t]

    def save():
        rpath.write_text(json.dumps(res, indent=1, default=str))

    if not a.doc_only:
        log(f"Qwen1.5-MoE-A2.7B shape, {a.layers} of {FULL_LAYERS} layers"
            + ("" if a.layers == FULL_LAYERS else " (--layers; the full model is ~27 GB in F16)")
            + f", vocabulary {a.vocab}")
        f16 = work / f"moe-{tag}-F16.gguf"
        if not f16.exists() or "gguf" in redo:
            log(f"writing {f16}")
            t = time.perf_counter()
            write_gguf(f16, a.layers, a.vocab)
            res["gguf"] = {"seconds": time.perf_counter() - t}
            for k in ("quantize", "bench"):
                res.pop(k, None)
        res.setdefault("gguf", {}).update(path=str(f16), bytes=f16.stat().st_size)
        files = {}
        q = res.setdefault("quantize", {})
        for ft in types:
            out = work / f"moe-{tag}-{ft}.gguf"
            if not out.exists() or "quantize" in redo:
                log(f"llama-quantize {ft}")
                rc, _, wall = run([llama_cpp_bin("llama-quantize"), f16, out, ft, a.threads], work / f"quantize-{ft}.log")
                if rc:
                    raise SystemExit(f"llama-quantize {ft} failed: see {work}/quantize-{ft}.log")
                q[ft] = {"seconds": wall}
            q.setdefault(ft, {})["bytes"] = out.stat().st_size
            files[ft] = out
        variants = {"mixqrt": []}
        for v in a.variant:
            label, _, ovr = v.partition("=")
            variants[f"mixqrt:{label}"] = [o for o in ovr.split(",") if o]
        mxqs = {}
        for key, ovr in variants.items():
            mxq = work / f"moe-{tag}-{recipe}{key[6:].replace(':', '-')}.mxq"
            mxqs[key] = mxq
            if not mxq.exists() or "quantize" in redo:
                log(f"mixqrt quantize --recipe {recipe} {' '.join('--tensor-type ' + o for o in ovr)}")
                rc, out, wall = run([sys.executable, "-m", "mixqrt", "quantize", f16, "--recipe", recipe, "-o", mxq,
                                     "--json", "-q"] + [x for o in ovr for x in ("--tensor-type", o)],
                                    work / f"quantize-{key.replace(':', '-')}.log")
                if rc:
                    raise SystemExit(f"mixqrt quantize failed: see {work}/quantize-{key.replace(':', '-')}.log")
                rep = _last_json(out) or {}
                q[key] = {"seconds": wall, "by_role": rep.get("by_role"), "bits_per_weight": rep.get("bits_per_weight"),
                          "peak_rss_bytes": rep.get("peak_rss_bytes"), "overrides": ovr}
            q.setdefault(key, {})["bytes"] = mxq.stat().st_size
        save()
        b = res.setdefault("bench", {})
        load0 = os.getloadavg()
        for ft, path in files.items():
            if "bench" in redo or not b.get(ft, {}).get("ok"):
                log(f"llama-bench {ft} -t {a.threads} -p {a.n_prompt} -n {a.n_gen} -r {a.reps}")
                b[ft] = lcpp_bench(path, a.threads, a.n_prompt, a.n_gen, a.reps, work)
                save()
        for key, mxq in mxqs.items():
            if "bench" in redo or not b.get(key, {}).get("ok"):
                log(f"mixqrt bench {mxq.name} -t {a.threads} -p {a.n_prompt} -n {a.n_gen} -r {a.reps}")
                rc, out, wall = run([sys.executable, "-m", "mixqrt", "bench", mxq, "-t", a.threads, "-p", a.n_prompt,
                                     "-n", a.n_gen, "-r", a.reps, "--json", "-q"],
                                    work / f"bench-{key.replace(':', '-')}.log")
                row = _last_json(out)
                b[key] = dict(row or {}, ok=rc == 0 and isinstance(row, dict), wall_s=wall)
                save()
        res["loadavg"] = {"before_benches": load0, "after_benches": os.getloadavg()}
        res["settings"] = {"layers": a.layers, "vocab": a.vocab, "threads": a.threads, "n_prompt": a.n_prompt,
                           "n_gen": a.n_gen, "reps": a.reps, "recipe": recipe, "types": types,
                           "variants": {k: v for k, v in variants.items()},
                           "params": int(a.layers * layer_params() + 2 * a.vocab * SHAPE["hidden"] + SHAPE["hidden"]),
                           "provenance": provenance("python benchmarks/moe.py " + " ".join(sys.argv[1:] if argv is None else argv))}
        save()
    data = _ROOT / "docs" / "data" / "moe.json"
    write_json(data, res)
    update_doc(a.doc, doc_blocks(res), title="Mixture of experts: Qwen1.5-MoE-A2.7B shape against llama.cpp")
    print(doc_blocks(res)["moe-results"])
    log(f"wrote {a.doc} and {data}")
    return 0


# ----------------------------------------------------------------------------- depth projection
def depth_fit(runs: dict, key: str, what: str, tokens: int = 1):
    """Seconds per token (decode: tokens 1) or per prompt (prefill: tokens = n_prompt) at two layer counts
    -> (fixed, per layer, projected at FULL_LAYERS) seconds, or None where a run lacks the row."""
    (la, ra), (lb, rb) = sorted(runs.items())
    va, vb = ra.get("bench", {}).get(key, {}).get(what), rb.get("bench", {}).get(key, {}).get(what)
    if not va or not vb:
        return None
    ta, tb = tokens / va, tokens / vb
    per = (tb - ta) / (lb - la)
    fixed = ta - la * per
    return fixed, per, fixed + FULL_LAYERS * per


def _run_date(res: dict) -> str:
    """The 'date: ..., commit ...' line of a run's provenance."""
    lines = [ln.lstrip("- ") for ln in res.get("settings", {}).get("provenance", "").splitlines() if "date:" in ln]
    return lines[-1] if lines else "date unknown"


def depth_fit_block(runs: dict, command: str) -> str:
    """The moe-projection table: per runtime, the measured step times at the two layer counts, the fitted
    per-layer cost and the projected full-depth decode and prefill speed, and mixqrt's ratios."""
    (la, ra), (lb, rb) = sorted(runs.items())
    st = rb.get("settings", {})
    n_prompt = st.get("n_prompt", 512)
    keys = [k for k in st.get("types", []) if k in ra.get("bench", {})] + ["mixqrt"]
    L = [f"- command: `{command}` (no benches of its own: a fit to the two runs below, both in `--work`)",
         f"- runs: the {la}-layer run ({_run_date(ra)}) and the {lb}-layer run ({_run_date(rb)})",
         f"- model: step time = fixed + layers x per-layer, fitted to the two runs' tg{st.get('n_gen')} and "
         f"pp{n_prompt} speeds; **projected** to the full {FULL_LAYERS} layers, not measured",
         "", f"| file | tg at {la} / {lb} layers tok/s | decode ms per layer | **projected tg at {FULL_LAYERS} layers** | "
             f"pp{n_prompt} at {la} / {lb} layers tok/s | prefill s per layer | **projected pp{n_prompt} at {FULL_LAYERS} layers** |",
         "|---|---|---|---|---|---|---|"]
    proj = {}
    for k in keys:
        d, p = depth_fit(runs, k, "tg_tok_s"), depth_fit(runs, k, "pp_tok_s", n_prompt)
        proj[k] = (None if d is None else 1 / d[2], None if p is None else n_prompt / p[2])
        label = f"llama.cpp {k}" if k != "mixqrt" else f"mixqrt {st.get('recipe')}"
        va = [r.get("bench", {}).get(k, {}) for r in (ra, rb)]
        L.append(f"| {label} | {_f(va[0].get('tg_tok_s'), '{:.1f}')} / {_f(va[1].get('tg_tok_s'), '{:.1f}')} | "
                 f"{_f(None if d is None else d[1] * 1e3)} | **{_f(proj[k][0], '{:.1f}')}** | "
                 f"{_f(va[0].get('pp_tok_s'), '{:.0f}')} / {_f(va[1].get('pp_tok_s'), '{:.0f}')} | "
                 f"{_f(None if p is None else p[1], '{:.3f}')} | **{_f(proj[k][1], '{:.0f}')}** |")
    other = [k for k in keys if k != "mixqrt" and proj[k][0]]
    if other and proj["mixqrt"][0]:
        tg_best = max(other, key=lambda k: proj[k][0])
        pp_best = max(other, key=lambda k: proj[k][1] or 0)
        L += ["", f"Projected at {FULL_LAYERS} layers: mixqrt decode **{proj['mixqrt'][0] / proj[tg_best][0]:.2f}x** "
                  f"llama.cpp's faster type there ({tg_best}), prefill **{proj['mixqrt'][1] / proj[pp_best][1]:.2f}x** "
                  f"({pp_best})."]
    return "\n".join(L)


# ----------------------------------------------------------------------------- the page
def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def doc_blocks(res: dict) -> dict:
    st, q, b = res.get("settings", {}), res.get("quantize", {}), res.get("bench", {})
    types = st.get("types", [])
    mx = b.get("mixqrt", {})
    L = [st.get("provenance", "").rstrip(),
         f"- model: Qwen1.5-MoE-A2.7B shape, **{st.get('layers')} of {FULL_LAYERS} layers** (`--layers`), "
         f"vocabulary {st.get('vocab')}, {st.get('params', 0) / 1e9:.2f} B parameters, random weights (F16 GGUF)",
         f"- llama.cpp: `llama-bench -t {st.get('threads')} -p {st.get('n_prompt')} -n {st.get('n_gen')} "
         f"-r {st.get('reps')}` (mean); mixqrt: `mixqrt bench -t {st.get('threads')} -p {st.get('n_prompt')} "
         f"-n {st.get('n_gen')} -r {st.get('reps')}` (median), recipe {st.get('recipe')}",
         *([f"- 1/5/15-minute load average before the benches {', '.join(f'{v:.1f}' for v in la['before_benches'])}, "
            f"after {', '.join(f'{v:.1f}' for v in la['after_benches'])} (2 cores; above 2 means other jobs shared them)"]
           if (la := res.get("loadavg")) else []),
         "", f"| file | bytes | bits/weight | pp{st.get('n_prompt')} tok/s | tg{st.get('n_gen')} tok/s |",
         "|---|---|---|---|---|"]
    p = st.get("params") or 1
    var = st.get("variants") or {"mixqrt": []}
    for ft in types + list(var):
        r, qq = b.get(ft, {}), q.get(ft, {})
        label = f"llama.cpp {ft}" if not ft.startswith("mixqrt") else \
            f"mixqrt {st.get('recipe')}" + "".join(f" `{o}`" for o in var.get(ft, []))
        L.append(f"| {label} | {qq.get('bytes', 0):,} | {8 * qq.get('bytes', 0) / p:.2f} | "
                 f"{_f(r.get('pp_tok_s'))} | {_f(r.get('tg_tok_s'))} |")
    L.append("")
    ok = [ft for ft in types if b.get(ft, {}).get("ok")]
    if ok and mx.get("ok"):
        tg_best = max(ok, key=lambda ft: b[ft]["tg_tok_s"])
        pp_best = max(ok, key=lambda ft: b[ft]["pp_tok_s"])
        q3 = q.get("Q3_K_M", {}).get("bytes")

        def verdict(v, goal, below=False):
            if v is None:
                return "not measured"
            met = v <= goal if below else v >= goal
            return f"**{v:.2f}x** ({'met' if met else 'not met'})"
        L += [f"| target | {' | '.join(('mixqrt ' + st.get('recipe', '')) if k == 'mixqrt' else k[7:] for k in var)} |",
              "|---|" + "---|" * len(var)]
        cells = {"d": [], "f": [], "p": []}
        for k in var:
            m = b.get(k, {})
            cells["d"].append(verdict(m["tg_tok_s"] / b[tg_best]["tg_tok_s"], TARGETS["decode"]) if m.get("ok") else "-")
            cells["f"].append(verdict(q[k]["bytes"] / q3, TARGETS["file"], below=True) if q3 and k in q else "-")
            cells["p"].append(verdict(m["pp_tok_s"] / b[pp_best]["pp_tok_s"], TARGETS["prefill"]) if m.get("ok") else "-")
        L += [f"| decode >= 1.5x llama.cpp's faster type ({tg_best}) | {' | '.join(cells['d'])} |",
              f"| file <= 0.8x Q3_K_M's bytes | {' | '.join(cells['f'])} |",
              f"| prefill >= 1.0x llama.cpp's faster type ({pp_best}) | {' | '.join(cells['p'])} |"]
        for k in var:
            m = b.get(k, {})
            fr, fb = m.get("file_rss_after_decode_bytes"), m.get("file_bytes")
            if m.get("rss_after_decode_bytes") is None or not fb:
                continue
            L += ["", f"{k} resident memory: {m['rss_after_warmup_bytes'] / 2**20:.0f} MiB after the warm-up, "
                      f"{m['rss_after_decode_bytes'] / 2**20:.0f} MiB after pp{st.get('n_prompt')} + "
                      f"{st.get('n_gen')} decode steps"
                      + (f", of which {fr / 2**20:.0f} MiB are pages of the model file = **{fr / fb:.2f}x** its "
                         f"{fb / 2**20:.0f} MiB" if fr is not None else "")
                      + (f" (after the warm-up {m['file_rss_after_warmup_bytes'] / 2**20:.0f} MiB)"
                         if m.get("file_rss_after_warmup_bytes") is not None else "") + "."]
    else:
        L.append("Not measured: " + ", ".join(f"{k}: {'ok' if v.get('ok') else 'failed'}" for k, v in b.items()))
    br = q.get("mixqrt", {}).get("by_role") or {}
    R = ["| role | tensors | formats | params | bits/weight | bytes |", "|---|---|---|---|---|---|"]
    for role, v in sorted(br.items(), key=lambda kv: -kv[1]["bytes"]):
        R.append(f"| {role} | {v.get('tensors', '-')} | {','.join(v['formats'])} | {v['params']:,} | {v['bpw']:.3f} | "
                 f"{v['bytes']:,} |")
    return {"moe-results": "\n".join(L), "moe-roles": "\n".join(R) if br else "Not measured."}


if __name__ == "__main__":
    sys.exit(main())
