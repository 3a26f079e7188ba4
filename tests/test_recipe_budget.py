"""Budgeted recipes (Recipe.budget_of): q4a (the default) and 2356a spend the bytes of another recipe's plan
on each model (every matrix q4; 2356t's), placed per tensor by the sensitivity allocator
(quantize/budget.py). Plans of tiny synthetic models: within the budget, deterministic, ties kept,
2356t's rotations, and 2356t's own formats on a mixture of experts."""
import numpy as np
import pytest

import mixqrt
from mixqrt.io.hf import HFSource
from mixqrt.models.spec import EMBED, LM_HEAD
from mixqrt.quantize.budget import LADDER
from mixqrt.quantize.convert import quantize_model
from mixqrt.quantize.recipes import DEFAULT_RECIPE, RECIPE_OPTIONS, get_recipe, tensor_plan
from tinymodel import make_tiny_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    return {"tied": make_tiny_hf_model(base / "tied", arch="qwen2", tied=True, seed=0),
            "untied": make_tiny_hf_model(base / "untied", arch="llama", tied=False, seed=1)}


def _rep(path, recipe, **kw):
    return quantize_model(str(path), recipe, dry_run=True, progress=False, **kw)


def test_default_and_2356t_stays():
    assert DEFAULT_RECIPE == "q4a"
    assert get_recipe("2356t").budget_of is None and get_recipe("2356a").budget_of == "2356t"
    assert get_recipe("q4a").spec()["budget_of"] == "q4"


def _budget(path, name):
    """The budget recipe's bytes with the budgeted recipe's tie (one matrix for a tied model)."""
    rec = get_recipe(name)
    rec.tie = True
    return quantize_model(str(path), rec, dry_run=True, progress=False).total_bytes


@pytest.mark.parametrize("kind", ["tied", "untied"])
@pytest.mark.parametrize("recipe,of", [("2356a", "2356t"), ("q4a", "q4")])
def test_plan_fits_its_budget_and_is_deterministic(models, kind, recipe, of):
    t = _budget(models[kind], of)
    a = _rep(models[kind], recipe)
    assert a.total_bytes <= t
    # the allocator spends the budget: what is left is less than one matrix's cheapest upgrade
    assert a.total_bytes > 0.9 * t
    fm = {x.name: x.fmt for x in a.tensors}
    assert {x.fmt for x in a.tensors if x.role not in ("norm", "bias")} <= set(LADDER)
    assert {x.fmt for x in a.tensors if x.role in ("norm", "bias")} == {"f32"}
    assert fm == {x.name: x.fmt for x in _rep(models[kind], recipe).tensors}
    if recipe == DEFAULT_RECIPE:
        assert quantize_model(str(models[kind]), dry_run=True, progress=False).tensors == a.tensors


@pytest.mark.parametrize("recipe", ["2356a", "q4a"])
def test_ties_stay_tied_and_rotations_are_2356ts(models, recipe):
    tied = {x.name for x in _rep(models["tied"], recipe).tensors}
    assert EMBED in tied and LM_HEAD not in tied               # one matrix for lookup and head
    assert LM_HEAD in {x.name for x in _rep(models["untied"], recipe).tensors}
    assert RECIPE_OPTIONS[recipe]["rotate"] == RECIPE_OPTIONS["2356t"]["rotate"]
    with HFSource(models["tied"]) as src:
        rec = get_recipe(recipe)
        plan = tensor_plan(src, rec)
        assert rec.tie_source is not None and rec.per_tensor
        rec_t = get_recipe("2356t")
        plan_t = tensor_plan(src, rec_t)
        for (n, r, f, s), (_, rt, ft, _) in zip(plan, plan_t):
            if f == ft:     # same format, same rotation as 2356t
                assert rec.rotation_for(n, f, s, r) == rec_t.rotation_for(n, ft, s, rt)


def test_overrides_still_win(models):
    a = _rep(models["tied"], DEFAULT_RECIPE, overrides=["ffn_down=q8"])
    assert {x.fmt for x in a.tensors if x.role == "ffn_down"} == {"q8"}


def test_moe_keeps_2356t_formats(tmp_path):
    d = make_tiny_hf_model(tmp_path, arch="qwen2_moe", dtype="f32")
    t = {x.name: x.fmt for x in _rep(d, "2356t").tensors}
    for recipe in ("2356a", "q4a"):
        assert {x.name: x.fmt for x in _rep(d, recipe).tensors} == t


def test_default_writes_a_loadable_model(models, tmp_path):
    out = tmp_path / "a.mxq"
    quantize_model(str(models["tied"]), DEFAULT_RECIPE, out, progress=False)
    m = mixqrt.load(out)
    assert m.meta["recipe"]["name"] == DEFAULT_RECIPE and m.meta["recipe"]["per_tensor"]
    assert np.isfinite(m.logits(m.tokenizer.encode("def f(x):"))).all()


@pytest.mark.parametrize("recipe", ["2356a", "q4a"])
def test_tied_matrix_keeps_at_least_q4(models, recipe):
    """The one embedding/output matrix is quantized RTN before calibration starts, so the budgeted
    recipes never put it below 2356t's q4 (budget.TIED_FLOOR)."""
    fm = {x.name: x.fmt for x in _rep(models["tied"], recipe).tensors}
    assert LADDER.index(fm[EMBED]) >= LADDER.index("q4")


def test_plan_formats_floor():
    from mixqrt.quantize.budget import plan_formats
    from mixqrt.formats import layout
    tensors = [("model.embed_tokens.weight", "embed", (64, 64)), ("model.layers.0.mlp.down_proj.weight", "ffn_down", (64, 64))]
    lo = sum(layout.expected_nbytes("q2c", s) for *_, s in tensors)
    plain = plan_formats(tensors, lo)
    assert set(plain.values()) == {"q2c"}
    budget = layout.expected_nbytes("q4", (64, 64)) + layout.expected_nbytes("q2c", (64, 64))
    floored = plan_formats(tensors, budget, floor={"model.embed_tokens.weight": "q4"})
    assert floored == {"model.embed_tokens.weight": "q4", "model.layers.0.mlp.down_proj.weight": "q2c"}
    with pytest.raises(mixqrt.QuantError, match="below the smallest plan"):
        plan_formats(tensors, budget - 1, floor={"model.embed_tokens.weight": "q4"})
