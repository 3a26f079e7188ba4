"""Mixture-of-experts FFN (Qwen2-MoE, Qwen3-MoE): a softmax router picks the top-k experts of each
token; each expert is a SiLU-gated FFN; Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

`MoEMixin` goes before the attention graph's Model in a subclass (qwen2_moe.py, qwen3_moe.py): it
replaces the FFN of the sparse layers (spec.MoELayout.sparse) and keeps the dense ones. Prefill
groups a chunk's tokens by expert and runs one product per expert over its tokens; decode reads only
the selected experts. Routing is the same on every ISA tier: the router's scores come from
ops.router_logits (float32 in one summation order, no FMA contraction: bit-identical on every tier,
where the matmul kernels fold in a tier's own order), softmax and top-k in numpy float32; ties between
equal probabilities go to the lower expert index.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixqrt import ops
from mixqrt.platform import tuning
from mixqrt.errors import ModelError
from mixqrt.models import qwen2, spec


@dataclass
class MoEArgs(qwen2.ModelArgs):
    """The MoE keys of Qwen2MoeConfig / Qwen3MoeConfig (checked by spec.moe_layout)."""
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None

    arch = "qwen3_moe"              # a subclass names its architecture (not a dataclass field)

    @classmethod
    def from_dict(cls, config, model_type=None):
        return super().from_dict(config, model_type=cls.arch)

    def validate(self) -> None:
        super().validate()
        spec.moe_layout(vars(self), self.num_hidden_layers)


@dataclass
class Experts:
    router: object                  # [E, D]
    gate: list                      # E x [I, D]
    up: list                        # E x [I, D]
    down: list                      # E x [D, I]
    shared: tuple | None            # (gate [S, D], up [S, D], down [D, S]) or None
    shared_gate: object             # [1, D] (a one-row router)


def route(logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (experts [T, k] int64, weights [T, k] float32): softmax over all
    experts (float32), the k largest probabilities (lower index first on ties, in descending order),
    renormalised to sum 1 when norm_topk_prob."""
    z = np.asarray(logits, dtype=np.float32)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return top.astype(np.int64), w.astype(np.float32)


def _mlp(gate, up, down, h):
    return ops.matmul(down, ops.silu_mul(ops.matmul(gate, h), ops.matmul(up, h)))


# Decode (one token) through the chosen experts with less Python per product: no grouping (np.unique,
# nonzero, gathers), gate and up write the two halves of one buffer and down takes silu(gate) * up
# inside its product (ops.matmul silu=True: the same bits as silu_mul then matmul). Bit-identical to the
# general path (tests/test_moe_file.py). Measured on the Qwen1.5-MoE-A2.7B shape (docs/moe.md): the
# products' kernels take ~85 % of a decode step, so this gains a few percent at most; naming the next
# expert's weight for the gap prefetch (matmul then=) measured 0.81x and is not used.
# MIXQRT_MOE_FAST_DECODE=0 (mixqrt.platform.tuning; or this attribute) runs the general path.
FAST_DECODE = tuning.value("MIXQRT_MOE_FAST_DECODE") == 1


def _mlp_one(gate, up, down, h, buf):
    """One token [D] through a SiLU-gated FFN; buf: float32 [2 * I] scratch."""
    i = gate.shape[0]
    ops.matmul(gate, h, out=buf[:i])
    ops.matmul(up, h, out=buf[i:])
    return ops.matmul(down, buf, silu=True)


def _moe_one(ex: Experts, h: np.ndarray, k: int, norm_topk_prob: bool) -> np.ndarray:
    """moe_ffn for a single token: the experts in ascending index order (the order moe_ffn adds them)."""
    top, w = route(ops.router_logits(ex.router, h), k, norm_topk_prob)
    order = np.argsort(top[0], kind="stable")
    es, ws = top[0][order].tolist(), w[0][order]
    x = h.reshape(-1)
    inter = ex.gate[es[0]].shape[0]
    buf = np.empty(2 * max(inter, ex.shared[0].shape[0] if ex.shared is not None else 0), dtype=np.float32)
    out = np.zeros_like(x)
    for j, e in enumerate(es):
        out += ws[j] * _mlp_one(ex.gate[e], ex.up[e], ex.down[e], x, buf[:2 * inter])
    if ex.shared is not None:
        g = ops.matmul(ex.shared_gate, x)                          # [1]
        si = ex.shared[0].shape[0]
        y = _mlp_one(*ex.shared, x, buf[:2 * si])
        out += (1.0 / (1.0 + np.exp(-g))).astype(np.float32) * y
    return out.reshape(h.shape)


