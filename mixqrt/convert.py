"""The streaming quantizer: source model -> recipe -> packed tensors -> .mxq, one tensor at a time.

Peak memory stays near the largest source tensor in float32 plus the tensors of one layer being
fused (q/k/v and gate/up are written as single fused tensors so loading needs no copy), never the
whole model in float32. The output is written atomically by MxqWriter.
"""
from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from mixqrt.errors import ModelError, QuantError
from mixqrt.perf import peak_rss_bytes
from mixqrt.quant.recipes import Recipe, get_recipe, role_of

MXQ_KIND = "mixqrt-llm"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FUSE = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


@dataclass
class TensorReport:
    name: str
    role: str
    fmt: str
    shape: tuple
    nbytes: int

    @property
    def bpw(self) -> float:
        return 8.0 * self.nbytes / int(np.prod(self.shape))


@dataclass
class QuantReport:
    path: str | None
    recipe: dict
    tensors: list[TensorReport] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.tensors if t.role != "lm_head_copy")

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total_bytes / max(1, sum(int(np.prod(t.shape)) for t in self.tensors))

    def by_role(self) -> dict:
        out = defaultdict(lambda: {"params": 0, "bytes": 0, "formats": set()})
        for t in self.tensors:
            r = out[t.role]
            r["params"] += int(np.prod(t.shape))
            r["bytes"] += t.nbytes
            r["formats"].add(t.fmt)
        return {k: {"params": v["params"], "bytes": v["bytes"], "formats": sorted(v["formats"]),
                    "bpw": 8.0 * v["bytes"] / max(1, v["params"])} for k, v in out.items()}

    def to_dict(self) -> dict:
        return {"path": self.path, "recipe": self.recipe, "total_bytes": self.total_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4), "seconds": round(self.seconds, 2),
                "peak_rss_bytes": self.peak_rss_bytes, "by_role": self.by_role(),
                "tensors": [{"name": t.name, "role": t.role, "fmt": t.fmt, "shape": list(t.shape),
                             "nbytes": t.nbytes, "bpw": round(t.bpw, 4)} for t in self.tensors]}


def _ordered_names(names: list[str], n_layers: int) -> list[str]:
    """Embedding first, then each layer's tensors together, then the final norm and lm_head."""
    layers = defaultdict(list)
    head, tail = [], []
    for n in names:
        m = _LAYER.match(n)
        if m:
            layers[int(m.group(1))].append(n)
        elif "embed_tokens" in n:
            head.append(n)
        else:
            tail.append(n)
    out = sorted(head)
    for i in range(n_layers):
        out += sorted(layers.get(i, []))
    extra = sorted(set(layers) - set(range(n_layers)))
    if extra:
        raise ModelError(f"source has tensors for layer {extra[0]} but the config says {n_layers} layers")
    return out + sorted(tail, key=lambda n: (n != "model.norm.weight", n))


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise QuantError(f"tensor {name} has {bad} NaN/Inf values; refusing to quantize it")


def tensor_plan(source, recipe: Recipe) -> list[tuple[str, str, str, tuple]]:
    """[(name, role, fmt, shape)] in write order, with the tied lm_head made explicit."""
    cfg = source.config
    names = list(source.tensor_names())
    if "lm_head.weight" not in names:
        names.append("lm_head.weight")  # tied: a separate, higher-bit copy of the embedding
    plan = []
    for n in _ordered_names(names, int(cfg["num_hidden_layers"])):
        src = "model.embed_tokens.weight" if (n == "lm_head.weight" and "lm_head.weight" not in source.tensor_names()) else n
        shape = tuple(source.tensor_info(src)[0])
        role = role_of(n)
        plan.append((n, role, recipe.format_for(n, role), shape))
    return plan


