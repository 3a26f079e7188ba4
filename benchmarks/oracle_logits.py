"""Reference logits from llama.cpp for the synthetic GGUFs of mixqrt.testing.synthetic_gguf.

For each configuration: write the GGUF from its seed, run llama.cpp (llama-cpp-python, F32 weights,
F32 KV cache, no flash attention, 1 thread) over the 128 fixed token ids, and store the logits of
every position in tests/data/oracle/<name>.npz. tests/test_oracle.py then compares mixqrt against
these files in CI, where llama.cpp is not installed.

    python benchmarks/oracle_logits.py                  # every configuration
    python benchmarks/oracle_logits.py --only qwen3 gemma3
    python benchmarks/oracle_logits.py --out /tmp/oracle

Needs llama-cpp-python (benchmarks/llamacpp_build.sh builds it from its PyPI sdist). Each
configuration runs in its own child process, so one that llama.cpp cannot load (or crashes on) costs
one file, not the run. The .npz holds only arrays and strings (load with allow_pickle=False):
logits float32 [128, vocab], token_ids int32, seed, config (JSON), gguf_sha256, llama_cpp_version.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mixqrt.testing.synthetic_gguf import (SPECS, reference_logits, sha256_file, spec, token_ids,  # noqa: E402
                                           write_synthetic_gguf)

OUT = ROOT / "tests" / "data" / "oracle"


def llama_cpp_version() -> str:
    import llama_cpp
    return f"llama-cpp-python {llama_cpp.__version__} (its vendored llama.cpp)"


def run_llamacpp(gguf: Path, ids: np.ndarray) -> np.ndarray:
    """Logits [len(ids), vocab] for every position, one batch, F32 everywhere llama.cpp allows."""
    import llama_cpp
    from llama_cpp import Llama

    n = len(ids)
    llm = Llama(model_path=str(gguf), n_ctx=2 * n, n_batch=n, n_ubatch=n, n_threads=1, n_threads_batch=1,
                logits_all=True, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32,
                type_v=llama_cpp.GGML_TYPE_F32, seed=0, verbose=False)
    llm.reset()
    llm.eval([int(t) for t in ids])
    out = np.array(llm.scores[:n], dtype=np.float32, copy=True)
    llm.close()
    return out


def worker(name: str, out: Path) -> None:
    """Child process: one configuration -> one .npz."""
    cfg = spec(name)
    ids = token_ids(name)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_synthetic_gguf(name, Path(tmp) / f"{name}.gguf")
        sha = sha256_file(gguf)
        logits = run_llamacpp(gguf, ids)
    if logits.shape != (len(ids), cfg["vocab"]) or not np.isfinite(logits).all():
        raise SystemExit(f"{name}: llama.cpp gave logits of shape {logits.shape} / non-finite values")
    from mixqrt.io.atomic import atomic_write
    with atomic_write(out) as fh:
        np.savez_compressed(fh, logits=logits, token_ids=ids, seed=np.int64(cfg["seed"]),
                            config=np.str_(json.dumps(cfg, sort_keys=True)), gguf_sha256=np.str_(sha),
                            llama_cpp_version=np.str_(llama_cpp_version()), name=np.str_(name))
    ref = reference_logits(name, ids)
    rel = float(np.abs(ref - logits).max() / np.abs(logits).max())
    top1 = float(np.mean(ref.argmax(-1) == logits.argmax(-1)))
    print(f"{name}: logits {logits.shape}, std {logits.std():.3f}; numpy reference: top-1 {top1:.3f}, "
          f"max rel err {rel:.2e}; -> {out} ({out.stat().st_size} B)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(SPECS), help="configurations (default: all)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder for the .npz files (default {OUT})")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        worker(a.worker, a.out / f"{a.worker}.npz")
        return 0
    failed = []
    for name in a.only or list(SPECS):
        r = subprocess.run([sys.executable, __file__, "--worker", name, "--out", str(a.out)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x])})
        if r.returncode:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            print(f"{name}: llama.cpp failed (exit {r.returncode}): {' | '.join(tail)}")
            failed.append(name)
        else:
            print(r.stdout.strip())
    total = sum(p.stat().st_size for p in a.out.glob("*.npz"))
    print(f"{a.out}: {total / 1e6:.2f} MB in all" + (f"; not produced: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
