"""Calibration text experiments (docs/quality.md §0.4): generate the model's own text once, then
quantize with it alone or mixed with a text file, without generating again for every file.

    python benchmarks/calib_text.py generate M --tokens 4096 -o self.npz        # + self.npz.txt
    python benchmarks/calib_text.py quantize M --recipe 2356 --self self.npz \
        [--text tinyshakespeare.txt] --tokens 4096 -o out.mxq

`quantize` gives the same file as `mixqrt quantize M --recipe R --calibrate self [--calibrate T]
--calib-tokens N` (quantize/calibtext.Generated.take cuts the stored samples exactly where a fresh
generation of that many tokens stops), the recipe header's record included.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the source tree

from mixqrt.quantize.convert import describe, quantize_model  # noqa: E402
from mixqrt.io import open_source  # noqa: E402
from mixqrt.quantize.calibtext import Generated, GeneratedSource, TextSource, generate_source  # noqa: E402


def save(gen: Generated, path: str) -> None:
    arrays = {f"s{k}": ids for k, (_, _, ids) in enumerate(gen.samples)}
    meta = {"record": gen.record, "label": gen.label, "samples": [[j, n_p] for j, n_p, _ in gen.samples]}
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)


def load(path: str) -> Generated:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        samples = tuple((j, n_p, z[f"s{k}"].astype(np.int64)) for k, (j, n_p) in enumerate(meta["samples"]))
    return Generated(samples, meta["record"], meta["label"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("src")
    g.add_argument("--tokens", type=int, default=4096)
    g.add_argument("--ctx", type=int, default=512)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-o", "--output", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("--recipe", default="2356")
    q.add_argument("--self", dest="gen", default=None, help="samples from `generate`")
    q.add_argument("--text", default=None, help="a text file mixed in after the model's own text")
    q.add_argument("--tokens", type=int, default=4096)
    q.add_argument("--refit", type=int, default=0)
    q.add_argument("--damp", type=float, default=0.01)
    q.add_argument("--rotate", action="append", default=None, metavar="ROLE=BLOCK|none",
                   help="as `mixqrt quantize --rotate`")
    q.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)

    t0 = time.time()
    if a.cmd == "generate":
        src = open_source(a.src, progress=True)
        gen = generate_source(src, GeneratedSource(seed=a.seed, save=a.output + ".txt"), a.tokens, a.ctx)
        save(gen, a.output)
        print(f"wrote {a.output}: {sum(ids.size for _, _, ids in gen.samples)} tokens in {len(gen.samples)} "
              f"samples, {time.time() - t0:.0f} s")
        return 0
    sources = []
    if a.gen:
        sources.append(load(a.gen))
    if a.text:
        with open(a.text, encoding="utf-8") as f:
            sources.append(TextSource(f.read(), os.path.basename(a.text)))
    from mixqrt.cli import parse_rotate
    rep = quantize_model(a.src, a.recipe, a.output, calibrate=sources, calib_tokens=a.tokens, refit=a.refit,
                         damp=a.damp, rotate=parse_rotate(a.rotate))
    print(describe(rep))
    print(json.dumps({k: v for k, v in rep.calibration.items() if k != "sources"}),
          [(p["text"], p["tokens"]) for p in rep.calibration.get("sources", [])])
    print(f"wrote {a.output}: {rep.total_bytes:,d} bytes, {rep.seconds:.0f} s, peak RSS "
          f"{rep.peak_rss_bytes / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
