"""The model contract, one definition per architecture: tensor names, shapes, roles and fusion groups.

Every layer that needs to know what a checkpoint holds reads it here:

    io/source.check_layout      which tensors a source must hold, with which shapes (at open time)
    quantize/recipes.role_of    the role a tensor plays, which is what a recipe assigns formats to
    quantize/auto               tensors fused at run time get one format together (a fusion group)
    quantize/convert            write order, and which groups are written as one fused tensor
    models/qwen2.sanitize       shapes checked at load, groups fused at load
    models/qwen2.ffn_halves     row views of a fused tensor (row_slice, the inverse of fuse)
    quantize/calibrate, imatrix    which HF tensors a runtime tensor holds (parts_of), norm folding (norm_feeds)

Names and layouts are Hugging Face's ([out, in] matrices). What differs between architectures is
read from their Arch (mixqrt.models.arch, declared in each models/<name>.py): which attention
biases exist (Qwen2: q/k/v always; Llama: q/k/v/o when config.attention_bias), a per-head RMSNorm
on q and k (Qwen3, Gemma 3), norms around the FFN (Gemma 3), routed experts (the MoE families). A fusion group is a set of tensors of one layer that the graph multiplies
with the same input, stacked by rows into one tensor (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

fuse() is the one rule for stacking, used when a .mxq is written (convert) and when a model is
built from separate parts (sanitize). When it returns None the parts stay separate: the file holds
them under their own names and the graph runs one matmul per part, with the same result.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from mixqrt.errors import ModelError
from mixqrt.models.arch import get as get_arch
from mixqrt.models.base import is_qtensor

# the architectures: mixqrt.models.arch (each declared in its own models/<name>.py)

ROLES = ("embed", "attn_q", "attn_k", "attn_v", "attn_o", "ffn_gate", "ffn_up", "ffn_down",
         "norm", "bias", "lm_head", "router", "expert_gate", "expert_up", "expert_down",
         "shexp_gate", "shexp_up", "shexp_down", "qk_norm")
# A role's family: the role whose recipe entry, rotation, depth rules and sensitivity it takes where a
# recipe does not name it itself (a recipe table written before the role existed, a --tensor-type
# override by family name like ffn_down=q6, which then covers every down projection). Routed experts
# (expert_*: one FFN per expert, top-k of them run per token), the shared expert (shexp_*: a dense FFN
# every token runs) and the per-head q/k norms (qk_norm: Qwen3, Gemma 3) are their own roles so a
# recipe can give them their own formats and `quantize --dry-run` reports their bytes apart.
ROLE_FAMILY = {"expert_gate": "ffn_gate", "expert_up": "ffn_up", "expert_down": "ffn_down",
               "shexp_gate": "ffn_gate", "shexp_up": "ffn_up", "shexp_down": "ffn_down", "qk_norm": "norm"}
VECTOR_ROLES = ("norm", "bias", "qk_norm")

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_GLOBAL_ROLES = {EMBED: "embed", FINAL_NORM: "norm", LM_HEAD: "lm_head"}

# tensors inside layer i, named "model.layers.{i}." + suffix
_LAYER_ROLES = {
    "input_layernorm.weight": "norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.q_proj.bias": "bias",
    "self_attn.k_proj.bias": "bias",
    "self_attn.v_proj.bias": "bias",
    "self_attn.o_proj.weight": "attn_o",
    "self_attn.o_proj.bias": "bias",
    "post_attention_layernorm.weight": "norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
    "self_attn.q_norm.weight": "qk_norm",                # qwen3, gemma3: RMSNorm per head on q and k
    "self_attn.k_norm.weight": "qk_norm",
    "pre_feedforward_layernorm.weight": "norm",          # gemma3: norms before and after the FFN
    "post_feedforward_layernorm.weight": "norm",
}
# mixture-of-experts layers: routed experts (expert_*) and the shared expert (shexp_*) are FFNs of their
# own roles (ROLE_FAMILY), the router (and the shared expert's sigmoid gate, a one-row router) has its own
_MOE_ROLES = {"mlp.gate.weight": "router", "mlp.shared_expert_gate.weight": "router",
              "mlp.shared_expert.gate_proj.weight": "shexp_gate", "mlp.shared_expert.up_proj.weight": "shexp_up",
              "mlp.shared_expert.down_proj.weight": "shexp_down"}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# buffers some checkpoints carry that are not weights of the graph (recomputed from the config)
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class FusionGroup:
    """Parts of one layer stacked by rows into `target` (suffixes after "model.layers.{i}.").
    Groups are independent: a fused bias may go with separate weights and the other way round."""
    target: str
    parts: tuple
    role: str                   # the fused tensor's role, for reports (inspect)


FUSION_GROUPS = (
    FusionGroup("self_attn.qkv_proj.weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "attn_qkv"),
    FusionGroup("self_attn.qkv_proj.bias",
                ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "bias"),
    FusionGroup("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "ffn_gate_up"),
)
_GROUP_OF_PART = {p: g for g in FUSION_GROUPS for p in g.parts}
_GROUP_BY_TARGET = {g.target: g for g in FUSION_GROUPS}


# Norm folding (quantize/calibrate.py): the linear weights of a layer whose input is this norm's output,
# so a quantized norm vector can be undone exactly in their columns.
NORM_FEEDS = {
    "input_layernorm.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "post_attention_layernorm.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
FINAL_NORM_FEEDS = (LM_HEAD,)
# an architecture whose norms multiply by (1 + weight) or sit where NORM_FEEDS does not say (gemma3's
# post_attention_layernorm normalises the attention output) has Arch.fold_norms False: no norm is
# folded into a weight


def split_layer(name: str) -> tuple[int | None, str]:
    """'model.layers.3.mlp.up_proj.weight' -> (3, 'mlp.up_proj.weight'); other names -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def role_of(name: str) -> str:
    """The role of an HF tensor name (or of a fused target name) in the graph; ModelError if none."""
    layer, rest = split_layer(name)
    role = (_LAYER_ROLES.get(rest) or _MOE_ROLES.get(rest)) if layer is not None else _GLOBAL_ROLES.get(name)
    if role is None and layer is not None and (m := _EXPERT.match(rest)):
        role = f"expert_{m.group(2)}"
    if role is None and layer is not None and rest in _GROUP_BY_TARGET:
        role = _GROUP_BY_TARGET[rest].role
    if role is None:
        raise ModelError(f"tensor {name!r} is not part of any supported graph (no known role)")
    return role


