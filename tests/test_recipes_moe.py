"""Recipe roles of mixture-of-experts, Qwen3 and Gemma tensors: routed experts, the shared expert, the
router and the per-head q/k norms; their formats in 2356t and auto, the family fallback, and the
bytes-per-role table of `mixqrt quantize --dry-run`."""
import json

import numpy as np
import pytest

from mixqrt.io.hf import HFSource
from mixqrt.models.spec import ModelSpec, family, role_of
from mixqrt.quantize.recipes import Recipe, get_recipe, parse_overrides, tensor_plan
from tinymodel import make_tiny_hf_model

P = "model.layers.0."


@pytest.mark.parametrize("name,role", [
    (P + "mlp.experts.7.gate_proj.weight", "expert_gate"),
    (P + "mlp.experts.0.up_proj.weight", "expert_up"),
    (P + "mlp.experts.59.down_proj.weight", "expert_down"),
    (P + "mlp.shared_expert.gate_proj.weight", "shexp_gate"),
    (P + "mlp.shared_expert.up_proj.weight", "shexp_up"),
    (P + "mlp.shared_expert.down_proj.weight", "shexp_down"),
    (P + "mlp.gate.weight", "router"),
    (P + "mlp.shared_expert_gate.weight", "router"),
    (P + "self_attn.q_norm.weight", "qk_norm"),
    (P + "self_attn.k_norm.weight", "qk_norm"),
    (P + "mlp.gate_proj.weight", "ffn_gate"),
    (P + "pre_feedforward_layernorm.weight", "norm"),
])
def test_roles(name, role):
    assert role_of(name) == role


def _plan(tmp_path, arch, recipe="2356t", overrides=None):
    d = make_tiny_hf_model(tmp_path, arch=arch, dtype="f32")
    with HFSource(d) as src:
        return {n: (r, f) for n, r, f, _ in tensor_plan(src, get_recipe(recipe, overrides))}


def _fmts(plan, role):
    return {f for r, f in plan.values() if r == role}


def test_2356t_moe_roles(tmp_path):
    """Routed experts get the expert rule (q2c gate/up, q3p down), the shared expert the dense FFN's
    (q3p gate/up, q4 down, and 2356c's q4 gate/up depth rule), routers f32."""
    plan = _plan(tmp_path, "qwen2_moe")
    assert _fmts(plan, "expert_gate") == _fmts(plan, "expert_up") == {"q2c"}
    assert _fmts(plan, "expert_down") == {"q3p"}
    assert _fmts(plan, "shexp_down") == {"q4"}
    assert _fmts(plan, "router") == {"f32"}
    assert len([1 for r, _ in plan.values() if r == "router"]) == 4        # 2 layers x (router, shared gate)
    # the depth rule of 2356c / 2356t (ffn gate/up q4 in layers round(p * (n - 1)), p in 1/23 .. 7/23) reaches
    # the shared expert (its family) and not the routed experts (a role of their own in the table)
    rec = get_recipe("2356t")
    rule_layers = rec.rule_layers(2)[0][2]
    for i in range(2):
        want = "q4" if i in rule_layers else "q3p"
        assert plan[f"model.layers.{i}.mlp.shared_expert.gate_proj.weight"][1] == want
        assert plan[f"model.layers.{i}.mlp.experts.0.gate_proj.weight"][1] == "q2c"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3"])
def test_qk_norms_stay_float(tmp_path, arch):
    plan = _plan(tmp_path, arch)
    assert _fmts(plan, "qk_norm") == {"f32"}
    if arch != "gemma3":
        assert _fmts(plan, "norm") == {"q5g"}


def test_overrides_by_family_and_by_role(tmp_path):
    plan = _plan(tmp_path, "qwen2_moe", overrides=["ffn_down=q8"])      # a family: every down projection
    assert _fmts(plan, "expert_down") == _fmts(plan, "shexp_down") == {"q8"}
    plan = _plan(tmp_path / "b", "qwen2_moe", overrides=["expert_down=q6"])  # one role
    assert _fmts(plan, "expert_down") == {"q6"} and _fmts(plan, "shexp_down") == {"q4"}


def test_table_without_the_new_roles_falls_back_to_the_family():
    """A recipe table written before the roles existed (a stored spec, a user's Recipe): experts and the
    shared expert as its FFN, q/k norms as its norms, routers f32."""
    table = {"embed": "q2c", "attn_q": "q6", "attn_k": "q6", "attn_v": "q6", "attn_o": "q6", "ffn_gate": "q3p",
             "ffn_up": "q3p", "ffn_down": "q4", "norm": "q5g", "bias": "f32", "lm_head": "q6"}
    r = Recipe("old", table)
    assert r.format_for(P + "mlp.experts.3.down_proj.weight") == "q4"
    assert r.format_for(P + "mlp.shared_expert.up_proj.weight") == "q3p"
    assert r.format_for(P + "self_attn.q_norm.weight") == "q5g"
    assert r.format_for(P + "mlp.gate.weight") == "f32"
    assert family("shexp_up") == "ffn_up" and family("attn_q") == "attn_q"


