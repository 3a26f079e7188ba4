"""Recipes: which format each tensor gets, by its role in the network.

A recipe maps roles (embed, attn_q/k/v/o, ffn_gate/up/down, norm, bias, lm_head; for mixtures of
experts expert_gate/up/down (routed experts), shexp_gate/up/down (the shared expert) and router; the
per-head q/k norms qk_norm; models/spec.py says which tensor plays which) to format names. A role a
table does not name takes its family's entry (spec.ROLE_FAMILY: shexp_down -> ffn_down, qk_norm ->
norm), with the family's depth rules and rotation.
Per-tensor overrides work like llama-quantize's --tensor-type: ``PATTERN=FMT``, where PATTERN is a
regular expression searched in the Hugging Face tensor name, or an exact role name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from mixqrt.errors import QuantError
from mixqrt.formats import layout
from mixqrt.models.arch import get as get_arch
from mixqrt.models.spec import LM_HEAD, ROLES, VECTOR_ROLES, ModelSpec, family, role_of  # noqa: F401  (ROLES re-exported)

_ATTN = {"attn_q": None, "attn_k": None, "attn_v": None, "attn_o": None}
# Architectures whose norms multiply by (1 + weight) (Gemma; Arch.float_norms): a range format (q5g)
# spends its 32 levels on the weights' outliers and moves the ~0 entries by a large share of their
# multiplier, so their norms stay float32 where a recipe says q5g. Measured on Gemma 3 270M, 2356t
# without calibration, 128 WikiText-2 tokens: KL against f32 9.0 with q5g norms, 0.28 with f32 norms.
_FFN = {"ffn_gate": None, "ffn_up": None, "ffn_down": None}


def _vector_ok(fmt: str) -> bool:
    """Whether fmt may hold a 1-D norm or bias vector (layout.TRAITS: f32, f16, bf16, q5g, q8)."""
    t = layout.TRAITS.get(fmt)
    return t is not None and t.vector


def _fill(**kw) -> dict:
    # a router is small (experts x hidden) and picks the experts; the per-head q/k norms are
    # head_dim floats scaling every attention score: both stay float32 (not measured otherwise)
    table = {"bias": "f32", "norm": "f32", "router": "f32", "qk_norm": "f32"}
    for role in _ATTN:
        table[role] = kw.get("attn")
    for role in _FFN:
        table[role] = kw.get("ffn")
        # routed experts: the FFN's format unless the recipe gives them their own (EXPERT_2356); the
        # shared expert is not in the table, so it is a dense FFN (family ffn_*: format, depth rules)
        table["expert_" + role[4:]] = kw.get("expert", {}).get(role, kw.get("ffn"))
    table["embed"] = kw["embed"]
    table["lm_head"] = kw["lm_head"]
    if "norm" in kw:
        table["norm"] = kw["norm"]
    return table


# Routed experts in the 2356 family: 2-bit k-means gate/up (q2c, 2.5 bits/weight), 3-bit piecewise down
# (q3p, 3.5). They are ~90 % of a MoE file's bytes (Qwen1.5-MoE-A2.7B: 60 experts x 3 x 1408 x 2048 per
# layer against 34.6 M shared-expert and 16.8 M attention weights), so their bits set the file size: at
# the dense FFN rule (q3p gate/up, q4 down: 4.0 bits/weight) the file is 0.99x llama.cpp's Q3_K_M (Q3_K
# gate/up, the experts' down Q4_K -> Q5_0 at 1408 columns), all q3p 0.88x, at this rule 0.74x (measured
# on 4 layers, docs/moe.md). q2c decodes on a slower kernel than q3x (docs/moe.md). A token runs top-k of
# the experts, so each expert's error reaches ~k/E of the tokens; quality not yet measured on a real
# MoE checkpoint (docs/moe.md). Recipe "auto" places expert bits by the same per-role sensitivity.
EXPERT_2356 = {"ffn_gate": "q2c", "ffn_up": "q2c", "ffn_down": "q3p"}

RECIPES: dict[str, dict[str, str]] = {
    # 2-bit k-means embedding, 3-bit piecewise FFN, 6-bit attention, 5-bit norms with a range per
    # vector (docs/design.md); the output projection keeps its own 6-bit copy even when tied.
    "2356": _fill(embed="q2c", attn="q6", ffn="q3p", norm="q5g", lm_head="q6", expert=EXPERT_2356),
    "f32": _fill(embed="f32", attn="f32", ffn="f32", lm_head="f32"),
    "f16": _fill(embed="f16", attn="f16", ffn="f16", lm_head="f16"),
    "q8": _fill(embed="q8", attn="q8", ffn="q8", lm_head="q8"),       # baseline "INT8 uniform"
    "q4": _fill(embed="q4", attn="q4", ffn="q4", lm_head="q4"),       # baseline "4-bit uniform"
    # ablations of 2356 (docs/results.md)
    "2356-q3u": _fill(embed="q2c", attn="q6", ffn="q3u", norm="q5g", lm_head="q6", expert=EXPERT_2356),
    "2356-q8embed": _fill(embed="q8", attn="q6", ffn="q3p", norm="q5g", lm_head="q6", expert=EXPERT_2356),
    "2356-f32norm": _fill(embed="q2c", attn="q6", ffn="q3p", norm="f32", lm_head="q6", expert=EXPERT_2356),
    # "dynamic range binding": one 5-bit range shared by every norm vector. Measured worse
    # than a range per vector on Qwen2.5 (norm weights span -1.2 .. 17; layer 0's fall into 2 levels),
    # so 2356 binds per vector and this recipe keeps the global variant for comparison (docs/results.md).
    "2356-bound": _fill(embed="q2c", attn="q6", ffn="q3p", norm="q5g", lm_head="q6", expert=EXPERT_2356),
}
# how q5g ranges are bound: "vector" (each norm vector its own lo/hi) or "global" (one over all)
RECIPE_OPTIONS: dict[str, dict] = {"2356-bound": {"q5g_binding": "global"},
                                   # 2356 with the plain min/max quantizer (before the error-minimising
                                   # search with de-shrink, which is the default: docs/quality.md)
                                   "2356-minmax": {"search": False}}
RECIPES["2356-minmax"] = dict(RECIPES["2356"])
# Not 2/3/5/6-bit: the best plan measured within llama.cpp's Q2_K file size for Qwen2.5-Coder-0.5B
# (docs/quality.md): 3-bit embedding table, 4-bit FFN, 6-bit attention, 6-bit output head, f32 norms.
RECIPES["2356+"] = _fill(embed="q3p", attn="q6", ffn="q4", norm="f32", lm_head="q6")
# ... and where the model is tied, one q6 matrix for embedding and head (Recipe.tie) and the q3p table's
# bytes in q6 FFN weights: the same file size on Qwen2.5-Coder-0.5B (0.998x), KL against f32 0.0207 ->
# 0.0034 calibrated (docs/quality.md §0.7). Rotated like 2356 (measured neutral on the untied plan).
RECIPE_OPTIONS["2356+"] = {"tie": True, "tied_table": {"ffn_gate": "q6", "ffn_up": "q6", "ffn_down": "q6"},
                           "rotate": {"embed": 32, "lm_head": 32, "ffn_gate": 64, "ffn_up": 64, "ffn_down": 64}}
# 2356 with its bytes moved where the measured KL per byte is highest (docs/quality.md §0): the output
# head q6 -> q4 (+0.019 KL, -25.5 MB on Qwen2.5-Coder-0.5B) pays for ffn_down q4 in every layer and
# gate/up q4 in layers 1-7 of 24 (each worth -0.002..-0.008 KL per 0.8-1.6 MB); embedding q2c,
# attention q6 and norms q5g as in 2356. File 1.017x 2356's. Meant for calibrated quantization.
RECIPES["2356c"] = _fill(embed="q2c", attn="q6", ffn="q3p", norm="q5g", lm_head="q4", expert=EXPERT_2356)
RECIPES["2356c"]["ffn_down"] = "q4"
RECIPE_OPTIONS["2356c"] = {"layer_rules": [(("ffn_gate", "ffn_up"), "q4", tuple(i / 23 for i in range(1, 8)))]}
# Randomized block Hadamard rotation (formats/rotation.py, docs/quality.md §0.5) of the FFN weights
# (blocks of 64 = one q3p group) and the embedding table (blocks of 32). Chosen on held-out Tiny
# Shakespeare (never the evaluation text): FFN q3p RTN KL 0.158 -> 0.122, q2c embedding 0.048 -> 0.041;
# attention q6 measured worse rotated (0.0011 -> 0.0015) and stays plain, the q6 output head the same
# (0.1053 against 0.1050 calibrated), and 2356+ (q4 FFN, q3p embedding) gained nothing calibrated
# (WikiText KL 0.0209 against 0.0207, code 0.0139 against 0.0125): neutral, so the tied 2356+ above,
# measured rotated, rotates everywhere. The 2356 family rotates; "2356-norot" keeps the unrotated variant as the ablation (and as a file older mixqrt reads).
ROTATE_2356 = {"embed": 32, "ffn_gate": 64, "ffn_up": 64, "ffn_down": 64}
for _name in ("2356", "2356c", "2356-q3u", "2356-q8embed", "2356-f32norm", "2356-bound", "2356-minmax"):
    RECIPE_OPTIONS[_name] = {**RECIPE_OPTIONS.get(_name, {}), "rotate": dict(ROTATE_2356)}
# 2356c's output head is q4, not q6: rotated it measured 0.0764 against 0.0776 (held-out Shakespeare).
RECIPE_OPTIONS["2356c"]["rotate"]["lm_head"] = 64
RECIPES["2356-norot"] = dict(RECIPES["2356"])
# 2356c with the embedding tied to the output head where the model is tied (Recipe.tie): one q4 matrix
# (rotated, blocks of 32) serves the lookup and the output projection, instead of a q2c table next
# to a q4 head. On Qwen2.5-Coder-0.5B that drops the 2-bit table's error and 42.5 MB, and the file
# is smaller than 2356's (docs/quality.md §0.7). A model with two trained matrices gets 2356c's formats
# (its q4 head rotated in blocks of 32, not 64).
RECIPES["2356t"] = dict(RECIPES["2356c"])
RECIPE_OPTIONS["2356t"] = {**RECIPE_OPTIONS["2356c"], "rotate": {**ROTATE_2356, "lm_head": 32}, "tie": True}

# Budgeted recipes (Recipe.budget_of, docs/quality.md §6): the bytes of another recipe's plan on this
# model, placed per tensor by the measured per-role sensitivity (quantize/budget.py, the allocator of
# recipe "auto") instead of by fixed rules; nothing set by hand per model. Tie and rotations as 2356t,
# the tied matrix at least q4 (budget.TIED_FLOOR), norms float32 (the allocator counts vectors as f32).
# A mixture of experts gets 2356t's formats (BUDGET_FALLBACK): there the allocator would move bytes
# into the shared expert, which every token reads (docs/moe.md).
# 2356a: 2356t's bytes. Calibrated on SmolLM2-135M KL 0.129 against 2356t's 0.173 (llama.cpp Q3_K_M
# 0.120): closer, not enough.
RECIPES["2356a"] = _fill(embed="q2c", attn="q6", ffn="q3p", norm="f32", lm_head="q4", expert=EXPERT_2356)
RECIPE_OPTIONS["2356a"] = {"rotate": dict(RECIPE_OPTIONS["2356t"]["rotate"]), "tie": True, "budget_of": "2356t"}
# q4a: the bytes of every matrix at q4 (5.0 bits per weight; a tied model's one matrix counted once).
# More bytes than 2356t where 2356t's q3p FFN stays below 5 bits per weight (1.07x on
# Qwen2.5-Coder-0.5B, 1.13x on Qwen2-7B's shapes). Calibrated KL against f32: SmolLM2-135M 0.092,
# Qwen2.5-Coder-0.5B 0.040 (llama.cpp Q3_K_M: 0.120, 0.070), at 0.97x and 0.76x llama.cpp Q2_K's bytes.
RECIPES["q4a"] = dict(RECIPES["2356a"])
RECIPE_OPTIONS["q4a"] = {**RECIPE_OPTIONS["2356a"], "rotate": dict(RECIPE_OPTIONS["2356a"]["rotate"]), "budget_of": "q4"}


# the recipe used when none is named (CLI, Pipeline, quantize_model): q4a, the bytes of every matrix
# at q4 placed by the sensitivity table on each model (docs/quality.md "The default"). 2356t (2356's
# formats with the tied embedding stored once and the bytes moved where the KL per byte is highest:
# on the tied Qwen2.5-Coder-0.5B 0.87x 2356's file, KL 0.160 -> 0.090 RTN, §0.7), the default until
# 2026-12-05, stays available by name, and so does 2356a (its bytes, placed by the table).
DEFAULT_RECIPE = "q4a"


def parse_overrides(items) -> list[tuple[str, str]]:
    """['ffn_down=q6', 'layers\\.0\\..*=q8'] -> [(pattern, fmt)], validated."""
    from mixqrt.formats.codec import FORMATS

    out = []
    for item in items or ():
        if "=" not in item:
            raise QuantError(f"tensor-type override {item!r} must look like PATTERN=FORMAT")
        pat, fmt = item.rsplit("=", 1)
        pat, fmt = pat.strip(), fmt.strip()
        if fmt not in FORMATS:
            raise QuantError(f"override {item!r}: unknown format {fmt!r}; known: {', '.join(sorted(FORMATS))}")
        try:
            re.compile(pat)
        except re.error as e:
            raise QuantError(f"override {item!r}: bad regular expression: {e}") from None
        out.append((pat, fmt))
    return out


@dataclass
class Recipe:
    name: str
    table: dict[str, str]
    overrides: list[tuple[str, str]] = field(default_factory=list)
    q5g_binding: str = "vector"
    # error-minimising headers (with de-shrink) for q6/q4/q3u/q3p (formats.quantize(search=True)); same
    # byte layouts. 2356 on Qwen2.5-Coder-0.5B: PPL 31.20 (min/max) -> 28.68 (docs/quality.md).
    search: bool = True
    # per-tensor formats by exact HF name (recipe "auto"); checked before the role table
    per_tensor: dict[str, str] = field(default_factory=dict)
    # calibrated quantization (GPTQ, quantize/calibrate.py): method, text label, tokens, ctx, damp
    calibration: dict | None = None
    # depth rules: [(roles, fmt, positions)], positions are fractions of the depth (0 = first layer,
    # 1 = last); layer round(p * (n_layers - 1)) of those roles gets fmt. Relative, so one rule fits
    # models of any depth (how 2356c places its extra bits, docs/quality.md).
    layer_rules: list = field(default_factory=list)
    # randomized block Hadamard rotation (mixqrt.formats.rotation) per role: role -> block size; applied
    # to packed matrices whose input width the block divides. {} = none (files stay .mxq version 2).
    rotate: dict = field(default_factory=dict)
    # tie the embedding to the output projection where the model allows it (tie_source): the .mxq
    # keeps ONE matrix, in the lm_head role's format and rotation (the output projection is the role
    # that needs the bits), read by the embedding lookup too. A model with two trained matrices keeps
    # the table's embed and lm_head. False: a tied model still gets its own lm_head copy (2356's q6
    # head next to the q2c table).
    tie: bool = False
    tie_source: str | None = None      # set by tensor_plan: the source tensor it tied from, if any
    # role -> format where the tie happened (the bytes the embedding table no longer takes go there)
    tied_table: dict = field(default_factory=dict)
    # the name of a recipe whose tensor bytes on the model being planned are this recipe's budget: then
    # tensor_plan sets per_tensor from the sensitivity allocator (quantize/budget.py) for each source
    budget_of: str | None = None

    def _role(self, name: str, role: str | None) -> str:
        role = role or role_of(name)
        return "lm_head" if (role == "embed" and self.tie and self.tie_source) else role

    def rotation_for(self, name: str, fmt: str, shape, role: str | None = None) -> dict | None:
        """The rotation record of one tensor ({"block", "seed"}) or None."""
        from mixqrt.formats.rotation import DEFAULT_SEED, rotatable
        role = self._role(name, role)
        b = self.rotate.get(role, self.rotate.get(family(role)))
        if not b or not rotatable(fmt, shape) or tuple(shape)[1] % b:
            return None
        return {"block": int(b), "seed": DEFAULT_SEED}

    def rule_layers(self, n_layers: int) -> list[tuple[tuple, str, set]]:
        return [(tuple(roles), fmt, {int(round(float(p) * (n_layers - 1))) for p in pos})
                for roles, fmt, pos in self.layer_rules]

    def format_for(self, name: str, role: str | None = None, n_layers: int | None = None,
                   arch: str | None = None) -> str:
        role = self._role(name, role)
        table = {**self.table, **self.tied_table} if (self.tie and self.tie_source) else self.table
        # a role the table does not name is its family (spec.ROLE_FAMILY), depth rules included;
        # tables written before the router / q-k norm roles: router f32, q/k norms as the norms
        fam = family(role)
        as_role = role if (role in table or fam not in table) else fam
        if name in self.per_tensor:
            fmt = self.per_tensor[name]
        elif as_role in table:
            fmt = table[as_role]
        elif role == "router":
            fmt = "f32"
        else:
            raise QuantError(f"{name}: recipe {self.name!r} has no format for role {role!r}")
        if fam == "norm" and fmt == "q5g" and arch is not None and get_arch(arch).float_norms:
            fmt = "f32"                   # before overrides: a user's explicit choice still wins
        if self.layer_rules and n_layers and name.startswith("model.layers."):
            i = int(name.split(".")[2])
            for roles, rfmt, layers in self.rule_layers(n_layers):
                if as_role in roles and i in layers:
                    fmt = rfmt
        for pat, ofmt in self.overrides:  # later overrides win, like llama-quantize
            if pat == role or pat == fam or re.search(pat, name):
                fmt = ofmt
        if role in VECTOR_ROLES and not _vector_ok(fmt):
            raise QuantError(f"{name}: format {fmt} is not allowed for a 1-D {role} vector")
        return fmt

    def spec(self) -> dict:
        d = {"name": self.name, "table": dict(self.table), "overrides": [list(o) for o in self.overrides],
             "q5g_binding": self.q5g_binding}
        if self.search:          # part of the cache key: files quantized before the search stay valid
            d["quantizer"] = "search-deshrink"
        if self.per_tensor:
            d["per_tensor"] = dict(self.per_tensor)
        if self.layer_rules:
            d["layer_rules"] = [[list(r), f, [float(p) for p in pos]] for r, f, pos in self.layer_rules]
        if self.rotate:
            d["rotate"] = dict(self.rotate)
        if self.tie:
            d["tie"] = self.tie_source or True
            if self.tied_table:
                d["tied_table"] = dict(self.tied_table)
        if self.calibration:
            d["calibration"] = dict(self.calibration)
        if self.budget_of:
            d["budget_of"] = self.budget_of
        return d


def get_recipe(name: str, overrides=None) -> Recipe:
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise QuantError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    return Recipe(name, dict(RECIPES[name]), parse_overrides(overrides), **RECIPE_OPTIONS.get(name, {}))


# "Q8_0" -> 8, "F16" -> 16, "BF16" -> 16, "IQ4_XS" -> 4: how precise a source tensor's stored values are
_DTYPE_BITS = re.compile(r"^(?:I?Q|B?F)(\d+)")


def _dtype_bits(dtype: str) -> int:
    m = _DTYPE_BITS.match(str(dtype).upper().replace("FLOAT", "F"))
    return int(m.group(1)) if m else 0


# sampled rows of a source's embedding and lm_head whose relative RMS difference is at most this are
# copies of one matrix (a GGUF that stored a tied embedding twice, each re-quantized: Q5_0 against Q8_0
# differ by 0.044 on Qwen2.5-Coder-0.5B); two trained matrices differ by ~1.4
TIE_MAX_REL_DIFF = 0.5
TIE_SAMPLE_ROWS = 256


def tie_source(source) -> str | None:
    """The source tensor a tying recipe (Recipe.tie) stores as the one embedding/output matrix, or
    None when the model has two different matrices (it is not tied, so tying would change it).

    - No lm_head.weight in the source: the model is tied; the embedding.
    - Both present in a source whose format declares ties (Source.declares_tie: HF folders): untied,
      without reading either.
    - Both present: they are one matrix stored twice when TIE_SAMPLE_ROWS evenly spaced rows agree
      within TIE_MAX_REL_DIFF (relative RMS); then the more precisely stored of the two (source dtype
      bits; the lm_head on a tie), since the output projection is the more sensitive role."""
    from mixqrt.models.spec import EMBED
    names = source.tensor_names()
    if LM_HEAD not in names:
        return EMBED
    shape = tuple(source.tensor_info(EMBED)[0])
    if tuple(source.tensor_info(LM_HEAD)[0]) != shape or getattr(source, "declares_tie", False):
        return None                       # a format whose flag says untied is not second-guessed
    import numpy as np
    idx = np.unique(np.linspace(0, shape[0] - 1, min(TIE_SAMPLE_ROWS, shape[0])).astype(np.int64))
    a, b = source.rows(EMBED, idx), source.rows(LM_HEAD, idx)
    den = float(np.sqrt(np.mean(np.square(b, dtype=np.float64))))
    rel = float(np.sqrt(np.mean(np.square(a - b, dtype=np.float64)))) / den if den > 0 else float("inf")
    if not rel <= TIE_MAX_REL_DIFF:
        return None
    return EMBED if _dtype_bits(source.tensor_info(EMBED)[1]) > _dtype_bits(source.tensor_info(LM_HEAD)[1]) else LM_HEAD


_UNSET = object()


def tensor_plan(source, recipe: Recipe, tie=_UNSET) -> list[tuple[str, str, str, tuple]]:
    """[(name, role, fmt, shape)] for every tensor of the .mxq, in write order (models/spec.py).

    A tied model gets an explicit lm_head.weight: a separate copy of the embedding in the lm_head
    format (2356: q6 while the embedding is q2c), because the output projection needs more bits
    than the table lookup; unless the recipe ties (recipe.tie) and the source's two matrices are one
    (tie_source; pass its answer as `tie` to skip the check, recorded in recipe.tie_source): then the
    one embedding tensor, read from that source tensor in the lm_head's format, serves both roles and
    the .mxq declares tie_word_embeddings."""
    from mixqrt.models.spec import EMBED
    if tie is _UNSET:
        tie = tie_source(source) if recipe.tie else None
    recipe.tie_source = tie
    if recipe.budget_of:
        recipe.per_tensor = _budget_formats(source, recipe.budget_of, tie)
    spec = ModelSpec(source.config, source.arch)
    plan = []
    for name, shape in spec.shapes(with_lm_head=tie is None).items():
        if tie is not None and name == LM_HEAD:
            continue                     # a source that stores the tied matrix twice
        if tie is not None and name == EMBED:
            src = tie
        else:
            src = name if (name != LM_HEAD or name in source.tensor_names()) else EMBED
        got = tuple(source.tensor_info(src)[0])
        if got != shape:
            raise QuantError(f"tensor {src!r} has shape {got}, config says {shape}")
        role = role_of(name)
        plan.append((name, role, recipe.format_for(name, role, spec.n_layers, spec.arch), shape))
    return plan


# the recipe whose formats a budgeted recipe (Recipe.budget_of) takes on a mixture of experts, where the
# allocator would move bytes into the shared expert that every token reads (docs/moe.md), and in the
# (unseen) case of a budget below the allocator's smallest plan
BUDGET_FALLBACK = "2356t"


def _budget_formats(source, budget_of: str, tie) -> dict[str, str]:
    """{name: fmt} of a Recipe.budget_of recipe for this source: the sensitivity allocator's plan within
    the named recipe's tensor bytes (computed with the same tie answer), or BUDGET_FALLBACK's formats."""
    from mixqrt.quantize.budget import TIED_FLOOR, plan_tensors

    def formats_of(name):
        rec = get_recipe(name)
        rec.tie = tie is not None
        return tensor_plan(source, rec, tie=tie)

    plan = formats_of(budget_of)
    if not any(r.startswith("expert_") for _, r, _, _ in plan):
        budget = sum(layout.expected_nbytes(f, s) for _, _, f, s in plan)
        try:
            return plan_tensors(plan, budget, tie is not None, tied_floor=TIED_FLOOR)
        except QuantError:
            pass
    return {n: f for n, _, f, _ in formats_of(BUDGET_FALLBACK)}