def family(role: str) -> str:
    """The role a recipe falls back to for `role` (ROLE_FAMILY), or the role itself."""
    return ROLE_FAMILY.get(role, role)


def group_of(name: str) -> tuple[str, tuple[str, ...]] | None:
    """The fusion group a part belongs to: (full target name, full part names), or None."""
    layer, rest = split_layer(name)
    g = _GROUP_OF_PART.get(rest) if layer is not None else None
    if g is None:
        return None
    p = f"model.layers.{layer}."
    return p + g.target, tuple(p + x for x in g.parts)


def parts_of(name: str) -> tuple[str, ...]:
    """The HF tensors a runtime tensor holds: a fused target's parts (full names), else (name,)."""
    layer, rest = split_layer(name)
    g = _GROUP_BY_TARGET.get(rest) if layer is not None else None
    if g is None:
        return (name,)
    return tuple(f"model.layers.{layer}.{x}" for x in g.parts)


def norm_feeds(name: str, arch: str | None = None) -> tuple[str, ...]:
    """The linear weights (full HF names) that take norm `name`'s output as their input; () for none
    (and for every norm of an architecture whose Arch.fold_norms is False)."""
    if arch is not None and not get_arch(arch).fold_norms:
        return ()
    if name == FINAL_NORM:
        return FINAL_NORM_FEEDS
    layer, rest = split_layer(name)
    if layer is None:
        return ()
    return tuple(f"model.layers.{layer}.{x}" for x in NORM_FEEDS.get(rest, ()))


