"""The streaming quantizer: source model -> recipe -> packed tensors -> .mxq, one tensor at a time.

Peak memory stays near the largest source tensor in float32 plus the tensors of one layer being
fused (q/k/v and gate/up are written as single fused tensors so loading needs no copy), never the
whole model in float32. Names, shapes, write order and fusion groups are models/spec.py's; whether a
group is written fused is spec.fuse's rule, the same one the model applies at load. The output is
written atomically by MxqWriter.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from mixqrt.errors import ModelError, QuantError
from mixqrt.platform.perf import peak_rss_bytes
from mixqrt.models import spec
from mixqrt.models.arch import get as get_arch
from mixqrt.quantize.recipes import DEFAULT_RECIPE, Recipe, get_recipe, tensor_plan, tie_source  # noqa: F401  (tensor_plan re-exported)

MXQ_KIND = "mixqrt-llm"


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
    calibration: dict | None = None     # calibrated runs: text, tokens, ctx, damp, seconds per tensor

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total_bytes / max(1, sum(int(np.prod(t.shape)) for t in self.tensors))

    def by_role(self) -> dict:
        out = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0, "formats": set()})
        for t in self.tensors:
            r = out[t.role]
            r["tensors"] += 1
            r["params"] += int(np.prod(t.shape))
            r["bytes"] += t.nbytes
            r["formats"].add(t.fmt)
        return {k: {"tensors": v["tensors"], "params": v["params"], "bytes": v["bytes"], "formats": sorted(v["formats"]),
                    "bpw": 8.0 * v["bytes"] / max(1, v["params"])} for k, v in out.items()}

    def to_dict(self) -> dict:
        return {"path": self.path, "recipe": self.recipe, "total_bytes": self.total_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4), "seconds": round(self.seconds, 2),
                "peak_rss_bytes": self.peak_rss_bytes, "by_role": self.by_role(), "calibration": self.calibration,
                "tensors": [{"name": t.name, "role": t.role, "fmt": t.fmt, "shape": list(t.shape),
                             "nbytes": t.nbytes, "bpw": round(t.bpw, 4)} for t in self.tensors]}


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise QuantError(f"tensor {name} has {bad} NaN/Inf values; refusing to quantize it")


def quantize_model(src, recipe=DEFAULT_RECIPE, out_path=None, *, overrides=None, progress=True, dry_run=False,
                   offline=None, imatrix=None, budget_bytes=None, calibrate=None, calib_tokens: int = 4096,
                   calib_ctx: int = 512, calib_label: str = "", damp: float = 0.01,
                   refit: int = 0, rotate=None, gptq_span: int = 1024) -> QuantReport:
    """Quantize a model source (path, hub id or an open Source) with a recipe into an .mxq file.

    dry_run=True plans and sizes every tensor without quantizing or writing anything.
    imatrix: a file from `mixqrt imatrix` (or its {name: [K] array} dict): per-column weights for the
    error-minimising quantizer of every linear weight it covers (q6/q4/q3u/q3p).
    recipe="auto" needs budget_bytes: formats per tensor from the measured sensitivity (quantize/auto.py).
    calibrate: calibration text (str), or quantize/calibtext.py's TextSource / GeneratedSource (the
    model's own sampled text) or a list of them sharing calib_tokens evenly: every q3p/q3u/q4/q6/q8
    linear weight is quantized by GPTQ with the Hessian of its inputs over the first calib_tokens
    tokens, layer by layer through the already quantized layers, and quantized norms are folded into
    the weights after them (quantize/calibrate.py).
    refit: passes of the calibrated header refit after GPTQ (gptq.refit_headers; 0, the default: off,
    because it measured worse end to end, docs/quality.md §0).
    rotate: None keeps the recipe's Hadamard rotations (formats/rotation.py); False turns them off; a
    {role: block} dict replaces them.
    gptq_span: columns per diagonal block of the GPTQ Hessian (gptq.Hessian's hblock); a matrix with at
    most this many input columns gets the exact, full Hessian. Memory grows as span^2 x 8 bytes per
    Hessian (docs/quality.md §0.6).
    """
    from mixqrt.io import open_source
    from mixqrt.io.mxq import MxqWriter
    from mixqrt.formats import layout, quantize
    from mixqrt.formats.codec import bind_range, to_storage
    from mixqrt.formats.qtensor import QTensor

    from mixqrt.formats.codec import SEARCH_FORMATS
    from mixqrt.quantize.imatrix import importance_for, load_imatrix

    t0 = time.perf_counter()
    source = src if hasattr(src, "tensor_names") else open_source(src, offline=offline, progress=progress)
    if (recipe == "auto") != (budget_bytes is not None) and not isinstance(recipe, Recipe):
        raise QuantError("recipe 'auto' and budget_bytes go together: pass both or neither")
    if recipe == "auto":
        from mixqrt.quantize.auto import auto_recipe
        rec = auto_recipe(source, int(budget_bytes), overrides=overrides)
    else:
        rec = get_recipe(recipe, overrides)
    if rotate is not None:
        rec.rotate = dict(rotate or {})
    imat = load_imatrix(imatrix) if imatrix is not None else None
    tie = tie_source(source) if rec.tie else None   # one tensor for embedding and output (recipe.tie)
    plan = tensor_plan(source, rec, tie=tie)
    if imat is not None and any(rec.rotation_for(n, f, s, r) for n, r, f, s in plan):
        import warnings
        warnings.warn("the imatrix is not applied to rotated tensors (its importance is per input column, which "
                      "the rotation mixes): pass rotate={} (`--rotate none`) to use it on every tensor",
                      UserWarning, stacklevel=2)
    if calibrate is not None:
        if isinstance(gptq_span, bool) or not isinstance(gptq_span, int) or not 64 <= gptq_span <= 65536:
            raise QuantError(f"gptq_span must be an integer in [64, 65536] (input columns), got {gptq_span!r}")
        from mixqrt.quantize.calibtext import TextSource, labels
        if isinstance(calibrate, str):
            calibrate = TextSource(calibrate, calib_label)
        rec.calibration = {"method": "gptq", "text": labels(calibrate), "tokens": int(calib_tokens), "ctx": int(calib_ctx),
                           "damp": float(damp), "refit": int(refit), "span": int(gptq_span)}
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
    if tie is not None:
        meta["config"]["tie_word_embeddings"] = True    # the model reads its embedding as lm_head
    tied = "lm_head.weight" not in source.tensor_names()

    def src_name(n):   # the source tensor behind .mxq tensor n
        if tie is not None and n == spec.EMBED:
            return tie
        return spec.EMBED if (tied and n == spec.LM_HEAD) else n
    from tqdm.auto import tqdm

    fmt_of = {n: f for n, _, f, _ in plan}

    def plain(name, fmt, arr):
        opts = {"lo": q5_range[0], "hi": q5_range[1]} if (fmt == "q5g" and q5_range) else {}
        imp = importance_for(imat, name, arr.shape[1]) if (imat and arr.ndim == 2) else None
        rot = rec.rotation_for(name, fmt, arr.shape)
        if rot is not None:
            opts["rot"] = rot
            imp = None          # per input column, which the rotation mixes
        if fmt in SEARCH_FORMATS and arr.ndim == 2 and (rec.search or imp is not None):
            opts["search"] = True
            opts["importance"] = imp
        return quantize(arr, fmt, **opts)

    cal = None
    if calibrate is not None:
        from mixqrt.models import get_model_class
        from mixqrt.quantize.calibrate import Calibrator
        from mixqrt.quantize.calibtext import calibration_set

        def load(n):
            a = source.get(src_name(n))
            return np.asarray(a, dtype=np.float32)

        cls = get_model_class(source.arch)
        args = cls.args_class.from_dict(dict(source.config), model_type=source.arch)
        chunks, where = calibration_set(source, calibrate, int(calib_tokens), int(calib_ctx), progress=progress)
        cal = Calibrator(args, chunks, load, plain, damp=damp, refit=refit, hblock=gptq_span, progress=progress,
                         rotation_for=rec.rotation_for)
        cal.fmts = fmt_of
        rec.calibration.update(where)
        meta["recipe"]["calibration"] = dict(rec.calibration)
        report.calibration = dict(rec.calibration)
    pending: dict[str, QTensor] = {}
    # a mixture of experts: every tensor on its own pages, so experts no token picks stay on disk
    from mixqrt.io.arena import ALIGN, PAGE
    with MxqWriter(out_path, meta, alignment=PAGE if get_arch(source.arch).moe else ALIGN) as w:
        for name, role, fmt, shape in tqdm(plan, desc="quantizing", unit="tensor", disable=not progress):
            arr = source.get(src_name(name))
            _check_finite(name, arr)
            if tuple(arr.shape) != tuple(shape):
                raise ModelError(f"tensor {name}: source says shape {shape} but holds {arr.shape}")
            qt = cal.quantize(name, fmt, arr) if cal is not None else plain(name, fmt, arr)
            del arr
            report.tensors.append(TensorReport(name, role, fmt, shape, qt.nbytes))
            layer, _ = spec.split_layer(name)
            group = spec.group_of(name)
            if group is None:
                w.add(name, to_storage(qt), layer=layer)
                continue
            pending[name] = qt
            target, parts = group
            if all(p in pending for p in parts):
                qts = [pending.pop(p) for p in parts]
                fused = spec.fuse(qts)   # None (e.g. formats differ, or q5g): the parts stay separate
                if fused is not None:   # interleaved only if every part is whole groups (row_slice)
                    whole = all(layout.storage_format(q.fmt, q.shape) != q.fmt for q in qts)
                    w.add(target, to_storage(fused) if whole else fused, layer=layer)
                else:
                    for p, q in zip(parts, qts):
                        w.add(p, to_storage(q), layer=layer)
        if pending:
            raise ModelError(f"incomplete fused group: {sorted(pending)}")
        for name in _embedding_tensors(meta):      # an embedding model's dense projections: float32
            arr = source.extra_tensor(name)
            _check_finite(name, arr)
            qt = quantize(np.ascontiguousarray(arr, dtype=np.float32), "f32")
            report.tensors.append(TensorReport(name, "embedding", "f32", tuple(arr.shape), qt.nbytes))
            w.add(name, to_storage(qt))
    report.seconds = time.perf_counter() - t0
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def build_meta(source, recipe: Recipe) -> dict:
    meta = {
        "kind": MXQ_KIND,
        "arch": source.arch,
        "config": dict(source.config),
        "generation_config": dict(source.generation_config or {}),
        "recipe": recipe.spec(),
        "source": str(getattr(source, "description", "") or getattr(source, "path", "")),
        "fused": {g.target: list(g.parts) for g in spec.FUSION_GROUPS},
        "q3p_levels": [int(v) for v in _q3p_levels()],   # so a future table change cannot misread old files
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    meta.update(source.tokenizer.to_meta())   # tokenizer.json, chat_template, tokenizer_info
    emb = getattr(source, "embedding", None)
    if emb is not None:                       # pooling, normalization, attention, dense layers (mixqrt.generation.embed)
        meta["embedding"] = dict(emb)
    return meta


def _embedding_tensors(meta: dict) -> list[str]:
    names = []
    for w, b, _ in (meta.get("embedding") or {}).get("dense") or []:
        names += [w] + ([b] if b else [])
    return names


def _q3p_levels():
    from mixqrt.formats.layout import Q3P_LEVELS
    return Q3P_LEVELS


def describe(report: QuantReport) -> str:
    """The bytes per role: role, tensors, formats, params, bits/weight, bytes, share of the file; in
    network order (runtime/placement's), then the total."""
    from mixqrt.runtime.placement import _ROLE_ORDER
    order = {r: i for i, r in enumerate(_ROLE_ORDER)}
    total = max(1, report.total_bytes)
    lines = [f"{'role':12s} {'tensors':>7s} {'formats':12s} {'params':>14s} {'bpw':>6s} {'bytes':>14s} {'share':>6s}"]
    for role, r in sorted(report.by_role().items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        lines.append(f"{role:12s} {r['tensors']:7d} {','.join(r['formats']):12s} {r['params']:14,d} {r['bpw']:6.3f} "
                     f"{r['bytes']:14,d} {100 * r['bytes'] / total:5.1f}%")
    lines.append(f"{'total':12s} {len(report.tensors):7d} {'':12s} {sum(int(np.prod(t.shape)) for t in report.tensors):14,d} "
                 f"{report.bits_per_weight:6.3f} {report.total_bytes:14,d} {'':>6s}")
    return "\n".join(lines)


def dumps_report(report: QuantReport) -> str:
    return json.dumps(report.to_dict(), indent=2, default=list)