def test_every_recipe_names_every_role():
    from mixqrt.models.spec import ROLES
    from mixqrt.quantize.recipes import RECIPES
    for name in RECIPES:
        r = get_recipe(name)
        for role in ROLES:
            if role in ("embed", "lm_head") or role.startswith("shexp"):
                continue
            assert role in r.table, (name, role)


class ShapeSource:
    """A source that has only shapes (enough for a dry run): a config of any size without its weights."""

    declares_tie = True

    def __init__(self, config, arch):
        self.config, self.arch = config, arch
        self._shapes = ModelSpec(config, arch).shapes()

    def tensor_names(self):
        return list(self._shapes)

    def tensor_info(self, name):
        return self._shapes[name], "F16"


A27B = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=24,
            intermediate_size=5632, vocab_size=151936, num_experts=60, num_experts_per_tok=4,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632, tie_word_embeddings=False)

# llama.cpp's Q3_K_M types for a qwen2moe file of this shape (llama_tensor_get_type): Q3_K (3.4375 bits per
# weight) by default, Q4_K (4.5) for attn_v / attn_output / ffn_down*, but the routed experts' ffn_down_exps
# has 1408 columns, not a multiple of 256, so its Q4_K falls back to Q5_0 (5.5; llama-quantize's log says
# so); output Q6_K (6.5625); the router stays F16, 1-D tensors F32.
_Q3KM = {"expert_down": 5.5, "shexp_down": 4.5, "attn_v": 4.5, "attn_o": 4.5, "lm_head": 6.5625, "router": 16.0,
         "norm": 32.0, "bias": 32.0}


def test_a27b_shape_fits_the_size_goal():
    """Qwen1.5-MoE-A2.7B's shapes in 2356t: routed experts at 2.83 bits/weight, the file at most 0.8x what
    llama.cpp's Q3_K_M types take (docs/moe.md measures the real file)."""
    from mixqrt.quantize.convert import quantize_model
    rep = quantize_model(ShapeSource(A27B, "qwen2_moe"), "2356t", dry_run=True, progress=False)
    by = rep.by_role()
    routed = [by[r] for r in ("expert_gate", "expert_up", "expert_down")]
    bpw = 8 * sum(r["bytes"] for r in routed) / sum(r["params"] for r in routed)
    assert bpw == pytest.approx(17 / 6)
    assert sum(r["bytes"] for r in routed) > 0.8 * rep.total_bytes          # the experts set the size
    q3km = sum(np.prod(t.shape) * _Q3KM.get(t.role, 3.4375) / 8 for t in rep.tensors)
    assert rep.total_bytes <= 0.8 * q3km
    assert by["expert_gate"]["tensors"] == 24 * 60 and by["router"]["formats"] == ["f32"]


def test_auto_plans_a_moe_model(tmp_path):
    """Recipe auto on a MoE model: routers and norms stay f32; routed experts (costed as one FFN spread over
    every expert's bytes) never get more bits than the shared expert's same projection."""
    from mixqrt.quantize.auto import LADDER, auto_recipe
    from mixqrt.quantize.convert import quantize_model
    d = make_tiny_hf_model(tmp_path, arch="qwen2_moe", dtype="f32")
    with HFSource(d) as src:
        budget = int(0.7 * quantize_model(src, "q8", dry_run=True, progress=False).total_bytes)
        rec = auto_recipe(src, budget)
        plan = tensor_plan(src, rec)
    fm = {n: f for n, _, f, _ in plan}
    assert {f for n, r, f, _ in plan if r == "router"} == {"f32"}
    for i in range(2):
        for part in ("gate", "up", "down"):
            sh = LADDER.index(fm[f"model.layers.{i}.mlp.shared_expert.{part}_proj.weight"])
            for e in range(4):
                assert LADDER.index(fm[f"model.layers.{i}.mlp.experts.{e}.{part}_proj.weight"]) <= sh


def test_dry_run_table_has_bytes_per_role(tmp_path, capsys):
    from mixqrt.cli import main
    d = make_tiny_hf_model(tmp_path, arch="qwen2_moe", dtype="f32")
    assert main(["quantize", str(d), "--dry-run"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0].split()
    assert head[:2] == ["role", "tensors"] and "params" in head and "bpw" in head and "bytes" in head
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    for role in ("expert_gate", "expert_up", "expert_down", "shexp_gate", "shexp_up", "shexp_down", "router"):
        assert role in rows, out
    assert rows["expert_gate"][1] == str(2 * 4) and rows["expert_gate"][2] == "q2c"
    assert main(["quantize", str(d), "--dry-run", "--json"]) == 0
    by = json.loads(capsys.readouterr().out)["by_role"]
    assert by["expert_down"]["tensors"] == 8 and by["router"]["bpw"] == 32.0