def _pos_int(config: dict, key: str, default=None) -> int:
    v = config.get(key)
    if v is None and default is not None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ModelError(f"config {key} must be a positive integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class MoELayout:
    """A mixture-of-experts config: which layers are sparse, experts, top-k and FFN widths."""
    n_experts: int
    top_k: int
    inter: int                  # each routed expert's FFN width (moe_intermediate_size)
    shared_inter: int           # the shared expert's (0: none)
    norm_topk_prob: bool
    sparse: tuple               # per layer: routed experts (True) or a dense MLP


def moe_layout(config: dict, n_layers: int) -> MoELayout:
    """The MoE keys of a Qwen2-MoE / Qwen3-MoE config.json, checked: ModelError naming the key for zero
    experts, top-k above the expert count, a bad width or layer list."""
    e = config.get("num_experts")
    if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 1:
        raise ModelError(f"config num_experts must be a positive integer, got {e!r}")
    k = _pos_int(config, "num_experts_per_tok")
    if k > e:
        raise ModelError(f"config num_experts_per_tok={k} exceeds num_experts={e}")
    shared = config.get("shared_expert_intermediate_size") or 0
    if isinstance(shared, bool) or not isinstance(shared, (int, np.integer)) or shared < 0:
        raise ModelError(f"config shared_expert_intermediate_size must be a non-negative integer, got {shared!r}")
    step = _pos_int(config, "decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ModelError("config mlp_only_layers must be a list of layer indices")
    sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(n_layers))
    return MoELayout(int(e), k, _pos_int(config, "moe_intermediate_size"), int(shared),
                     bool(config.get("norm_topk_prob", False)), sparse)


class ModelSpec:
    """The tensors of one checkpoint, derived from its config: ModelSpec(config, arch). The sizes it
    reads must be positive integers (ModelError naming the key otherwise)."""

    def __init__(self, config: dict, arch: str):
        self.arch = arch
        a = get_arch(arch)
        self.qk_norm, self.ffn_norms = a.qk_norm, a.ffn_norms
        self.qkv_bias, self.o_bias = a.biases(config)
        h, nh = _pos_int(config, "hidden_size"), _pos_int(config, "num_attention_heads")
        nkv = _pos_int(config, "num_key_value_heads", nh)
        hd = _pos_int(config, "head_dim", h // nh)
        self.hidden, self.n_layers, self.head_dim = h, _pos_int(config, "num_hidden_layers"), hd
        self.n_q, self.n_kv = nh * hd, nkv * hd
        self.inter, self.vocab = _pos_int(config, "intermediate_size"), _pos_int(config, "vocab_size")
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.moe = moe_layout(config, self.n_layers) if a.moe else None

    def layer_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        h, nq, nkv, inter = self.hidden, self.n_q, self.n_kv, self.inter
        p = f"model.layers.{i}."
        s = {p + "input_layernorm.weight": (h,),
             p + "self_attn.q_proj.weight": (nq, h),
             p + "self_attn.k_proj.weight": (nkv, h),
             p + "self_attn.v_proj.weight": (nkv, h)}
        if self.qkv_bias:
            s.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                      p + "self_attn.v_proj.bias": (nkv,)})
        s[p + "self_attn.o_proj.weight"] = (h, nq)
        if self.o_bias:
            s[p + "self_attn.o_proj.bias"] = (h,)
        if self.qk_norm:
            s.update({p + "self_attn.q_norm.weight": (self.head_dim,), p + "self_attn.k_norm.weight": (self.head_dim,)})
        s[p + "post_attention_layernorm.weight"] = (h,)
        if self.ffn_norms:
            s[p + "pre_feedforward_layernorm.weight"] = (h,)
        if self.moe is not None and self.moe.sparse[i]:
            m = self.moe
            s[p + "mlp.gate.weight"] = (m.n_experts, h)
            for e in range(m.n_experts):
                s.update({f"{p}mlp.experts.{e}.gate_proj.weight": (m.inter, h),
                          f"{p}mlp.experts.{e}.up_proj.weight": (m.inter, h),
                          f"{p}mlp.experts.{e}.down_proj.weight": (h, m.inter)})
            if m.shared_inter:
                s.update({p + "mlp.shared_expert.gate_proj.weight": (m.shared_inter, h),
                          p + "mlp.shared_expert.up_proj.weight": (m.shared_inter, h),
                          p + "mlp.shared_expert.down_proj.weight": (h, m.shared_inter),
                          p + "mlp.shared_expert_gate.weight": (1, h)})
        else:
            s.update({p + "mlp.gate_proj.weight": (inter, h),
                      p + "mlp.up_proj.weight": (inter, h),
                      p + "mlp.down_proj.weight": (h, inter)})
        if self.ffn_norms:
            s[p + "post_feedforward_layernorm.weight"] = (h,)
        return s

    def shapes(self, *, with_lm_head: bool = False) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold with its HF shape, in write order (embedding, layers,
        final norm, lm_head). with_lm_head adds lm_head.weight for a tied model too: the .mxq keeps
        its own (higher-bit) copy of the embedding for the output projection."""
        out = {EMBED: (self.vocab, self.hidden)}
        for i in range(self.n_layers):
            out.update(self.layer_shapes(i))
        out[FINAL_NORM] = (self.hidden,)
        if with_lm_head or not self.tied:
            out[LM_HEAD] = (self.vocab, self.hidden)
        return out

    def groups(self, i: int) -> list[tuple[str, tuple[str, ...]]]:
        """Layer i's fusion groups present in this model: [(target, parts)], full names."""
        p = f"model.layers.{i}."
        have = self.layer_shapes(i)
        return [(p + g.target, tuple(p + x for x in g.parts))
                for g in FUSION_GROUPS if all(p + x in have for x in g.parts)]

    def fused_shape(self, target: str) -> tuple[int, ...]:
        layer, rest = split_layer(target)
        g = _GROUP_BY_TARGET.get(rest) if layer is not None else None
        if g is None:
            raise ModelError(f"{target!r} is not a fused tensor name")
        shp = self.layer_shapes(layer)
        parts = [shp[f"model.layers.{layer}.{x}"] for x in g.parts]
        return (sum(s[0] for s in parts),) + tuple(parts[0][1:])

    def check(self, shapes: dict, where: str) -> None:
        """ModelError for a missing tensor, a shape that disagrees with the config, or a tensor the
        graph has no place for (dropping it silently could change the model's answers)."""
        want = self.shapes()
        for name, shape in want.items():
            if name not in shapes:
                raise ModelError(f"{where}: missing tensor {name!r} ({self.arch}, {self.n_layers} layers)")
            got = tuple(shapes[name])
            if got != shape:
                hint = f" (head_dim={self.head_dim} x {self.n_q // self.head_dim} q / {self.n_kv // self.head_dim} " \
                       f"kv heads)" if ".self_attn." in name else ""
                raise ModelError(f"{where}: tensor {name!r} has shape {got}, config says {shape}{hint}")
        extra = sorted(n for n in shapes if n not in want and not _IGNORED.match(n)
                       and not (n == LM_HEAD and self.tied))
        if extra:
            raise ModelError(f"{where}: tensor {extra[0]!r} is not part of the {self.arch} graph with this "
                             f"config ({len(extra)} such tensor(s))")


