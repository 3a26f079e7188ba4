"""Formats per tensor under a byte budget, from the measured per-role sensitivity.

The allocator behind recipe "auto" (quantize/auto.py: the user gives the budget) and recipe 2356a
(quantize/recipes.py: the budget is 2356t's own bytes on that model). SENSITIVITY[role][fmt] is the
mean KL(q8 model || model with only that role in fmt) measured by benchmarks/sensitivity.py on
Qwen2.5-Coder-0.5B (docs/quality.md). A tensor's cost is its role's KL scaled by its share of the
role's parameters (costs are assumed additive across tensors, which is what a first-order analysis of
small perturbations gives). Greedy allocation, like a knapsack by marginal utility: every matrix
starts in its cheapest format; then, while bytes remain, take the single upgrade (tensor -> any
larger format) with the largest cost reduction per extra byte that still fits the budget. Norm
vectors and biases stay f32 (0.01 % of the bytes), and so do routers. A tied model keeps one
embedding/output matrix (as 2356t does), costed as both roles' error; the budget counts tensor bytes
(the file adds its header: tokenizer and config, ~2 MB).

Roles without a measurement of their own take their family's (spec.ROLE_FAMILY): the routed experts
(expert_*) and the shared expert (shexp_*) of a MoE layer are each costed like one dense FFN, their
KL spread over their parameters. A token runs k of E routed experts, so the routed experts together
perturb a token like one FFN of k experts' width, while they hold E experts' bytes: per byte they are
the cheapest place to take bits from, and the greedy plan gives them fewer.
"""
from __future__ import annotations

from collections import defaultdict

from mixqrt.errors import QuantError
from mixqrt.formats import layout
from mixqrt.models.spec import EMBED, VECTOR_ROLES, family, group_of, role_of

# ladder of matrix formats, cheapest first (q3u is dominated by q3p at the same size)
LADDER = ("q2c", "q3p", "q4", "q6", "q8")

# KL (nats/token) vs the all-q8 model with only that role quantized (benchmarks/sensitivity.py: 1 chunk of
# 512 tokens of wikitext-2 test from character 100000, i.e. not the headline-PPL text; search
# quantizer, no imatrix). Measured entries are marked m; the others are extrapolated from a measured
# neighbour by KL ~ MSE (ratios of the weight RMSEs in docs/quant-formats.md): q2c = 3.3 x q3p, q6 = 0.06 x q4.
# q8 is the reference, so 0. attn_q/k/v share the "attn_qkv" measurement. See docs/quality.md.
SENSITIVITY: dict[str, dict[str, float]] = {
    "embed":    {"q2c": 0.0243, "q3p": 0.00522, "q4": 0.00197, "q6": 0.00012, "q8": 0.0},    # m: q2c, q3p, q4
    "attn_qkv": {"q2c": 0.430, "q3p": 0.130, "q4": 0.0225, "q6": 0.00135, "q8": 0.0},       # m: q3p, q4
    "attn_o":   {"q2c": 0.099, "q3p": 0.0300, "q4": 0.00622, "q6": 0.00037, "q8": 0.0},     # m: q3p, q4
    "ffn_gate": {"q2c": 0.120, "q3p": 0.0363, "q4": 0.00621, "q6": 0.00037, "q8": 0.0},     # m: q3p, q4
    "ffn_up":   {"q2c": 0.185, "q3p": 0.0562, "q4": 0.00919, "q6": 0.00055, "q8": 0.0},     # m: q3p, q4
    "ffn_down": {"q2c": 0.142, "q3p": 0.0431, "q4": 0.00390, "q6": 0.00023, "q8": 0.0},     # m: q3p, q4
    "lm_head":  {"q2c": 0.256, "q3p": 0.0776, "q4": 0.0155, "q6": 0.00093, "q8": 0.0},      # m: q3p, q4
}
_GROUP = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv"}
# a tied model's one embedding/output matrix (Recipe.tie): costed as the lookup plus the head
TIED = "tied_embed_head"


def _unit_key(name: str) -> str:
    """Tensors the runtime fuses (a models/spec fusion group: q/k/v, gate/up of one layer) get one
    format together, so the group can be stored fused."""
    group = group_of(name)
    return group[0] if group else name


