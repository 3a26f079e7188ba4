"""mixqrt's embeddings against llama.cpp's embedding mode, without llama.cpp: tests/data/embed_oracle/
<name>.npz holds llama.cpp's raw pooled vectors (F32 weights and KV) of three fixed token sequences for
each synthetic embedding GGUF of mixqrt.testing.synthetic_gguf.EMBED_SPECS (written by
benchmarks/oracle_embeddings.py with llama-cpp-python 0.3.36's vendored llama.cpp): last-token
(Qwen3-Embedding), mean, CLS and no pooling, and an EmbeddingGemma-shaped gemma-embedding file
(bidirectional attention with a symmetric sliding window, mean pooling, two dense projections).

Each test rebuilds the GGUF from its seed (sha256 must match the file llama.cpp ran), converts it to an
f32 .mxq (so the pooling type, attention and dense tensors travel through the file), and compares:
cosine >= 0.9999 for every vector, as the issue asks.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mixqrt.testing.synthetic_gguf import EMBED_SPECS, sha256_file, spec, write_synthetic_gguf

ORACLE = Path(__file__).parent / "data" / "embed_oracle"
MIN_COS = 0.9999
MAX_REL = 2e-3          # gemma's fp16-table GELU in llama.cpp (tests/test_oracle.py MAX_REL_FOR) bounds it


def _load(name):
    with np.load(ORACLE / f"{name}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed_oracle")
    cache = {}

    def get(name):
        if name not in cache:
            from mixqrt.pipeline import LoadedModel
            from mixqrt.quantize.convert import quantize_model
            z = _load(name)
            g = write_synthetic_gguf(name, folder / f"{name}.gguf", seed=int(z["seed"]))
            assert sha256_file(g) == str(z["gguf_sha256"]), "the rebuilt GGUF differs from the one llama.cpp ran"
            out = folder / f"{name}.mxq"
            quantize_model(str(g), "f32", out, progress=False)
            cache[name] = (z, LoadedModel(out))
        return cache[name]
    return get


def test_every_embedding_configuration_has_an_oracle_file():
    assert sorted(p.stem for p in ORACLE.glob("*.npz") if p.stem in EMBED_SPECS) == sorted(EMBED_SPECS)
    assert sum(p.stat().st_size for p in ORACLE.glob("*.npz")) < 500_000


@pytest.mark.parametrize("name", sorted(EMBED_SPECS))
def test_embeddings_agree_with_llamacpp(name, converted):
    z, lm = converted(name)
    assert json.loads(str(z["config"])) == json.loads(json.dumps(spec(name))), \
        "EMBED_SPECS changed: rerun benchmarks/oracle_embeddings.py"
    lens = [int(n) for n in z["lengths"]]
    ids = np.split(z["token_ids"].astype(np.int64), np.cumsum(lens)[:-1])
    emb = lm.embedder(normalize=False)
    assert emb.pooling == {0: "none", 1: "mean", 2: "cls", 3: "last"}[spec(name)["pooling"]]
    ours = emb.embed(ids)
    ours = np.concatenate(ours) if isinstance(ours, list) else ours
    ref = z["vectors"]
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert cos.min() >= MIN_COS and rel <= MAX_REL, f"{name}: min cosine {cos.min():.6f}, max rel err {rel:.2e}"


def test_gemma_embedding_reads_as_bidirectional_with_dense_layers(converted):
    _, lm = converted("gemma-embed")
    info = lm.meta["embedding"]
    assert info["causal"] is False and info["pooling"] == "mean" and len(info["dense"]) == 2
    emb = lm.embedder()
    assert not emb.causal and [w.shape for w, _ in emb.dense] == [(96, 64), (64, 96)]


def test_packing_does_not_change_a_vector(converted):
    """Inputs packed into one forward give the vectors they get alone (attention stays per input)."""
    z, lm = converted("qwen2-mean")
    ids = np.split(z["token_ids"].astype(np.int64), np.cumsum([int(n) for n in z["lengths"]])[:-1])
    together = lm.embedder().embed(ids)
    alone = np.concatenate([lm.embedder(batch_tokens=1).embed([s]) for s in ids])
    np.testing.assert_allclose(together, alone, rtol=2e-5, atol=2e-6)


def test_real_qwen_last_token_agrees_with_llamacpp(qwen_gguf_path):
    """The real Qwen2.5-Coder-0.5B in last-token mode: mixqrt's f32 forward of the test GGUF's weights
    against llama.cpp's embedding mode (pooling LAST forced) on an F32 GGUF that llama-quantize made from
    the same file (qwen-real-last.npz; benchmarks/oracle_embeddings.py --real)."""
    from mixqrt.generation.embed import Embedder
    from mixqrt.io import open_source
    from mixqrt.models import load_f32

    z = _load("qwen-real-last")
    with open_source(qwen_gguf_path) as src:
        model = load_f32(src)
        tok = src.tokenizer
    ids = np.split(z["token_ids"].astype(np.int64), np.cumsum([int(n) for n in z["lengths"]])[:-1])
    assert [tok.encode(str(t)) for t in z["texts"]] == [list(s) for s in ids]
    ours = Embedder(model, pooling="last", normalize=False).embed(ids)
    ref = z["vectors"]
    cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= MIN_COS, f"min cosine {cos.min():.6f}"