def quantize_model(src, recipe="2356", out_path=None, *, overrides=None, progress=True, dry_run=False,
                   offline=None, imatrix=None, budget_bytes=None) -> QuantReport:
    """Quantize a model source (path, hub id or an open Source) with a recipe into an .mxq file.

    dry_run=True plans and sizes every tensor without quantizing or writing anything.
    imatrix: a file from `mixqrt imatrix` (or its {name: [K] array} dict): per-column weights for the
    error-minimising quantizer of every linear weight it covers (q6/q4/q3u/q3p).
    recipe="auto" needs budget_bytes: formats per tensor from the measured sensitivity (quant/auto.py).
    """
    from mixqrt.io import open_source
    from mixqrt.io.mxq import MxqWriter
    from mixqrt.quant import layout, quantize
    from mixqrt.quant.formats import bind_range
    from mixqrt.quant.qtensor import QTensor

    from mixqrt.quant.formats import SEARCH_FORMATS
    from mixqrt.quant.imatrix import importance_for, load_imatrix

    t0 = time.perf_counter()
    source = src if hasattr(src, "tensor_names") else open_source(src, offline=offline, progress=progress)
    if (recipe == "auto") != (budget_bytes is not None) and not isinstance(recipe, Recipe):
        raise QuantError("recipe 'auto' and budget_bytes go together: pass both or neither")
    if recipe == "auto":
        from mixqrt.quant.auto import auto_recipe
        rec = auto_recipe(source, int(budget_bytes), overrides=overrides)
    else:
        rec = get_recipe(recipe, overrides)
    imat = load_imatrix(imatrix) if imatrix is not None else None
    plan = tensor_plan(source, rec)
    report = QuantReport(str(out_path) if out_path else None, rec.spec())
    if dry_run:
        for name, role, fmt, shape in plan:
            report.tensors.append(TensorReport(name, role, fmt, shape, layout.expected_nbytes(fmt, shape)))
        return report
    if out_path is None:
        raise QuantError("quantize_model needs out_path unless dry_run=True")

    # dynamic range binding: one (lo, hi) over every vector quantized to q5g
    q5 = [n for n, _, fmt, _ in plan if fmt == "q5g"]
    q5_range = bind_range([source.get(n) for n in q5]) if (q5 and rec.q5g_binding == "global") else None

    meta = build_meta(source, rec)
    tied = "lm_head.weight" not in source.tensor_names()
    from tqdm.auto import tqdm

    # layers whose q/k/v weights cannot be fused (formats differ): their biases stay separate too,
    # since the graph pairs a fused bias with a fused weight only
    fmt_of = {n: f for n, _, f, _ in plan}
    split_qkv = set()
    for n, f in fmt_of.items():
        m = _LAYER.match(n)
        if m and n.endswith("self_attn.q_proj.weight"):
            p = n[: m.end()]
            if len({fmt_of.get(p + f"self_attn.{x}_proj.weight") for x in "qkv"}) != 1 or f == "q5g":
                split_qkv.add(p)
    pending: dict[str, QTensor] = {}
    with MxqWriter(out_path, meta) as w:
        for name, role, fmt, shape in tqdm(plan, desc="quantizing", unit="tensor", disable=not progress):
            arr = source.get("model.embed_tokens.weight" if (tied and name == "lm_head.weight") else name)
            _check_finite(name, arr)
            if tuple(arr.shape) != tuple(shape):
                raise ModelError(f"tensor {name}: source says shape {shape} but holds {arr.shape}")
            opts = {"lo": q5_range[0], "hi": q5_range[1]} if (fmt == "q5g" and q5_range) else {}
            imp = importance_for(imat, name, arr.shape[1]) if (imat and arr.ndim == 2) else None
            if fmt in SEARCH_FORMATS and arr.ndim == 2 and (rec.search or imp is not None):
                opts["search"] = True
                opts["importance"] = imp
            qt = quantize(arr, fmt, **opts)
            del arr
            report.tensors.append(TensorReport(name, role, fmt, shape, qt.nbytes))
            m = _LAYER.match(name)
            layer = int(m.group(1)) if m else None
            fused = _fuse_target(name)
            if fused is not None and fused[0].endswith(".bias") and name[: m.end()] in split_qkv:
                fused = None
            if fused is None:
                w.add(name, qt, layer=layer)
                continue
            pending[name] = qt
            prefix = name[: m.end()]
            target, parts = fused
            if all(prefix + p in pending for p in parts):
                qts = [pending.pop(prefix + p) for p in parts]
                one_fmt = len({q.fmt for q in qts}) == 1
                if one_fmt and all(len(q.shape) == 2 for q in qts) and len({q.cols for q in qts}) == 1:
                    # packed rows are independent: fusing is concatenating row blocks
                    shp = (sum(q.rows for q in qts), qts[0].cols)
                    w.add(prefix + target, QTensor(qts[0].fmt, shp, np.concatenate([q.raw for q in qts])),
                          layer=layer)
                elif one_fmt and all(len(q.shape) == 1 for q in qts) and qts[0].fmt in layout.PLAIN:
                    shp = (sum(q.shape[0] for q in qts),)
                    w.add(prefix + target, QTensor(qts[0].fmt, shp, np.concatenate([q.raw for q in qts])),
                          layer=layer)
                else:  # formats differ (an override): keep the parts separate
                    for p, q in zip(parts, qts):
                        w.add(prefix + p, q, layer=layer)
        if pending:
            raise ModelError(f"incomplete fused group: {sorted(pending)}")
    report.seconds = time.perf_counter() - t0
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _fuse_target(name: str):
    m = _LAYER.match(name)
    if not m:
        return None
    rest = name[m.end():]
    for target, parts in FUSE.items():
        if rest in parts:
            return target, parts
    return None


def build_meta(source, recipe: Recipe) -> dict:
    meta = {
        "kind": MXQ_KIND,
        "arch": source.arch,
        "config": dict(source.config),
        "generation_config": dict(source.generation_config or {}),
        "recipe": recipe.spec(),
        "source": str(getattr(source, "description", "") or getattr(source, "path", "")),
        "fused": {k: list(v) for k, v in FUSE.items()},
        "q3p_levels": [int(v) for v in _q3p_levels()],   # so a future table change cannot misread old files
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    meta.update(source.tokenizer.to_meta())   # tokenizer.json, chat_template, tokenizer_info
    return meta


def _q3p_levels():
    from mixqrt.quant.layout import Q3P_LEVELS
    return Q3P_LEVELS


def describe(report: QuantReport) -> str:
    lines = [f"{'role':10s} {'formats':12s} {'params':>12s} {'bytes':>12s} {'bpw':>6s}"]
    for role, r in sorted(report.by_role().items()):
        lines.append(f"{role:10s} {','.join(r['formats']):12s} {r['params']:12,d} {r['bytes']:12,d} {r['bpw']:6.3f}")
    lines.append(f"{'total':10s} {'':12s} {sum(int(np.prod(t.shape)) for t in report.tensors):12,d} "
                 f"{report.total_bytes:12,d} {report.bits_per_weight:6.3f}")
    return "\n".join(lines)


def dumps_report(report: QuantReport) -> str:
    return json.dumps(report.to_dict(), indent=2, default=list)
