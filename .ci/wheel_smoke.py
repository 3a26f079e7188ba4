"""Smoke test of an installed mixqrt wheel, run from outside the source tree with no compiler on PATH.

    python wheel_smoke.py

Checks: mixqrt imports from site-packages (not a source checkout), nothing can compile, every ISA
tier this CPU offers runs the packed matmul and agrees with the float product, `mixqrt doctor`
runs, and the CLI and the Python API generate from the tiny test model (mixqrt.testing.tiny, from the
installed wheel).
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def step(msg):
    print(f"[smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    import numpy as np

    import mixqrt
    from mixqrt import ops
    from mixqrt.platform import isa
    from mixqrt.formats.codec import dequantize, quantize

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(mixqrt.__file__).resolve()
    step(f"mixqrt imported from {where}")
    if site not in where.parents:
        raise SystemExit(f"mixqrt was imported from {where}, not from this environment's {site}")
    compilers = {c: shutil.which(c) for c in ("cc", "gcc", "c++", "g++", "clang")}
    found = {c: p for c, p in compilers.items() if p}
    if found or os.environ.get("CC") not in (None, "false"):
        raise SystemExit(f"a compiler is reachable: {found} CC={os.environ.get('CC')}")
    step("no compiler on PATH")

    rng = np.random.default_rng(0)
    for fmt in ("q2c", "q3p", "q6", "q8"):
        w = rng.standard_normal((33, 257)).astype(np.float32) * 0.05    # tail shapes: no multiple of a group
        x = rng.standard_normal(257).astype(np.float32)
        qt = quantize(w, fmt)
        want = dequantize(qt) @ x
        for tier in isa.available():
            got_tier = isa.set_isa(tier)
            y = ops.matmul(qt, x)
            err = float(np.max(np.abs(y - want)) / (np.max(np.abs(want)) + 1e-12))
            if got_tier != tier or not err < 0.05:
                raise SystemExit(f"{fmt} on tier {tier} (in force: {got_tier}): relative error {err:.3g}")
        isa.set_isa(isa.best())
    step(f"packed matmul agrees on every tier: {', '.join(isa.available())}")

    doc = subprocess.run(["mixqrt", "doctor"], capture_output=True, text=True, timeout=120)
    print(doc.stdout, end="")
    if doc.returncode != 0 or "ISA tier" not in doc.stdout:
        raise SystemExit(f"mixqrt doctor failed (rc {doc.returncode}): {doc.stderr[-2000:]}")

    from mixqrt.testing.tiny import make_tiny_hf_model
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf_model(Path(tmp) / "tiny")
        env = {**os.environ, "MIXQRT_CACHE": str(Path(tmp) / "cache"), "HF_HUB_OFFLINE": "1"}
        gen = subprocess.run(["mixqrt", "generate", str(model), "-p", "The quick brown fox", "-n", "12",
                              "--temperature", "0"], capture_output=True, text=True, timeout=300, env=env)
        print(gen.stdout, end="")
        if gen.returncode != 0 or not gen.stdout.strip():
            raise SystemExit(f"mixqrt generate failed (rc {gen.returncode}): {gen.stderr[-2000:]}")
        os.environ.update(env)
        pipe = mixqrt.Pipeline(str(model), progress=False)
        out = pipe("def quicksort(xs):", max_new_tokens=8, temperature=0)
        step(f"Pipeline output: {json.dumps(out)}")
        if not out or not out[0].get("generated_text"):
            raise SystemExit("Pipeline generated nothing")
    step("wheel smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
