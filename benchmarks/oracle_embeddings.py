"""Reference embeddings from llama.cpp for the synthetic embedding GGUFs (mixqrt.testing.synthetic_gguf
EMBED_SPECS: one per pooling type, and an EmbeddingGemma-shaped gemma-embedding file with dense layers).

For each configuration: write the GGUF from its seed, run llama.cpp's embedding mode (llama-cpp-python,
embedding=True, the pooling type the file names, F32 weights and KV, 1 thread) on three fixed token
sequences (7, 33 and 64 tokens, each decoded alone), and store the raw (unnormalized) vectors in
tests/data/embed_oracle/<name>.npz; pooling none stores every token's vector. tests/test_embed_oracle.py
compares mixqrt against these files in CI, where llama.cpp is not installed.

    LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin PYTHONPATH=/path/to/llama_cpp_python \\
        python benchmarks/oracle_embeddings.py [--only qwen3-last gemma-embed] [--out DIR]

A second mode stores the real Qwen2.5-Coder-0.5B's last-token embeddings (an F32 GGUF made with
llama-quantize from the Q4_K_M test file, pooling LAST forced) for a few texts:

    python benchmarks/oracle_embeddings.py --real /tmp/qwen-f32.gguf
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mixqrt.testing.synthetic_gguf import EMBED_SPECS, sha256_file, spec, token_ids, write_synthetic_gguf  # noqa: E402

OUT = ROOT / "tests" / "data" / "embed_oracle"
LENGTHS = (7, 33, 64)
REAL_TEXTS = ("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr",
              "The capital of France is Paris.",
              "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)",
              "Embeddings map text to vectors so that similar texts are close together.")


def sequences(name: str) -> list[np.ndarray]:
    ids = token_ids(name, sum(LENGTHS))
    out, pos = [], 0
    for n in LENGTHS:
        out.append(ids[pos:pos + n])
        pos += n
    return out


def run_llamacpp(gguf: Path, seqs, pooling=None) -> list[np.ndarray]:
    """One llama.cpp decode per sequence -> its pooled vector [D] (pooling none: [n, D])."""
    import llama_cpp
    from llama_cpp import Llama

    kw = {} if pooling is None else {"pooling_type": pooling}
    n = max(len(s) for s in seqs)
    llm = Llama(model_path=str(gguf), embedding=True, n_ctx=max(64, n), n_batch=max(64, n), n_ubatch=max(64, n),
                n_threads=1, n_threads_batch=1, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32,
                type_v=llama_cpp.GGML_TYPE_F32, verbose=False, **kw)
    d = llm.n_embd()
    none = llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_NONE
    out = []
    for s in seqs:
        llm._batch.reset()
        llm._ctx.kv_cache_clear()
        llm._batch.add_sequence([int(t) for t in s], 0, True)
        llm._ctx.decode(llm._batch)
        if none:
            ptr = llama_cpp.llama_get_embeddings(llm._ctx.ctx)
            out.append(np.array(ptr[:len(s) * d], dtype=np.float32).reshape(len(s), d))
        else:
            ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
            dim = d
            try:                                   # dense projections may change the width
                dim = llama_cpp.llama_model_n_embd_out(llm._model.model)
            except AttributeError:
                pass
            out.append(np.array(ptr[:dim], dtype=np.float32))
    llm.close()
    return out


def llama_cpp_version() -> str:
    import llama_cpp
    return f"llama-cpp-python {llama_cpp.__version__} (its vendored llama.cpp)"


def worker(name: str, out: Path) -> None:
    cfg = spec(name)
    seqs = sequences(name)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_synthetic_gguf(name, Path(tmp) / f"{name}.gguf")
        sha = sha256_file(gguf)
        vecs = run_llamacpp(gguf, seqs)
    flat = np.concatenate([v.reshape(-1, v.shape[-1]) for v in vecs]).astype(np.float32)
    if not np.isfinite(flat).all():
        raise SystemExit(f"{name}: llama.cpp gave non-finite embeddings")
    from mixqrt.io.atomic import atomic_write
    with atomic_write(out) as fh:
        np.savez_compressed(fh, vectors=flat, lengths=np.asarray(LENGTHS, np.int32),
                            token_ids=np.concatenate(seqs).astype(np.int32), seed=np.int64(cfg["seed"]),
                            config=np.str_(json.dumps(cfg, sort_keys=True)), gguf_sha256=np.str_(sha),
                            llama_cpp_version=np.str_(llama_cpp_version()), name=np.str_(name))
    print(f"{name}: vectors {flat.shape}, std {flat.std():.3f} -> {out} ({out.stat().st_size} B)")


def real(gguf: Path, out: Path) -> None:
    import llama_cpp
    from mixqrt.io import open_source
    tok = open_source(str(gguf)).tokenizer
    seqs = [np.asarray(tok.encode(t), np.int32) for t in REAL_TEXTS]
    vecs = run_llamacpp(gguf, seqs, pooling=llama_cpp.LLAMA_POOLING_TYPE_LAST)
    from mixqrt.io.atomic import atomic_write
    with atomic_write(out) as fh:
        np.savez_compressed(fh, vectors=np.stack(vecs), lengths=np.asarray([len(s) for s in seqs], np.int32),
                            token_ids=np.concatenate(seqs), texts=np.asarray(REAL_TEXTS),
                            gguf_sha256=np.str_(sha256_file(gguf)), llama_cpp_version=np.str_(llama_cpp_version()))
    print(f"real: {np.stack(vecs).shape} -> {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--real", type=Path, default=None, help="an F32 GGUF of the Qwen2.5-Coder-0.5B test model")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        worker(a.worker, a.out / f"{a.worker}.npz")
        return 0
    if a.real:
        real(a.real, a.out / "qwen-real-last.npz")
        return 0
    failed = []
    for name in a.only or list(EMBED_SPECS):
        r = subprocess.run([sys.executable, __file__, "--worker", name, "--out", str(a.out)])
        if r.returncode:
            failed.append(name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
