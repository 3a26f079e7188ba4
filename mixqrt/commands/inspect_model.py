"""`mixqrt inspect`: per-tensor format, bits/weight, bytes, file layout and placement plan."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from mixqrt.quantize.recipes import DEFAULT_RECIPE

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _role(name: str) -> str:
    from mixqrt.models.spec import role_of       # fused names have roles too (attn_qkv, ffn_gate_up)
    try:
        return role_of(name)
    except ValueError:
        return "other"


def kv_cache_info(meta: dict, kv_type: str | None = None) -> dict:
    """KV cache sizes of a model file's config: bytes per token of kv_type (default DEFAULT_KV_TYPE)
    and of every type this build makes, and the bytes of the whole context."""
    from mixqrt.models.kv_cache import KV_TYPES, check_kv_type, kv_bytes_per_token
    from mixqrt.errors import MixqrtError
    from mixqrt.models import get_model_class
    kv_type = check_kv_type(kv_type)
    cls = get_model_class(meta.get("arch"))
    a = cls.args_class.from_dict(meta.get("config"))
    dims = (a.num_hidden_layers, a.num_key_value_heads, a.head_dim)
    per = {}
    for t in KV_TYPES:
        try:
            per[t] = kv_bytes_per_token(t, *dims)
        except MixqrtError:              # a type this build does not make
            pass
    bpt = kv_bytes_per_token(kv_type, *dims)
    return {"kv_type": kv_type, "kv_bytes_per_token": bpt, "kv_bytes_per_token_by_type": per,
            "context": a.max_position_embeddings, "kv_bytes_context": bpt * a.max_position_embeddings,
            "bits_per_value": 8 * bpt / (2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim)}


def format_kv_info(kv: dict) -> str:
    return (f"KV cache {kv['kv_type']}: {kv['kv_bytes_per_token']:,.0f} bytes per token ({kv['bits_per_value']:.2f} "
            f"bits per value; {kv['kv_bytes_per_token'] * 16384 / 2**20:,.1f} MiB at 16,384 tokens, "
            f"{kv['kv_bytes_context'] / 2**20:,.1f} MiB for the whole context of {kv['context']:,d}); "
            + ", ".join(f"{t} {b:,.0f}" for t, b in kv["kv_bytes_per_token_by_type"].items()) + " bytes per token")


def inspect_model(model, *, placement: bool = False, as_json: bool = False, recipe: str | None = None,
                  kv_type: str | None = None) -> str:
    p = Path(str(model))
    if p.suffix == ".mxq" and p.exists():
        return _inspect_mxq(p, placement, as_json, kv_type)
    from mixqrt.quantize.convert import describe, dumps_report, quantize_model
    from mixqrt.pipeline import _source_for
    from mixqrt.quantize.names import resolve
    res = resolve(model)
    rep = quantize_model(_source_for(res, None, True), recipe or res.recipe or DEFAULT_RECIPE, dry_run=True)
    return dumps_report(rep) if as_json else describe(rep) + "\n(plan only: nothing was quantized)"


def _inspect_mxq(path: Path, placement: bool, as_json: bool, kv_type: str | None = None) -> str:
    from mixqrt.io.mxq import MxqFile
    with MxqFile(path) as f:
        rows = []
        for name, qt in f.tensors.items():
            m = _LAYER.match(name)
            rows.append({"name": name, "role": _role(name), "fmt": qt.fmt, "shape": list(qt.shape),
                         "bpw": round(qt.bits_per_weight, 4), "nbytes": qt.nbytes,
                         "offset": f.offsets[name] if hasattr(f, "offsets") else None,
                         "layer": int(m.group(1)) if m else None,
                         "rot": (qt.meta or {}).get("rot") and dict(qt.meta["rot"])})
        total = sum(r["nbytes"] for r in rows)
        params = sum(int(np.prod(r["shape"])) for r in rows)
        spans = {str(k): list(v) for k, v in getattr(f, "spans", {}).items()}
        info = {"path": str(path), "file_bytes": path.stat().st_size, "header_bytes": getattr(f, "header_bytes", None),
                "recipe": f.meta.get("recipe"), "arch": f.meta.get("arch"), "tensors": rows,
                "total_bytes": total, "params": params, "bits_per_weight": round(8 * total / max(1, params), 4),
                "spans": spans, "kv_cache": kv_cache_info(f.meta, kv_type)}
        plan_text = None
        if placement:
            from mixqrt.runtime.placement import format_placement, plan_placement
            from mixqrt.platform.topology import topology
            topo = topology()
            plan = plan_placement([(r["name"], r["role"], r["nbytes"], r["layer"]) for r in rows], topo,
                                  policy="tiered")
            plan_text = format_placement(plan, topo)
            info["placement"] = [p.__dict__ if hasattr(p, "__dict__") else p for p in plan]
    if as_json:
        return json.dumps(info, indent=2, default=str)
    out = [f"{path}  arch={info['arch']}  recipe={(info['recipe'] or {}).get('name')}  "
           f"file={info['file_bytes']:,d} B  header={info['header_bytes']} B",
           f"{'name':56s} {'role':12s} {'fmt':5s} {'shape':>14s} {'bpw':>7s} {'bytes':>12s}"]
    for r in rows:
        out.append(f"{r['name']:56s} {r['role']:12s} {r['fmt']:5s} {'x'.join(map(str, r['shape'])):>14s} "
                   f"{r['bpw']:7.3f} {r['nbytes']:12,d}" + (f"  rot H{r['rot']['block']}" if r["rot"] else ""))
    out.append(f"{'total':56s} {'':12s} {'':5s} {params:14,d} {info['bits_per_weight']:7.3f} {total:12,d}")
    if spans:
        out.append(f"{len(spans)} page-aligned spans (layer: offset, bytes): " +
                   ", ".join(f"{k}: {v[0]}+{v[1]}" for k, v in list(spans.items())[:4]) + (" ..." if len(spans) > 4 else ""))
    out.append(format_kv_info(info["kv_cache"]))
    if plan_text:
        out.append(plan_text)
    return "\n".join(out)