def moe_ffn(ex: Experts, h: np.ndarray, k: int, norm_topk_prob: bool) -> np.ndarray:
    """The MoE FFN of normed hidden states h [T, D] -> [T, D]: each selected expert runs once over
    the tokens routed to it; a token's expert outputs are added in ascending expert order."""
    if h.shape[0] == 1 and FAST_DECODE and ops._ops is not None:
        return _moe_one(ex, h, k, norm_topk_prob)
    top, w = route(ops.router_logits(ex.router, h), k, norm_topk_prob)
    out = np.zeros_like(h)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)
        y = _mlp(ex.gate[e], ex.up[e], ex.down[e], np.ascontiguousarray(h[rows]))
        out[rows] += w[rows, slot][:, None] * y
    if ex.shared is not None:
        g = ops.matmul(ex.shared_gate, h)                          # [T, 1]
        out += (1.0 / (1.0 + np.exp(-g))).astype(np.float32) * _mlp(*ex.shared, h)
    return out


class MoEMixin:
    """FFN of the sparse layers as routed experts (put before the attention graph's Model)."""

    def _moe(self):
        return spec.moe_layout(vars(self.args), self.args.num_hidden_layers)

    def _layer_from(self, i: int, w: dict):
        m = self.__dict__.get("_moe_layout") or self.__dict__.setdefault("_moe_layout", self._moe())
        if not m.sparse[i]:
            return super()._layer_from(i, w)
        p = f"model.layers.{i}."
        try:
            ex = Experts(w.pop(p + "mlp.gate.weight"),
                         [w.pop(f"{p}mlp.experts.{e}.gate_proj.weight") for e in range(m.n_experts)],
                         [w.pop(f"{p}mlp.experts.{e}.up_proj.weight") for e in range(m.n_experts)],
                         [w.pop(f"{p}mlp.experts.{e}.down_proj.weight") for e in range(m.n_experts)],
                         None, None)
            if m.shared_inter:
                ex.shared = tuple(w.pop(f"{p}mlp.shared_expert.{n}_proj.weight") for n in ("gate", "up", "down"))
                ex.shared_gate = w.pop(p + "mlp.shared_expert_gate.weight")
        except KeyError as e:
            raise ModelError(f"missing tensor {e.args[0]!r}") from None
        w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"] = [None], None
        L = super()._layer_from(i, w)
        L.experts = ex
        return L

    def layer_weights(self, i: int) -> dict:
        out = super().layer_weights(i)
        L = self.layers[i]
        ex = getattr(L, "experts", None) if L is not None else None
        if ex is None:
            return out
        p = f"model.layers.{i}."
        out.pop(p + "mlp.gate_up_proj.weight", None)
        out.pop(p + "mlp.down_proj.weight", None)
        out[p + "mlp.gate.weight"] = ex.router
        for e in range(len(ex.gate)):
            out[f"{p}mlp.experts.{e}.gate_proj.weight"] = ex.gate[e]
            out[f"{p}mlp.experts.{e}.up_proj.weight"] = ex.up[e]
            out[f"{p}mlp.experts.{e}.down_proj.weight"] = ex.down[e]
        if ex.shared is not None:
            for n, t in zip(("gate", "up", "down"), ex.shared):
                out[f"{p}mlp.shared_expert.{n}_proj.weight"] = t
            out[p + "mlp.shared_expert_gate.weight"] = ex.shared_gate
        return out

    def ffn_stage(self, li: int, x: np.ndarray) -> None:
        ex = getattr(self.layers[li], "experts", None)
        if ex is None:
            return super().ffn_stage(li, x)
        m = self._moe_layout
        x += moe_ffn(ex, self.ffn_in(li, x), m.top_k, m.norm_topk_prob)

    def ffn_halves(self, li: int) -> tuple:
        if getattr(self.layers[li], "experts", None) is not None:
            raise ModelError(f"layer {li} is a mixture of experts: it has no gate/up halves to split")
        return super().ffn_halves(li)


def gguf_config(norm_topk_prob: bool):
    """An MoE family's GGUF metadata -> config keys (llama.cpp renormalises the top-k weights for
    qwen3moe and not for qwen2moe: norm_topk_prob)."""
    def read(m, cfg: dict) -> None:
        cfg.update(num_experts=m.int("expert_count"), num_experts_per_tok=m.int("expert_used_count"),
                   moe_intermediate_size=m.int("expert_feed_forward_length"),
                   shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", 0),
                   norm_topk_prob=norm_topk_prob)
    return read


# the tiny test models: 4 experts, top 2, expert width 32
TINY = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
