"""Recipe "auto": per-tensor formats from the sensitivity table under a byte budget."""
import numpy as np
import pytest

import mixqrt
from mixqrt.cli import main as cli_main
from mixqrt.quantize.convert import quantize_model
from mixqrt.errors import QuantError
from mixqrt.quantize.auto import LADDER, SENSITIVITY, plan_formats

from tinymodel import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)


def _sizes(tiny):
    # the tied model keeps one embedding/output matrix under auto, as under 2356t
    lo = quantize_model(str(tiny), "2356t", dry_run=True, overrides=[".*=q2c", "norm=f32", "bias=f32"])
    hi = quantize_model(str(tiny), "q8", dry_run=True)
    return lo.total_bytes, hi.total_bytes


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.35, 0.6, 0.9, 1.0])
def test_budget_is_respected_and_used(tiny, frac):
    lo, hi = _sizes(tiny)
    budget = int(lo + frac * (hi - lo))
    rep = quantize_model(str(tiny), "auto", dry_run=True, budget_bytes=budget)
    assert rep.total_bytes <= budget
    fmts = {t.fmt for t in rep.tensors if t.role not in ("norm", "bias")}
    assert fmts <= set(LADDER)
    if frac == 1.0:
        assert fmts == {"q8"}
    # greedy leaves less than one smallest upgrade unused, unless everything is already q8
    if frac not in (0.0, 1.0):
        assert rep.total_bytes > lo


def test_more_budget_never_costs_more_kl(tiny):
    lo, hi = _sizes(tiny)
    plan = [(t.name, t.role, t.shape) for t in quantize_model(str(tiny), "2356t", dry_run=True).tensors]

    def cost(fmts):
        from mixqrt.quantize.auto import _GROUP
        tot = {}
        for n, r, s in plan:
            if r in ("norm", "bias"):
                continue
            g = _GROUP.get(r, r)
            tot[g] = tot.get(g, 0) + int(np.prod(s))
        return sum(SENSITIVITY[_GROUP.get(r, r)][fmts[n]] * int(np.prod(s)) / tot[_GROUP.get(r, r)]
                   for n, r, s in plan if n in fmts)

    costs = [cost(plan_formats(plan, int(lo + f * (hi - lo)))) for f in (0.0, 0.2, 0.4, 0.7, 1.0)]
    assert all(a >= b - 1e-12 for a, b in zip(costs, costs[1:]))


def test_too_small_budget_and_missing_budget(tiny):
    lo, _ = _sizes(tiny)
    with pytest.raises(QuantError, match="below the smallest plan"):
        quantize_model(str(tiny), "auto", dry_run=True, budget_bytes=lo - 1)
    with pytest.raises(QuantError, match="budget"):
        quantize_model(str(tiny), "auto", dry_run=True)


def test_auto_writes_a_loadable_model_and_cli(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    lo, hi = _sizes(tiny)
    budget = (lo + hi) // 2
    assert cli_main(["quantize", str(tiny), "--recipe", "auto", "--budget-bytes", str(budget),
                     "-o", str(tmp_path / "a.mxq"), "-q"]) == 0
    m = mixqrt.load(tmp_path / "a.mxq")
    assert sum(t.nbytes for t in m.file.tensors.values()) <= budget
    assert np.isfinite(m.logits(m.tokenizer.encode("def f(x):"))).all()
    assert m.meta["recipe"]["name"] == "auto" and m.meta["recipe"]["per_tensor"]
    with pytest.raises(SystemExit):
        cli_main(["quantize", str(tiny), "--recipe", "auto", "-o", str(tmp_path / "b.mxq")])


def test_tied_model_keeps_one_matrix_costed_as_both_roles(tiny):
    """A tied model: auto stores the embedding once (no lm_head copy), and that matrix, which is also
    the output head, is never left at the lookup's cheap q2c while the budget allows more."""
    lo, hi = _sizes(tiny)
    rep = quantize_model(str(tiny), "auto", dry_run=True, budget_bytes=int(lo + 0.5 * (hi - lo)))
    names = {t.name: t.fmt for t in rep.tensors}
    assert "lm_head.weight" not in names
    assert names["model.embed_tokens.weight"] != "q2c"
