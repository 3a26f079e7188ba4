"""Recipe.tie: one stored matrix for the token embedding and the output projection.

A tying recipe stores the embedding once, in the embed role's format and rotation, and the .mxq
declares tie_word_embeddings, so the model multiplies by that same tensor as its lm_head. It ties only
what is one matrix: a tied model, or a source that carries the matrix twice (a GGUF whose output.weight
re-quantizes the tied embedding); a model with two trained matrices keeps both.
"""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.quantize.convert import quantize_model
from mixqrt.io import open_source
from mixqrt.models import spec
from mixqrt.quantize.recipes import TIE_MAX_REL_DIFF, Recipe, get_recipe, tensor_plan, tie_source
from tinymodel import make_tiny_gguf, make_tiny_hf_model

TEXT = "def quicksort(xs):\n    return sorted(xs)\n" * 40


def tie_recipe(fmt="q4", rotate=32, tie=True, name="tie-test"):
    table = dict(get_recipe("2356").table)
    table.update(embed=fmt, lm_head=fmt)
    return Recipe(name, table, tie=tie, rotate={"embed": rotate, "lm_head": rotate} if rotate else {})


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tied") / "m", arch="qwen2", tied=True, seed=1)


@pytest.fixture(scope="module")
def untied_hf(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("untied") / "m", arch="qwen2", tied=False, seed=2)


def _copy_head(noise):
    def edit(w):
        e = w["model.embed_tokens.weight"]
        rng = np.random.default_rng(3)
        w["lm_head.weight"] = (e + noise * np.abs(e).mean() * rng.standard_normal(e.shape)).astype(np.float32)
    return edit


def test_tie_source_decides_from_the_data(tied_hf, untied_hf, tmp_path):
    with open_source(str(tied_hf), progress=False) as s:
        assert tie_source(s) == spec.EMBED                       # no lm_head: the model is tied
    with open_source(str(untied_hf), progress=False) as s:
        assert tie_source(s) is None                             # two trained matrices
        s.rows = None                    # an HF folder's config decides: no rows are read (7B: 2 x 2 GB)
        assert s.declares_tie and tie_source(s) is None
    # a GGUF that stored the tied embedding twice (re-quantized): tied, from the lm_head copy
    g = make_tiny_gguf(tied_hf, tmp_path / "copy.gguf", qtype="Q8_0", edit=_copy_head(0.05))
    with open_source(str(g), progress=False) as s:
        assert spec.LM_HEAD in s.tensor_names() and s.config["tie_word_embeddings"] is False
        assert tie_source(s) == spec.LM_HEAD
    g = make_tiny_gguf(untied_hf, tmp_path / "two.gguf", qtype="Q8_0")
    with open_source(str(g), progress=False) as s:
        assert tie_source(s) is None
    assert TIE_MAX_REL_DIFF < 1.0


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_source_rows_equal_the_whole_tensor_rows(untied_hf, tmp_path, qtype):
    g = make_tiny_gguf(untied_hf, tmp_path / f"{qtype}.gguf", qtype=qtype)
    for path in (g, untied_hf):
        with open_source(str(path), progress=False) as s:
            for name in (spec.EMBED, spec.LM_HEAD, "model.layers.1.mlp.down_proj.weight"):
                n = s.tensor_info(name)[0][0]
                idx = [0, 5, 5, n - 2, n - 1]
                np.testing.assert_array_equal(s.rows(name, idx), s.get(name)[idx])
                with pytest.raises(IndexError):
                    s.rows(name, [n])


def test_tied_file_holds_one_matrix_and_runs_as_the_untied_copy(tied_hf, tmp_path):
    import mixqrt
    tied = quantize_model(str(tied_hf), tie_recipe(), tmp_path / "t.mxq", progress=False)
    names = {t.name for t in tied.tensors}
    assert spec.LM_HEAD not in names and spec.EMBED in names
    assert tied.recipe["tie"] == spec.EMBED
    # the same matrix stored twice, the lm_head in the embedding's format and rotation
    two = quantize_model(str(tied_hf), tie_recipe(tie=False), tmp_path / "u.mxq", progress=False)
    assert two.total_bytes > tied.total_bytes
    mt, mu = mixqrt.load(str(tmp_path / "t.mxq"), progress=False).model, \
        mixqrt.load(str(tmp_path / "u.mxq"), progress=False).model
    assert mt.lm_head is mt.embed_tokens and mu.lm_head is not mu.embed_tokens
    ids = np.array([1, 17, 200, 3, 99], dtype=np.int64)
    np.testing.assert_array_equal(mt(ids, mt.make_cache(16)), mu(ids, mu.make_cache(16)))
    from mixqrt.commands.bench import decode_bytes_per_token
    assert decode_bytes_per_token(mt, 0) == decode_bytes_per_token(mu, 0)   # the tied head is read whole