# ----------------------------------------------------------------------------- fusion
def _same_meta(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def fuse_refusal(fmts, shapes, metas=None) -> str | None:
    """Why tensors of these formats and shapes cannot be stacked into one; None when they can.

    Packed rows are independent runs of blocks, so stacking tensors of one format is concatenating
    their bytes, except where a format has bytes for the whole tensor (q5g's range trailer) or the
    parts decode with different per-tensor metadata. 1-D vectors stack only in plain formats (a
    packed vector is one row whose last block is padded)."""
    from mixqrt.formats import layout

    fmts, shapes = list(fmts), [tuple(s) for s in shapes]
    if len(set(fmts)) != 1:
        return f"formats differ ({', '.join(fmts)})"
    fmt = fmts[0]
    if len({len(s) for s in shapes}) != 1 or len(shapes[0]) not in (1, 2):
        return f"shapes {shapes} are not all matrices or all vectors"
    if len(shapes[0]) == 2 and len({s[1] for s in shapes}) != 1:
        return f"column counts differ ({', '.join(str(s[1]) for s in shapes)})"
    lay = layout.PACKED.get(fmt)
    if lay is not None and lay.trailer:
        return f"{fmt} stores one range per tensor"
    if lay is not None and len(shapes[0]) == 1:
        return f"{fmt} vectors are padded to whole blocks"
    if metas is not None and any(not _same_meta(metas[0] or {}, m or {}) for m in metas[1:]):
        return "the parts decode with different metadata"
    return None


def fuse(parts: list):
    """Stack [N_i, K] tensors (or [N_i] vectors) into one, or None when fuse_refusal says they cannot.

    float arrays -> one float32 array; QTensors of one format -> one QTensor whose bytes are the
    parts' bytes back to back (so it decodes to exactly the parts' rows)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.ascontiguousarray(np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=0))
    if not all(is_qtensor(p) for p in parts):
        return None
    if fuse_refusal([p.fmt for p in parts], [p.shape for p in parts], [p.meta for p in parts]) is not None:
        return None
    from mixqrt.formats.qtensor import QTensor
    shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
    return QTensor(parts[0].fmt, shape, np.concatenate([np.asarray(p.raw).reshape(-1) for p in parts]),
                   dict(parts[0].meta or {}))


def row_slice(w, r0: int, r1: int):
    """Rows [r0, r1) of a [N, K] weight as the same kind of object, without copying: the inverse of
    fuse() (a fused tensor's parts are row ranges of it)."""
    from mixqrt.errors import KernelError
    from mixqrt.formats import layout

    if isinstance(w, np.ndarray):
        return w[r0:r1]
    from mixqrt.formats.qtensor import QTensor
    n, k = layout.rows_cols(w.shape)
    fmt = w.fmt
    if fmt in layout.INTERLEAVED:   # whole groups of rows only
        fmt, g = layout.INTERLEAVED[fmt]
        if r0 % g or r1 % g:
            raise KernelError(f"row views of a {w.fmt} tensor start and end on multiples of {g}, not [{r0}, {r1})")
    rb = layout.expected_nbytes(fmt, (2, k)) - layout.expected_nbytes(fmt, (1, k))
    if w.raw.size != n * rb:   # bytes for the whole tensor (q5g): no row views
        raise KernelError(f"cannot take row views of a {w.fmt} tensor")
    return QTensor(w.fmt, (r1 - r0, k), w.raw[r0 * rb:r1 * rb], dict(getattr(w, "meta", None) or {}))
