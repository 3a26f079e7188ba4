"""mixqrt.testing.synthetic at test size: the same code path as the 15 GB Qwen2-7B folder and the
7B-shaped .mxq."""
import json

import numpy as np
import pytest

from mixqrt.io import open_source
from mixqrt.io.hf import SafetensorsFile

from mixqrt.testing import synthetic
from mixqrt.testing.tiny import _tokenizer_json


@pytest.fixture(scope="module")
def sc():
    return synthetic


@pytest.fixture(scope="module")
def tiny_tok():
    return _tokenizer_json("qwen2")


DIMS = (64, 3, 4, 2, 160, 512)   # hidden, layers, heads, kv heads, intermediate, vocab (> tokenizer's ~400)


def test_seven_b_config_and_plan(sc):
    cfg = sc.QWEN2_7B_CONFIG
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == \
        (3584, 28, 28, 4, 18944, 152064, 1e6, False)
    specs = sc.tensor_specs(cfg)
    params = sum(int(np.prod(s)) for _, s, _ in specs)
    assert params == 7_615_616_512                       # Qwen2-7B's published parameter count
    shards = sc.plan_shards(specs)
    assert len(shards) == 4 and all(2 * sum(int(np.prod(s)) for _, s, _ in g) <= sc.MAX_SHARD_BYTES for g in shards)


def test_tiny_folder_opens(sc, tiny_tok, tmp_path):
    cfg = sc.scaled_config(*DIMS)
    out = sc.write_checkpoint(tmp_path / "m", cfg, seed=3, tokenizer=tiny_tok, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not list(out.glob(".*tmp"))                    # no temporaries left behind
    assert sc.is_complete(out, cfg, 40_000)

    with open_source(out) as src:
        assert src.arch == "qwen2"
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings"):
            assert src.config[k] == cfg[k]
        want = {n: s for n, s, _ in sc.tensor_specs(cfg)}
        assert set(src.tensor_names()) == set(want) and "lm_head.weight" in want
        for n, s in want.items():
            assert src.tensor_info(n) == (s, "BF16")
        emb = src.get("model.embed_tokens.weight")
        assert emb.shape == (512, 64)
        q = src.get("model.layers.1.self_attn.q_proj.weight")
        assert 0.012 < float(np.median(np.abs(q))) / 0.6745 < 0.03        # ~N(0, 0.02) bulk
        assert float(np.abs(q).max()) > 5 * float(q.std())                 # outliers present
        assert np.abs(src.get("model.layers.0.self_attn.v_proj.bias")).max() < 0.1
        norm = src.get("model.norm.weight")
        assert 0.7 < float(np.median(norm)) < 1.3 and norm.min() >= 0
        # the bytes are exactly the generator's values, so the driver can regenerate any tensor
        i = [n for n, _, _ in sc.tensor_specs(cfg)].index("model.layers.2.mlp.down_proj.weight")
        assert np.array_equal(src.get("model.layers.2.mlp.down_proj.weight"),
                              sc.tensor_values("proj", (64, 160), 3, i))
        tk = src.tokenizer
        assert tk.vocab_size < cfg["vocab_size"] and tk.chat_template and "<|im_start|>" in tk.chat_template
        assert src.generation_config["eos_token_id"]


def test_resume_keeps_complete_shards(sc, tiny_tok, tmp_path):
    cfg = sc.scaled_config(32, 1, 2, 1, 64, 512)
    out = sc.write_checkpoint(tmp_path / "m", cfg, tokenizer=tiny_tok, max_shard_bytes=20_000)
    shards = sorted(out.glob("model-*.safetensors"))
    before = {p: p.stat().st_mtime_ns for p in shards}
    shards[-1].write_bytes(shards[-1].read_bytes()[:-2])          # a torn last shard is rewritten
    (out / "model.safetensors.index.json").unlink()
    assert not sc.is_complete(out, cfg, 20_000)
    msgs = []
    sc.write_checkpoint(out, cfg, tokenizer=tiny_tok, max_shard_bytes=20_000, progress=msgs.append)
    assert sc.is_complete(out, cfg, 20_000)
    assert all(before[p] == p.stat().st_mtime_ns for p in shards[:-1])
    assert sum("already complete" in m for m in msgs) == len(shards) - 1
    sf = SafetensorsFile(shards[-1])                              # the strict reader accepts the rewrite
    sf.close()


def test_cli_dims(sc, tiny_tok, tmp_path, capsys):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tok)
    assert sc.checkpoint_main(["--out", str(tmp_path / "c"), "--dims", "32,1,2,1,64,512", "--tokenizer", str(tok)]) == 0
    assert "wrote" in capsys.readouterr().out
    with open_source(tmp_path / "c") as src:
        assert src.tensor_info("lm_head.weight") == ((512, 32), "BF16")


def test_synthetic_mxq_has_the_recipe_bytes(tmp_path):
    """mixqrt.testing.synthetic.write_mxq: every tensor of the plan in its stored form and size, loadable,
    a finite forward."""
    sm = synthetic
    import mixqrt
    from mixqrt.io.mxq import MxqFile
    from mixqrt.formats import layout
    from mixqrt.quantize.recipes import get_recipe, tensor_plan
    cfg = sm.CONFIGS["tiny"]
    out = tmp_path / "s.mxq"
    r = sm.write_mxq(str(out), "2356t", cfg, progress=False)
    plan = {n: (f, s) for n, _, f, s in tensor_plan(sm.ShapeSource(cfg), get_recipe("2356t"), tie=None)}
    assert r["tensors"] == len(plan)
    with MxqFile(out) as f:
        total = sum(t.nbytes for t in f.info.values())
        fmts = {t.fmt for t in f.info.values()}
    assert total == sum(layout.expected_nbytes(layout.storage_format(f, s), s) for f, s in plan.values())
    assert {"q4x", "q6x"} <= fmts
    m = mixqrt.load(str(out)).model
    assert np.isfinite(m(np.arange(6), m.make_cache(8), 0, last_only=True)).all()