def test_tie_reads_the_more_precise_copy_and_declares_the_tie(tied_hf, tmp_path):
    import mixqrt
    g = make_tiny_gguf(tied_hf, tmp_path / "copy.gguf", qtype="Q8_0", edit=_copy_head(0.02))
    rep = quantize_model(str(g), tie_recipe(fmt="q8", rotate=None), tmp_path / "c.mxq", progress=False)
    assert rep.recipe["tie"] == spec.LM_HEAD and spec.LM_HEAD not in {t.name for t in rep.tensors}
    m = mixqrt.load(str(tmp_path / "c.mxq"), progress=False)
    assert m.model.lm_head is m.model.embed_tokens
    with open_source(str(g), progress=False) as s:
        head = s.get(spec.LM_HEAD)
    from mixqrt.formats import dequantize
    got = dequantize(m.model.embed_tokens)
    assert np.abs(got - head).max() <= np.abs(head).max() / 100       # q8 of the lm_head copy
    # calibrated quantization of a tying recipe: no lm_head GPTQ, same plan
    cal = quantize_model(str(g), tie_recipe(), tmp_path / "cal.mxq", progress=False, calibrate=TEXT,
                         calib_tokens=64, calib_ctx=32)
    assert [t.name for t in cal.tensors] == [n for n, *_ in tensor_plan(open_source(str(g), progress=False),
                                                                        tie_recipe())]


def test_untied_model_keeps_both_matrices_under_a_tying_recipe(untied_hf, tmp_path):
    rep = quantize_model(str(untied_hf), tie_recipe(), None, progress=False, dry_run=True)
    fmts = {t.name: t.fmt for t in rep.tensors}
    assert spec.LM_HEAD in fmts and "tie" in rep.recipe and rep.recipe["tie"] is True


def test_recipe_2356t_ties_a_tied_model_and_is_2356c_otherwise(tied_hf, untied_hf):
    c = {t.name: t.fmt for t in quantize_model(str(untied_hf), "2356c", None, progress=False, dry_run=True).tensors}
    t = quantize_model(str(tied_hf), "2356t", None, progress=False, dry_run=True)
    ft = {x.name: x.fmt for x in t.tensors}
    assert t.recipe["tie"] == spec.EMBED and spec.LM_HEAD not in ft and ft[spec.EMBED] == "q4"
    assert {n: f for n, f in ft.items() if n != spec.EMBED} == {n: f for n, f in c.items()
                                                                if n not in (spec.EMBED, spec.LM_HEAD)}
    u = {x.name: x.fmt for x in quantize_model(str(untied_hf), "2356t", None, progress=False, dry_run=True).tensors}
    assert u == c                                     # two matrices: 2356c's formats
    r = get_recipe("2356t")
    r.tie_source = spec.EMBED
    assert r.rotation_for(spec.EMBED, "q4", (448, 64))["block"] == 32


def test_recipe_2356plus_spends_the_tied_tables_bytes_on_the_ffn(tied_hf, untied_hf):
    t = {x.name: x.fmt for x in quantize_model(str(tied_hf), "2356+", None, progress=False, dry_run=True).tensors}
    u = {x.name: x.fmt for x in quantize_model(str(untied_hf), "2356+", None, progress=False, dry_run=True).tensors}
    assert spec.LM_HEAD not in t and t[spec.EMBED] == "q6"
    assert u[spec.LM_HEAD] == "q6" and u[spec.EMBED] == "q3p"
    for n in t:
        if ".mlp." in n:
            assert t[n] == "q6" and u[n] == "q4"
        elif n != spec.EMBED:
            assert t[n] == u[n]
    assert get_recipe("2356+").spec()["tied_table"]["ffn_down"] == "q6"
