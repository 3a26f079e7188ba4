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


def inspect_model(model, *, placement: bool = False, as_json: bool = False, recipe: str | None = None) -> str:
    p = Path(str(model))
    if p.suffix == ".mxq" and p.exists():
        return _inspect_mxq(p, placement, as_json)
    from mixqrt.quantize.convert import describe, dumps_report, quantize_model
    from mixqrt.pipeline import _source_for
    from mixqrt.resolve import resolve
    res = resolve(model)
    rep = quantize_model(_source_for(res, None, True), recipe or res.recipe or DEFAULT_RECIPE, dry_run=True)
    return dumps_report(rep) if as_json else describe(rep) + "\n(plan only: nothing was quantized)"


def _inspect_mxq(path: Path, placement: bool, as_json: bool) -> str:
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
                "spans": spans}
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
    if plan_text:
        out.append(plan_text)
    return "\n".join(out)
