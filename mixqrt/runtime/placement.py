"""Where each tensor's bytes should live: NUMA-local and tiered (CXL / far-node) placement plans.

``plan_placement`` is pure (topology in, plan out) so it is tested on fake 2-node and 1-node+CXL
trees; ``apply_placement`` carries a plan out with mbind (and optionally first-touch) and is a
no-op on one node. ``format_placement`` is what ``mixqrt inspect --placement`` prints.

Tiers, relative to the *home* node(s) — the nodes of the CPUs the workers run on:
  local   DRAM of a home node
  remote  DRAM of another CPU node (NUMA far)
  cxl     a CPU-less memory node (CXL expander, far/slow memory)

Policies:
  local   every tensor on a home node. With workers on several nodes, layers are split into
          contiguous blocks, one per node, sized by that node's worker count, so each layer's span
          sits with the threads that run it; global tensors go to the first home node.
  tiered  CXL / far-node loading (docs/runtime.md): the token embedding (one row gathered per token, so neither
          bandwidth- nor latency-critical) goes to the far tier; attention, FFN, norms and lm_head
          stay on local DRAM. The far tier is the nearest CPU-less node with room, else the nearest
          remote CPU node, else local (one-node machine: the plan degrades to "local").
  A dict {role or role-class: "local"|"far"} refines "tiered", e.g. {"embed": "far", "ffn": "far"}.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mixqrt.errors import MixqrtError
from mixqrt.platform import affinity
from mixqrt.platform.topology import Topology, allowed_cpus

TIERED_DEFAULT = {"embed": "far"}  # everything else: local
_ROLE_ORDER = ("embed", "attn_q", "attn_k", "attn_v", "attn_o", "ffn_gate", "ffn_up", "ffn_down",
               "router", "expert_gate", "expert_up", "expert_down", "shexp_gate", "shexp_up", "shexp_down",
               "norm", "qk_norm", "bias", "lm_head")  # network order, for printing


@dataclass(frozen=True)
class Placement:
    name: str
    role: str
    node: int
    tier: str      # "local" | "remote" | "cxl"
    nbytes: int


@dataclass(frozen=True)
class ApplyResult:
    name: str
    node: int
    addr: int       # page-aligned start actually bound (0 if skipped)
    nbytes: int     # page-aligned length actually bound
    status: str     # "ok" | "noop" | "skipped" | "error"
    errno: int = 0
    detail: str = ""


def role_class(role: str) -> str:
    """Coarse class of a recipe role: embed | attn | ffn | norm | lm_head | other."""
    r = role.lower()
    if r.startswith("embed") or r in ("tok_embd", "token_embd"):
        return "embed"
    if r.startswith("attn") or r.startswith("self_attn"):
        return "attn"
    if r.startswith(("ffn", "mlp", "expert", "shexp")):
        return "ffn"
    if r in ("norm", "bias") or r.endswith("norm"):
        return "norm"
    if r in ("lm_head", "output"):
        return "lm_head"
    return "other"


def home_nodes(topo: Topology, cpus=None) -> list[int]:
    """Nodes of the worker CPUs (default: this process's affinity); node 0 style fallback if none."""
    cpus = allowed_cpus() if cpus is None else tuple(cpus)
    ids = topo.nodes_of_cpus(cpus)
    if not ids:  # fake tree or CPUs outside the tree: use the CPU nodes it describes
        ids = [n.id for n in topo.cpu_nodes] or [topo.nodes[0].id]
        ids = ids[:1]
    return ids


def _tier_of(topo: Topology, node: int, homes: list[int]) -> str:
    if node in homes:
        return "local"
    return "remote" if topo.node(node).has_cpu else "cxl"


def _far_candidates(topo: Topology, home: int) -> list[int]:
    """Memory-only nodes by distance from home, then remote CPU nodes by distance."""
    src = topo.node(home)
    cxl = sorted((n for n in topo.memory_only_nodes), key=lambda n: (src.distance_to(n.id), n.id))
    remote = sorted((n for n in topo.cpu_nodes if n.id != home and n.mem_bytes > 0),
                    key=lambda n: (src.distance_to(n.id), n.id))
    return [n.id for n in cxl] + [n.id for n in remote]


def _layer_nodes(layers: list[int], homes: list[int], topo: Topology, cpus) -> dict[int, int]:
    """Contiguous layer blocks per home node, proportional to the node's worker CPUs."""
    if len(homes) == 1 or not layers:
        return {lay: homes[0] for lay in layers}
    cpus = set(allowed_cpus() if cpus is None else cpus)
    weights = [max(1, len([c for c in topo.node(h).cpus if c in cpus])) for h in homes]
    total = sum(weights)
    out, acc = {}, 0.0
    n = len(layers)
    bounds = []
    for w in weights:
        acc += w / total * n
        bounds.append(round(acc))
    for i, lay in enumerate(layers):
        k = next(j for j, b in enumerate(bounds) if i < b) if i < bounds[-1] else len(homes) - 1
        out[lay] = homes[k]
    return out


def plan_placement(tensors, topology: Topology, policy="local", cpus=None) -> list[Placement]:
    """Plan the node of every tensor. ``tensors``: iterable of (name, role, nbytes, layer).

    ``layer`` is the block index, or None / -1 for tensors outside the layer stack (embedding,
    final norm, lm_head). ``cpus`` are the worker CPUs (default: this process's affinity).
    Returns one Placement per tensor, in input order.
    """
    items = []
    for t in tensors:
        try:
            name, role, nbytes, layer = t
        except (TypeError, ValueError):
            raise MixqrtError(f"plan_placement: expected (name, role, nbytes, layer), got {t!r}") from None
        if not isinstance(nbytes, int) or nbytes < 0:
            raise MixqrtError(f"plan_placement: {name}: nbytes must be a non-negative int, got {nbytes!r}")
        items.append((str(name), str(role), int(nbytes), None if layer is None or layer < 0 else int(layer)))

    if isinstance(policy, str):
        if policy == "local":
            wants = {}
        elif policy == "tiered":
            wants = dict(TIERED_DEFAULT)
        else:
            raise MixqrtError(f"unknown placement policy {policy!r} (local, tiered, or a dict)")
    elif isinstance(policy, dict):
        wants = {}
        for k, v in policy.items():
            if v not in ("local", "far"):
                raise MixqrtError(f"placement policy: {k!r} -> {v!r}; tiers are 'local' and 'far'")
            wants[str(k)] = v
    else:
        raise MixqrtError("placement policy must be 'local', 'tiered' or a dict, "
                          f"got {type(policy).__name__}")

    cpus = tuple(cpus) if cpus is not None else None  # read twice below: no one-shot iterators
    homes = home_nodes(topology, cpus)
    layer_node = _layer_nodes(sorted({lay for *_, lay in items if lay is not None}), homes, topology, cpus)

    # far-tier capacity: fill candidates in distance order, spill to the next, then back to local
    far_nodes = _far_candidates(topology, homes[0])
    room = {n: topology.node(n).mem_bytes for n in far_nodes}

    plan = []
    for name, role, nbytes, layer in items:
        local = layer_node[layer] if layer is not None else homes[0]
        want = wants.get(role, wants.get(role_class(role), "local"))
        node = local
        if want == "far":
            for cand in far_nodes:
                if room[cand] >= nbytes:
                    room[cand] -= nbytes
                    node = cand
                    break
        plan.append(Placement(name, role, node, _tier_of(topology, node, homes), nbytes))
    return plan


def format_placement(plan, topology: Topology | None = None) -> str:
    """Table of the plan grouped by role: role, tensors, node, tier, bytes; then totals per node."""
    if not plan:
        return "placement: (no tensors)"
    groups: dict[tuple, list] = {}
    for p in plan:
        g = groups.setdefault((p.role, p.node, p.tier), [0, 0])
        g[0] += 1
        g[1] += p.nbytes
    lines = [f"{'role':<10} {'tensors':>7} {'node':>4} {'tier':<6} {'bytes':>14} {'MiB':>9}"]
    order = {r: i for i, r in enumerate(_ROLE_ORDER)}
    for (role, node, tier), (count, nbytes) in sorted(
            groups.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], len(order)), kv[0][0])):
        lines.append(f"{role:<10} {count:>7} {node:>4} {tier:<6} {nbytes:>14,} {nbytes / 2**20:>9.1f}")
    per_node: dict[int, int] = {}
    for p in plan:
        per_node[p.node] = per_node.get(p.node, 0) + p.nbytes
    lines.append("")
    for node, nbytes in sorted(per_node.items()):
        extra = ""
        if topology is not None:
            cap = topology.node(node).mem_bytes
            if cap:
                extra = f" of {cap / 2**30:.1f} GiB"
        lines.append(f"node {node}: {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB){extra}")
    if topology is not None and not topology.is_numa:
        lines.append("one NUMA node: placement is a no-op (nothing to bind)")
    return "\n".join(lines)


