"""The prompt cache on edits of a prompt's tail (what an editor sends at each keystroke): the K/V of
every token up to the first differing one is reused, not only for pure extensions."""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.generation.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from serve_helpers import tiny_pipeline
    pipe = tiny_pipeline(tmp_path_factory.mktemp("fimcache"))
    eng = Engine(pipe, max_slots=2, kv_type="f32")   # the token-exact prefix tree (a packed cache shares whole blocks)
    yield eng
    eng.close()


def _run(eng, ids):
    last = None
    for r in eng.submit(ids, max_new_tokens=3, temperature=0):
        last = r
    return last


@pytest.mark.parametrize("edit", ["replace", "insert", "delete", "extend"])
def test_tail_edit_reuses_kv_up_to_the_first_difference(engine, edit):
    rng = np.random.default_rng(hash(edit) % 1000)
    base = [int(t) for t in rng.integers(10, 300, size=120)]
    _run(engine, base)
    k = 100                                        # the first differing position
    new = {"replace": base[:k] + [301] + base[k + 1:], "insert": base[:k] + [302, 303] + base[k:],
           "delete": base[:k] + base[k + 3:], "extend": base + [304, 305]}[edit]
    first = next(i for i, (a, b) in enumerate(zip(base, new)) if a != b) if edit != "extend" else len(base)
    r = _run(engine, new)
    assert r.cached_tokens == min(first, len(new) - 1)


def test_edited_prompt_gives_the_same_tokens_as_a_cold_one(engine):
    base = list(range(20, 140))
    new = base[:90] + [7, 8, 9] + base[95:]
    _run(engine, base)
    warm = [r.token for r in engine.submit(new, max_new_tokens=6, temperature=0) if r.token is not None]
    cold = [r.token for r in engine.submit(new, max_new_tokens=6, temperature=0, cache_prompt=False)
            if r.token is not None]
    assert warm == cold


def test_fim_ids_from_gguf_metadata_win_and_survive_the_mxq(tmp_path):
    from mixqrt.errors import FormatError
    from mixqrt.generation.fim import fim_tokens
    from mixqrt.generation.tokenizer import Tokenizer, fim_from_gguf
    meta = {"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.suffix_token_id": 6,
            "tokenizer.ggml.fim_mid_token_id": 7, "tokenizer.ggml.fim_sep_token_id": 8}
    assert fim_from_gguf(meta, 100) == {"pre": 5, "suf": 6, "mid": 7, "sep": 8}
    with pytest.raises(FormatError, match="fim_mid_token_id"):
        fim_from_gguf({**meta, "tokenizer.ggml.fim_mid_token_id": 1000}, 100)
    from serve_helpers import tiny_pipeline
    tok = tiny_pipeline(tmp_path).tokenizer
    t2 = Tokenizer.from_meta({**tok.to_meta(), "tokenizer_info": {**tok.to_meta()["tokenizer_info"],
                                                                  "fim": {"pre": 5, "suf": 6, "mid": 7}}})
    assert Tokenizer.from_meta(t2.to_meta()).fim_ids == {"pre": 5, "suf": 6, "mid": 7}
    ft = fim_tokens(t2)
    assert (ft.pre, ft.suf, ft.mid, ft.rep) == (5, 6, 7, None)


def test_embedding_packs_alternate_with_decode_steps(engine):
    """A large embedding request runs pack by pack on the engine thread between decode steps: a stream
    submitted alongside keeps getting tokens, and the vectors equal the calling-thread ones."""
    from mixqrt.generation.embed import Embedder
    emb = Embedder(engine.model, batch_tokens=64)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(5, 300, size=int(n)) for n in rng.integers(8, 60, size=60)]
    stream = engine.submit(list(range(30, 60)), max_new_tokens=24, temperature=0)
    fut = engine.embed(seqs, emb)
    pieces = [r for r in stream]
    vecs = fut.result(120)
    assert pieces[-1].finish_reason == "length" and len(pieces) == 24
    np.testing.assert_allclose(vecs, emb.embed(seqs), rtol=1e-5, atol=1e-6)
    assert engine.stats()["embed_requests"] >= 1


def test_sentence_transformers_folder_pooling_dense_normalize(tmp_path):
    """An HF folder with sentence-transformers modules (Pooling: mean, Dense 64 -> 32 with bias,
    Normalize): the settings and the dense weights travel into the .mxq, and the vectors are
    mean(final-norm hidden) @ W.T + b, L2-normalized."""
    import json

    from tinymodel import make_tiny_hf_model, write_safetensors

    from mixqrt.pipeline import LoadedModel
    from mixqrt.quantize.convert import quantize_model
    hf = make_tiny_hf_model(tmp_path / "hf")
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (hf / "1_Pooling").mkdir()
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                              "pooling_mode_mean_tokens": True}))
    (hf / "2_Dense").mkdir()
    (hf / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 64, "out_features": 32, "bias": True,
                                                            "activation_function": "torch.nn.modules.linear.Identity"}))
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    write_safetensors(hf / "2_Dense" / "model.safetensors", {"linear.weight": w, "linear.bias": b})
    (hf / "3_Normalize").mkdir()
    out = tmp_path / "st.mxq"
    quantize_model(str(hf), "f32", out, progress=False)
    lm = LoadedModel(out)
    assert lm.meta["embedding"]["pooling"] == "mean" and lm.meta["embedding"]["normalize"] is True
    emb = lm.embedder()
    ids = [np.arange(3, 20), np.arange(40, 47)]
    got = emb.embed(ids)
    h = [lm.model.final_norm(lm.model.forward_hidden(s, lm.model.make_cache(len(s)), 0)).mean(0) for s in ids]
    want = np.stack(h) @ w.T + b
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    (hf / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Pooling", "path": "../x"}]))
    from mixqrt.errors import MixqrtError
    with pytest.raises(MixqrtError, match="plain folder name"):
        quantize_model(str(hf), "f32", tmp_path / "bad.mxq", progress=False)
