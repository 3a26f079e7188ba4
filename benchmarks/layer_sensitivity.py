"""Per-layer sensitivity on top of 2356: the KL gained by one upgrade at a time, to place spare bytes.

    python benchmarks/layer_sensitivity.py [--text tinyshakespeare.txt] [--offset 400000] [--chunks 2]
                                           [--upgrade q4] [--json out.json]

Reference: every matrix q8 (norms, biases f32). Base: the 2356 recipe's formats (RTN with the search
quantizer, norms f32 so only the matrices differ). Each variant upgrades ONE thing of the base: one
layer's gate+up (fused at load, so they move together), one layer's down, or lm_head downgraded to
the --lm-head format. Reported: KL(q8 || variant) and the byte change, so KL per byte ranks the
upgrades. Ranking text: Tiny Shakespeare from --offset characters (past the calibration tokens),
never the evaluation text. The model is built in memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sensitivity import chunk_runner, load_source  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from mixqrt.formats import layout, quantize  # noqa: E402
from mixqrt.quantize.recipes import get_recipe, role_of  # noqa: E402
from mixqrt.testing import model_path  # noqa: E402

GGUF = str(model_path("qwen"))     # the Qwen test model (mixqrt.testing)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--offset", type=int, default=400000)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--upgrade", default="q4")
    ap.add_argument("--lm-head", default="q4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    src, cls, args, f32 = load_source(a.model)
    rec = get_recipe("2356")
    ref = {n: (w if w.ndim == 1 else quantize(w, "q8")) for n, w in f32.items()}

    def q(n, fmt):
        return quantize(f32[n], fmt, search=fmt in ("q6", "q4", "q3u", "q3p"))

    base = {n: (w if w.ndim == 1 else q(n, rec.format_for(n, role_of(n)))) for n, w in f32.items()}
    run = chunk_runner(src, cls, args, a.text, a.offset, a.ctx, a.chunks)

    ref_lp = run(ref)

    def kl(lps):
        return float(np.concatenate([(np.exp(r) * (r - lp)).sum(-1)[:-1] for r, lp in zip(ref_lp, lps)]).mean())

    kl0 = kl(run(base))
    rows = [{"what": "2356 (base)", "kl": kl0, "bytes": 0}]
    print(f"2356 base KL {kl0:.5f} ({time.time() - t0:.0f} s)", flush=True)
    variants = [("lm_head", ["lm_head.weight"], a.lm_head)]
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        variants += [(f"L{i} gate+up", [p + "gate_proj.weight", p + "up_proj.weight"], a.upgrade),
                     (f"L{i} down", [p + "down_proj.weight"], a.upgrade)]
    for what, names, fmt in variants:
        t1 = time.time()
        w = dict(base)
        db = 0
        for n in names:
            w[n] = q(n, fmt)
            db += layout.expected_nbytes(fmt, f32[n].shape) - base[n].nbytes
        k = kl(run(w))
        rows.append({"what": what, "names": names, "fmt": fmt, "kl": k, "dkl": k - kl0, "bytes": int(db)})
        print(f"{what:14s} {fmt:4s} KL {k:.5f}  dKL {k - kl0:+.5f}  dbytes {db:+,d}  ({time.time() - t1:.0f} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"text": a.text, "offset": a.offset, "chunks": a.chunks, "rows": rows},
                                               indent=1))
    return rows


if __name__ == "__main__":
    main()