def apply_placement(mmap_or_address, spans, plan, topology: Topology | None = None, *,
                    touch: bool = False, flags: int = affinity.MPOL_MF_MOVE) -> list[ApplyResult]:
    """Bind each planned tensor's span to its node with mbind; a no-op on one node.

    ``mmap_or_address``: an mmap / numpy array / buffer, or ``(address, length)``. ``spans``: a dict
    name -> (offset, nbytes), or a list of (offset, nbytes) in plan order. Offsets are relative to
    the buffer start. Each span is shrunk to the pages wholly inside it (a page shared with a
    neighbour is never bound). ``touch=True`` also faults the span in from a helper thread whose
    memory policy prefers the node (first-touch; what makes page-cache pages of a shared file
    mapping land there). Kernel refusals are reported in the results, never raised.
    """
    plan = list(plan)
    if isinstance(spans, dict):
        try:
            span_list = [spans[p.name] for p in plan]
        except KeyError as e:
            raise MixqrtError(f"apply_placement: no span for tensor {e.args[0]!r}") from None
    else:
        span_list = list(spans)
        if len(span_list) != len(plan):
            raise MixqrtError(f"apply_placement: {len(span_list)} spans for {len(plan)} planned tensors")

    n_nodes = len(topology.nodes) if topology is not None else len({p.node for p in plan})
    if n_nodes <= 1 and (topology is None or not topology.is_numa):
        return [ApplyResult(p.name, p.node, 0, 0, "noop", 0, "one NUMA node") for p in plan]

    base, size = affinity.buffer_address(mmap_or_address)
    results = []
    for p, (off, nbytes) in zip(plan, span_list):
        if off < 0 or nbytes < 0 or off + nbytes > size:
            raise MixqrtError(f"apply_placement: {p.name}: span [{off}, {off + nbytes}) outside the "
                              f"{size}-byte buffer")
        addr, length = affinity.page_align_inward(base + off, nbytes)
        if length == 0:
            results.append(ApplyResult(p.name, p.node, 0, 0, "skipped", 0, "span smaller than a whole page"))
            continue
        err = affinity.mbind(addr, length, [p.node], affinity.MPOL_BIND, flags)
        detail = os.strerror(err) if err else ""
        if not err and touch:
            cpus = topology.node(p.node).cpus if topology is not None else ()
            err = affinity.first_touch_on_node(addr, length, p.node, cpus)
            detail = f"first-touch: {os.strerror(err)}" if err else ""
        results.append(ApplyResult(p.name, p.node, addr, length, "error" if err else "ok", err, detail))
    return results
