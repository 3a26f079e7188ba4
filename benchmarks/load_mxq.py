"""Load time and RSS of a quantized Qwen2.5-0.5B-shaped .mxq file.

    python benchmarks/load_mxq.py [--file F.mxq] [--runs 7] [--json out.json]
    python benchmarks/load_mxq.py --file REAL.mxq --model      # + mixqrt.load and a cold `generate -n 1`

Without --file it builds (once) a file with the real Qwen2.5-0.5B tensor names and shapes under the
2356 recipe (q2c embedding, q6 attention, q3p FFN, q5g norms, f32 biases, q6 lm_head), random packed
bytes, the real config and a synthetic tokenizer.json of the real one's size (~7 MB, 151643 tokens,
151387 merges). Each run is a fresh interpreter that imports everything first, then times
MxqFile(path) and reads VmRSS / RssAnon / RssFile from /proc/self/status before and after.
'cold' runs evict the file from the page cache first (posix_fadvise DONTNEED), 'warm' runs do not.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

QWEN05B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21, "attention_dropout": 0.0,
}
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
                 " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                 "{{- '<|im_start|>assistant\\n' }}{%- endif %}") * 8


def synthetic_tokenizer_json(seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json with Qwen2's vocabulary and merge counts (content is random)."""
    r = random.Random(seed)
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0x100, 0x144)]
    vocab, seen = {}, set()
    while len(vocab) < 151643:
        tok = "".join(r.choice(alphabet) for _ in range(r.randint(1, 9)))
        if tok not in seen:
            seen.add(tok)
            vocab[tok] = len(vocab)
    toks = list(vocab)
    merges = [f"{r.choice(toks)} {r.choice(toks)}" for _ in range(151387)]
    added = [{"id": 151643 + i, "content": f"<|extra_{i}|>", "special": True} for i in range(22)]
    return json.dumps({"version": "1.0", "added_tokens": added, "pre_tokenizer": {"type": "ByteLevel"},
                       "model": {"type": "BPE", "vocab": vocab, "merges": merges}}, ensure_ascii=False)


def build(path: str) -> None:
    import numpy as np
    from test_mxq_fuzz import random_qtensor  # installs the formats stand-in when needed
    from test_mxq_layout import qwen05b_tensors

    from mixqrt.io.mxq import MxqWriter
    meta = {"config": QWEN05B_CONFIG, "tokenizer": synthetic_tokenizer_json(), "chat_template": CHAT_TEMPLATE,
            "generation_config": {"eos_token_id": [151645, 151643], "temperature": 0.7, "top_p": 0.8},
            "recipe": {"name": "2356", "embed": "q2c", "attn": "q6", "ffn": "q3p", "norm": "q5g",
                       "bias": "f32", "lm_head": "q6"},
            "source": "synthetic: Qwen2.5-0.5B names and shapes, random packed bytes"}
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    with MxqWriter(path, meta) as w:
        for name, fmt, shape, layer in qwen05b_tensors():
            w.add(name, random_qtensor(rng, fmt, shape), layer=layer)
    print(f"built {path}: {os.path.getsize(path) / 1e6:.1f} MB in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def measure(path: str, cold: bool, hugepages: bool, willneed: bool) -> dict:
    """One run, in this (fresh) process."""
    import numpy  # noqa: F401  (imports are not part of the load)
    import test_mxq_fuzz  # noqa: F401

    from mixqrt.io.arena import drop_cached
    from mixqrt.io.mxq import MxqFile
    from mixqrt.formats.qtensor import QTensor  # noqa: F401
    if cold:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        drop_cached(fd)
        os.close(fd)
    before = _status()
    t = time.perf_counter()
    f = MxqFile(path, hugepages=hugepages, willneed=willneed)
    dt = time.perf_counter() - t
    after = _status()
    res = {"load_s": dt, "header_bytes": f.header_bytes, "tensors": len(f.tensors), "file_bytes": f.arena.size,
           "d_rss": after["VmRSS"] - before["VmRSS"], "d_anon": after["RssAnon"] - before["RssAnon"],
           "d_file": after["RssFile"] - before["RssFile"], "peak_minus_before": after["VmHWM"] - before["VmRSS"]}
    with open(path, "rb") as fh:
        res["json_header_bytes"] = int.from_bytes(fh.read(24)[16:24], "little")
    t = time.perf_counter()
    tok = f.meta["tokenizer"]                         # what the tokenizer costs when it is built
    res["tokenizer_read_s"] = time.perf_counter() - t
    res["d_rss_with_tokenizer"] = _status()["VmRSS"] - before["VmRSS"]
    del tok
    f.close()
    return res


def measure_model(path: str) -> dict:
    """mixqrt.load(path) in this fresh process: seconds to a ready model, RSS added by the load, then the
    RSS the first token adds (one forward of one token: what decode touches), and the CPU time."""
    import numpy  # noqa: F401  (python start-up and numpy are not part of the load)
    import mixqrt
    before = _status()
    c0 = time.process_time()
    t = time.perf_counter()
    m = mixqrt.load(path, progress=False)
    dt = time.perf_counter() - t
    after = _status()
    cache = m.model.make_cache(8)
    t = time.perf_counter()
    m.model(numpy.array([1000]), cache, 0, last_only=True)
    ft = time.perf_counter() - t
    first = _status()
    return {"load_s": dt, "load_cpu_s": time.process_time() - c0, "d_rss": after["VmRSS"] - before["VmRSS"],
            "d_anon": after["RssAnon"] - before["RssAnon"], "d_file": after["RssFile"] - before["RssFile"],
            "first_token_s": ft, "d_rss_first_token": first["VmRSS"] - after["VmRSS"]}


def measure_generate(path: str, runs: int) -> list[dict]:
    """Wall time of a cold `python -m mixqrt generate PATH -p hi -n 1` (interpreter start included)."""
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "mixqrt", "generate", path, "-p", "hi", "-n", "1"],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(f"generate failed: {r.stderr[-2000:]}")
        out.append({"wall_s": wall})
    return out