def plan_formats(tensors, budget_bytes: int, sensitivity=None, floor=None) -> dict[str, str]:
    """tensors: [(name, role, shape)]; -> {name: fmt} for every matrix, total bytes <= budget.
    floor: {name: fmt}, the cheapest format a tensor may get (it starts there)."""
    sens = sensitivity or SENSITIVITY
    role_params = defaultdict(int)
    units: dict[str, list] = {}
    fixed_bytes = 0
    for name, role, shape in tensors:
        n = 1
        for s in shape:
            n *= int(s)
        if role in VECTOR_ROLES or role == "router" or len(shape) != 2:
            fixed_bytes += layout.expected_nbytes("f32", shape)
            continue
        g = _GROUP.get(role, role)
        role_params[g] += n
        units.setdefault(_unit_key(name), []).append((name, g, tuple(shape), n))

    def cost(members, fmt):
        c = 0.0
        for _, role, _, n in members:
            table = sens.get(role) or sens.get(family(role))
            if table is None or fmt not in table:
                raise QuantError(f"no sensitivity measured for role {role!r} in {fmt}")
            c += table[fmt] * n / role_params[role]
        return c

    ukeys = list(units)
    costs = {u: [cost(units[u], f) for f in LADDER] for u in ukeys}
    nbytes = {u: [sum(layout.expected_nbytes(f, s) for _, _, s, _ in units[u]) for f in LADDER] for u in ukeys}
    floor = floor or {}
    choice = {u: max([0] + [LADDER.index(floor[n]) for n, *_ in units[u] if n in floor]) for u in ukeys}
    used = fixed_bytes + sum(nbytes[u][choice[u]] for u in ukeys)
    if used > budget_bytes:
        raise QuantError(f"budget {budget_bytes:,d} bytes is below the smallest plan ({used:,d} bytes: every "
                         f"matrix {LADDER[0]} or its floor, vectors f32)")
    while True:
        best = None
        for u in ukeys:
            i = choice[u]
            for j in range(i + 1, len(LADDER)):
                extra = nbytes[u][j] - nbytes[u][i]
                gain = costs[u][i] - costs[u][j]
                if extra <= 0 or gain <= 0 or used + extra > budget_bytes:
                    continue
                ratio = gain / extra
                if best is None or ratio > best[0]:
                    best = (ratio, u, j, extra)
        if best is None:
            break
        _, u, j, extra = best
        choice[u] = j
        used += extra
    return {name: LADDER[choice[u]] for u in ukeys for name, *_ in units[u]}




# the cheapest format of a tied model's one embedding/output matrix in the budgeted recipes (q4a, 2356a):
# 2356t's q4. The table's KLs are RTN, and calibration (GPTQ) lowers the layers' error but not this
# matrix's (it is quantized before the layers, RTN), so below q4 the plan under-prices it: on Gemma 3
# 270M (262k x 640, 63 % of the weights) q4a without the floor chose q3p for it and q8/q6 layers, and
# measured KL 0.151 calibrated against 2356t's 0.104 (docs/quality.md "The default").
TIED_FLOOR = "q4"


def plan_tensors(plan, budget_bytes: int, tied: bool, sensitivity=None, tied_floor=None) -> dict[str, str]:
    """plan: tensor_plan rows [(name, role, fmt, shape)]; -> {name: fmt} for every matrix within
    budget_bytes. tied: the embedding row is the model's one embedding/output matrix (Recipe.tie),
    costed as the lookup plus the head, and no cheaper than tied_floor (a format) if given."""
    sens = dict(sensitivity or SENSITIVITY)
    if tied:                 # one matrix is the lookup and the output head: it pays both roles' error
        sens[TIED] = {f: sens["embed"][f] + sens["lm_head"][f] for f in LADDER}
    roles = [(n, TIED if (tied and n == EMBED) else role_of(n), shape) for n, _, _, shape in plan]
    floor = {EMBED: tied_floor} if (tied and tied_floor) else None
    return plan_formats(roles, int(budget_bytes), sens, floor)
