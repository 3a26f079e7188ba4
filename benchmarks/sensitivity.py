"""Per-role quantization sensitivity: the KL / PPL cost of quantizing ONE tensor role, all else q8.

    python benchmarks/sensitivity.py [--model GGUF] [--text FILE] [--offset CHARS] [--chunks 1]
                                     [--roles ffn_down,...] [--formats q2c,q3p,...] [--imatrix FILE]
                                     [--json out.json]

Base: every matrix q8 (norms, biases f32). For each (role, format) only that role's tensors are
re-quantized (error-minimising search quantizer, as `mixqrt quantize` does) and the model is run
over `chunks` chunks of `ctx` tokens of the text, starting `offset` characters in (default 100000:
disjoint from the first 60000 characters used for the headline perplexities). Reported: mean
KL(base || variant) over every position of the chunk, PPL over the second half of each chunk
(llama-perplexity's scoring), bytes of the role. The model is built in memory (no .mxq written).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixqrt.commands.evaluate import log_softmax  # noqa: E402
from mixqrt.io import open_source  # noqa: E402
from mixqrt.models import get_model_class  # noqa: E402
from mixqrt.formats import dequantize, layout, quantize  # noqa: E402
from mixqrt.formats.codec import SEARCH_FORMATS  # noqa: E402
from mixqrt.quantize.imatrix import importance_for, load_imatrix  # noqa: E402
from mixqrt.quantize.recipes import role_of  # noqa: E402
from mixqrt.testing import model_path  # noqa: E402

GGUF = str(model_path("qwen"))     # the Qwen test model (mixqrt.testing)
TEXT = str(Path(__file__).resolve().parents[1] / "tests" / "data" / "wikitext-2-test.txt")
GROUPS = {  # benchmark role -> recipe roles
    "embed": ("embed",), "attn_qkv": ("attn_q", "attn_k", "attn_v"), "attn_o": ("attn_o",),
    "ffn_gate": ("ffn_gate",), "ffn_up": ("ffn_up",), "ffn_down": ("ffn_down",), "lm_head": ("lm_head",),
    "norm": ("norm",), "ffn": ("ffn_gate", "ffn_up", "ffn_down"),
}
MATRIX_FORMATS = ("q2c", "q3p", "q3u", "q4", "q6", "q8")


def _q(arr, fmt, name, imat, mode="search"):
    opts = {}
    if fmt in SEARCH_FORMATS and arr.ndim == 2 and mode != "minmax":
        opts = {"search": True, "importance": importance_for(imat, name, arr.shape[1]) if mode == "imatrix" else None}
    if fmt == "q5g":      # per-vector range, as the 2356 recipe binds it
        return quantize(arr, fmt)
    return quantize(arr, fmt, **opts)


def load_source(model: str):
    """-> (source, model class, args, {name: float32 tensor}) with a tied lm_head resolved."""
    src = open_source(model, progress=False)
    cls = get_model_class(src.arch)
    args = cls.args_class.from_dict(src.config)
    f32 = {n: src.get(n) for n in src.tensor_names()}
    f32.setdefault("lm_head.weight", f32["model.embed_tokens.weight"])
    return src, cls, args, f32


def chunk_runner(src, cls, args, text_path: str, offset: int, ctx: int, n: int):
    """-> run(weights): log-softmax logits [ctx, V] of each of the n ctx-token chunks of the text (from
    character `offset` on), for a model built from `weights` (shared with layer_sensitivity.py)."""
    with open(text_path, encoding="utf-8") as f:
        text = f.read()[offset:]
    toks = src.tokenizer.encode(text[: 40 * ctx * n], add_special_tokens=False)
    chunks = [np.asarray(toks[i * ctx:(i + 1) * ctx], dtype=np.int64) for i in range(n)]

    def run(weights):
        m = cls(args, dict(weights))
        return [log_softmax(m.logits(ids)) for ids in chunks]
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--offset", type=int, default=100000)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--roles", default=",".join(GROUPS))
    ap.add_argument("--formats", default="q2c,q3p,q4,q6")
    ap.add_argument("--only", default=None, help="explicit ROLE:FMT[:MODE] list (MODE: search (default), minmax, "
                                                 "imatrix), measured in this order")
    ap.add_argument("--imatrix", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    t0 = time.time()
    src, cls, args, f32 = load_source(a.model)
    imat = load_imatrix(a.imatrix) if a.imatrix else None
    names = list(src.tensor_names())
    roles = {n: role_of(n) for n in f32}
    base = {n: (w if w.ndim == 1 else quantize(w, "q8")) for n, w in f32.items()}
    run = chunk_runner(src, cls, args, a.text, a.offset, a.ctx, a.chunks)

    base_lp = run(base)

    def score(lps):
        kl, nll, cnt = [], 0.0, 0
        for lp, bp, ids in zip(lps, base_lp, chunks):
            p = np.exp(bp)
            kl.append((p * (bp - lp)).sum(-1)[:-1])
            first = a.ctx // 2
            nll -= lp[np.arange(first, a.ctx - 1), ids[first + 1:]].sum()
            cnt += a.ctx - 1 - first
        return float(np.concatenate(kl).mean()), math.exp(nll / cnt)

    kl0, ppl0 = score(base_lp)
    rows = [{"role": "(all q8)", "fmt": "q8", "kl": kl0, "ppl": ppl0, "bytes": None}]
    print(f"base q8: ppl {ppl0:.3f} ({time.time() - t0:.0f} s)", flush=True)
    if a.only:
        pairs = [tuple((p + ":search").split(":")[:3]) for p in a.only.split(",")]
    else:
        pairs = [(g, f) for g in a.roles.split(",")
                 for f in (("q5g", "q8") if g == "norm" else [f for f in a.formats.split(",") if f in MATRIX_FORMATS])]
        pairs = [(g, f, "imatrix" if imat else "search") for g, f in pairs]
    for group, fmt, mode in pairs:
        members = [n for n in f32 if roles[n] in GROUPS[group]]
        if True:
            t1 = time.time()
            w = dict(base)
            nbytes = 0
            for n in members:
                qt = _q(f32[n], fmt, n, imat, mode.replace("-rescaled", ""))
                if mode.endswith("-rescaled") and f32[n].ndim == 2:
                    # diagnosis only (not storable in the layout): undo the per-row shrink of a
                    # least-squares quantizer, y / beta with beta = <y, w> / <w, w>
                    y, x = dequantize(qt), f32[n]
                    beta = (y * x).sum(1, keepdims=True) / np.maximum((x * x).sum(1, keepdims=True), 1e-30)
                    w[n] = np.ascontiguousarray(y / np.where(beta > 0, beta, 1), dtype=np.float32)
                    nbytes += layout.expected_nbytes(fmt, f32[n].shape)
                    continue
                w[n] = qt if f32[n].ndim == 2 else dequantize(qt)
                nbytes += layout.expected_nbytes(fmt, f32[n].shape)
            kl, ppl = score(run(w))
            rows.append({"role": group, "fmt": fmt, "mode": mode, "kl": kl, "ppl": ppl, "bytes": nbytes})
            if a.json:
                Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
            print(f"{group:9s} {fmt:4s} {mode:7s} KL {kl:.5f}  PPL {ppl:8.3f}  bytes {nbytes:11,d}  ({time.time() - t1:.0f} s)",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "text": a.text, "offset": a.offset,
                                            "chunks": a.chunks, "ctx": a.ctx, "imatrix": a.imatrix,
                                            "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