def model_main(path: str, runs: int) -> dict:
    import resource
    loads = []
    for _ in range(runs):
        o = subprocess.run([sys.executable, __file__, "--_model", path], check=True, capture_output=True,
                           text=True).stdout
        loads.append(json.loads(o.strip().splitlines()[-1]))
    gens = []
    for _ in range(runs):
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        g = measure_generate(path, 1)[0]
        c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
        g["cpu_s"] = (c2.ru_utime - c.ru_utime) + (c2.ru_stime - c.ru_stime)
        gens.append(g)
    med = statistics.median
    res = {"file": path, "runs": runs, "load_s_median": med(r["load_s"] for r in loads),
           "load_s_min": min(r["load_s"] for r in loads), "load_cpu_s_median": med(r["load_cpu_s"] for r in loads),
           "d_rss_max": max(r["d_rss"] for r in loads), "d_rss_first_token_max": max(r["d_rss_first_token"] for r in loads),
           "generate_wall_s_median": med(g["wall_s"] for g in gens), "generate_wall_s_min": min(g["wall_s"] for g in gens),
           "generate_cpu_s_median": med(g["cpu_s"] for g in gens), "loadavg": os.getloadavg()}
    print(f"mixqrt.load: {res['load_s_median'] * 1e3:.0f} ms median ({res['load_s_min'] * 1e3:.0f} min, "
          f"{res['load_cpu_s_median'] * 1e3:.0f} ms CPU), +{res['d_rss_max'] / 2**20:.1f} MiB RSS; the first token "
          f"then touches +{res['d_rss_first_token_max'] / 2**20:.1f} MiB")
    print(f"cold `mixqrt generate -p hi -n 1`: {res['generate_wall_s_median']:.2f} s wall median "
          f"({res['generate_wall_s_min']:.2f} min), {res['generate_cpu_s_median']:.2f} s CPU; load average "
          f"{res['loadavg'][0]:.1f}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=None)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", action="store_true", help="also time mixqrt.load and a cold generate -n 1 "
                    "(needs a real model file: --file)")
    ap.add_argument("--_child", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._model:
        print(json.dumps(measure_model(args._model)))
        return 0
    if args.model:
        if not args.file:
            ap.error("--model needs --file REAL.mxq")
        res = model_main(args.file, args.runs)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
    if args._child:
        path, cold, huge, willneed = args._child
        print(json.dumps(measure(path, cold == "1", huge == "1", willneed == "1")))
        return 0

    path = args.file or os.path.join("/tmp", "mixqrt-bench", "qwen2.5-0.5b-2356-synthetic.mxq")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        build(path)
    table = {}
    for label, cold, huge, willneed in [("cold", 1, 0, 0), ("warm", 0, 0, 0), ("warm+hugepages+willneed", 0, 1, 1)]:
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, __file__, "--_child", path, str(cold), str(huge), str(willneed)],
                                 check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        r0 = runs[0]
        row = {"runs": len(runs), "load_s_median": statistics.median(r["load_s"] for r in runs),
               "load_s_max": max(r["load_s"] for r in runs), "header_bytes": r0["header_bytes"],
               "d_rss_max": max(r["d_rss"] for r in runs), "d_anon_max": max(r["d_anon"] for r in runs),
               "d_file_max": max(r["d_file"] for r in runs),
               "peak_minus_before_max": max(r["peak_minus_before"] for r in runs),
               "tensors": r0["tensors"], "file_bytes": r0["file_bytes"], "json_header_bytes": r0["json_header_bytes"],
               "tokenizer_read_s_max": max(r["tokenizer_read_s"] for r in runs),
               "d_rss_with_tokenizer_max": max(r["d_rss_with_tokenizer"] for r in runs)}
        row["ok"] = row["load_s_max"] < 0.2 and row["d_rss_max"] <= row["header_bytes"]
        table[label] = row
    print(f"{'mode':<26}{'load med':>10}{'load max':>10}{'header':>10}{'dRSS max':>10}{'dAnon':>10}{'dFile':>10}{'peak':>10}  ok")
    for label, r in table.items():
        print(f"{label:<26}{r['load_s_median'] * 1e3:>8.1f}ms{r['load_s_max'] * 1e3:>8.1f}ms"
              f"{r['header_bytes'] / 2**20:>8.2f}Mi{r['d_rss_max'] / 2**20:>8.2f}Mi{r['d_anon_max'] / 2**20:>8.2f}Mi"
              f"{r['d_file_max'] / 2**20:>8.2f}Mi{r['peak_minus_before_max'] / 2**20:>8.2f}Mi  {r['ok']}")
    r = next(iter(table.values()))
    print(f"file {path}: {r['file_bytes'] / 1e6:.1f} MB, {r['tensors']} tensors")
    print(f"JSON header {r['json_header_bytes']} B; reading meta['tokenizer'] (blob, CRC, UTF-8): "
          f"{r['tokenizer_read_s_max'] * 1e3:.1f} ms, dRSS then {r['d_rss_with_tokenizer_max'] / 2**20:.2f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"file": path, "modes": table}, fh, indent=1)
    return 0 if all(r["ok"] for r in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
