"""Which roles gain from a block Hadamard rotation: KL against f32 with ONE role group quantized, plain
or rotated (docs/quality.md §0.5).

    python benchmarks/rotation_roles.py ROLES FMT SPEC [SPEC ...] [--model GGUF] [--text FILE]
                                        [--offset CHARS] [--chunks 2]

ROLES: comma list of recipe roles (e.g. ffn_gate,ffn_up,ffn_down); FMT: the format they get (search
quantizer); SPEC: 0 (plain) or BLOCK[:s] (rotated by blocks of BLOCK, :s with random signs). Every
other tensor stays f32. The rotation is applied to the weights here (rotate, quantize, dequantize,
unrotate), which is the same product the runtime computes by rotating the activations. The default
text is Tiny Shakespeare from character 400,000: held-out text, never the evaluation text.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/ (sensitivity.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # the source tree

from sensitivity import GGUF, chunk_runner, load_source  # noqa: E402

from mixqrt.formats import dequantize, quantize, rotation  # noqa: E402
from mixqrt.quantize.recipes import role_of  # noqa: E402

TEXT = str(Path(__file__).resolve().parents[2] / "tests" / "data" / "tinyshakespeare.txt")


def fake_quant(w: np.ndarray, fmt: str, spec: str) -> np.ndarray:
    """The effective weight of w quantized to fmt, plain (spec "0") or rotated ("64", "64:s")."""
    search = fmt not in ("q2c", "q8")
    if spec == "0":
        return dequantize(quantize(w, fmt, search=search))
    b = int(spec.split(":")[0])
    seed = rotation.DEFAULT_SEED if spec.endswith(":s") else None
    if seed is not None:
        return dequantize(quantize(w, fmt, search=search, rot={"block": b, "seed": seed}))
    # no signs: the bare block Hadamard (H is its own inverse)
    hw = rotation.hadamard(w, b, None)
    return rotation.hadamard(dequantize(quantize(hw, fmt, search=search)), b, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roles")
    ap.add_argument("fmt")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--offset", type=int, default=400000)
    ap.add_argument("--chunks", type=int, default=2)
    a = ap.parse_args(argv)
    src, cls, args, f32 = load_source(a.model)
    run = chunk_runner(src, cls, args, a.text, a.offset, 512, a.chunks)
    base = run(f32)
    roles = a.roles.split(",")
    for spec in a.specs:
        t0 = time.time()
        w = dict(f32)
        for n, arr in f32.items():
            if arr.ndim == 2 and role_of(n) in roles:
                w[n] = fake_quant(arr, a.fmt, spec)
        kl = float(np.mean(np.concatenate([(np.exp(b) * (b - lp)).sum(-1) for lp, b in zip(run(w), base)])))
        print(f"{a.roles} {a.fmt} rotation {spec}: KL {kl:.5f} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
