"""Importance matrix (llama.cpp's imatrix): per input column, the mean squared activation seen by
every linear weight over some calibration text.

For y = W x the output error of a quantized row is sum_j (dW_j x_j); averaged over tokens its
square is ~ sum_j dW_j^2 E[x_j^2] when activations are uncorrelated, so E[x_j^2] is the weight of
column j in the quantizer's error (formats.quantize(..., importance=)).

Collection: the model's own forward (mixqrt.load(...).logits) with ``mixqrt.ops.matmul`` wrapped for
the duration (models.base.product_inputs), recording x for every weight object the graph owns (fused q/k/v and gate/up share
their input, so each part gets the same vector). Storage: plain JSON (no pickle):

    {"format": "mixqrt-imatrix", "version": 1, "text": ..., "chunks": N, "ctx": C, "tokens": T,
     "tensors": {"model.layers.0.self_attn.q_proj.weight": {"count": T, "values": [K floats]}, ...}}
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager

import numpy as np

from mixqrt.errors import QuantError
from mixqrt.models import spec
from mixqrt.models.base import product_inputs

FORMAT = "mixqrt-imatrix"
MAX_BYTES = 1 << 30


def _targets(model) -> dict[int, list[str]]:
    """id(weight object) -> the HF tensor names whose input it sees: the model names its runtime
    tensors (Model.named_weights) and a fused target holds its group's parts (models/spec.py), which
    all see one input. Vectors (norms, biases) are listed too; no product takes them."""
    out: dict[int, list[str]] = {}
    for name, w in model.named_weights().items():
        if w is not None and name != spec.EMBED:      # the embedding's rows are gathered, not multiplied
            out.setdefault(id(w), []).extend(spec.parts_of(name))
    return out


class Collector:
    """Accumulates sum x^2 (float64) and token counts per weight id."""

    def __init__(self, model):
        self.targets = _targets(model)
        self.sums: dict[int, np.ndarray] = {}
        self.counts: dict[int, int] = {}

    def record(self, w, x) -> None:
        key = id(w)
        if key not in self.targets:
            return
        x2 = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
        s = (x2 * x2).sum(axis=0)
        if key in self.sums:
            self.sums[key] += s
            self.counts[key] += x2.shape[0]
        else:
            self.sums[key], self.counts[key] = s, x2.shape[0]

    def result(self) -> dict[str, tuple[int, np.ndarray]]:
        out = {}
        for key, names in self.targets.items():
            if key in self.sums:
                mean = (self.sums[key] / max(1, self.counts[key])).astype(np.float32)
                for n in names:
                    out[n] = (self.counts[key], mean)
        return out

    @contextmanager
    def hooked(self):
        """Record every product's input while the model runs (models.base.product_inputs)."""
        with product_inputs(self.record):
            yield self


def collect(m, text: str, *, chunks: int = 8, ctx: int = 512, progress: bool = True, source_label: str = "",
            model_label: str | None = None) -> dict:
    """Run a loaded model (mixqrt.load(...): .model, .tokenizer, .logits) over up to `chunks` chunks
    of `ctx` tokens of `text`; returns the JSON document. Loading is the caller's (the CLI's): this
    module sits below the pipeline."""
    if ctx < 2 or chunks < 1:
        raise QuantError(f"imatrix needs ctx >= 2 and chunks >= 1, got ctx={ctx}, chunks={chunks}")
    toks = list(m.tokenizer.encode(text, add_special_tokens=False))
    bos = m.tokenizer.bos_token_id if getattr(m.tokenizer, "add_bos_token", False) else None
    n = min(chunks, len(toks) // ctx)
    if n < 1:
        raise QuantError(f"calibration text has {len(toks)} tokens, fewer than one chunk of {ctx}")
    col = Collector(m.model)
    from tqdm.auto import tqdm
    with col.hooked():
        for i in tqdm(range(n), desc="imatrix", unit="chunk", disable=not progress):
            ids = np.asarray(toks[i * ctx:(i + 1) * ctx], dtype=np.int64)
            if bos is not None:
                ids[0] = bos
            m.logits(ids)
    res = col.result()
    label = model_label if model_label is not None else str(getattr(m, "path", ""))
    return {"format": FORMAT, "version": 1, "model": label, "recipe": getattr(m, "recipe", None),
            "text": source_label,
            "chunks": n, "ctx": ctx, "tokens": n * ctx,
            "tensors": {k: {"count": int(c), "values": [float(v) for v in vals]} for k, (c, vals) in sorted(res.items())}}


def save(doc: dict, path) -> None:
    from mixqrt.io.atomic import atomic_write
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def load_imatrix(path_or_doc) -> dict[str, np.ndarray]:
    """An imatrix file (or an already parsed document / a {name: array} dict) -> {name: float32 [K]}."""
    if isinstance(path_or_doc, dict) and "tensors" not in path_or_doc:
        return {k: _check(k, v) for k, v in path_or_doc.items()}
    doc = path_or_doc
    if not isinstance(doc, dict):
        size = os.path.getsize(path_or_doc)
        if size > MAX_BYTES:
            raise QuantError(f"{path_or_doc}: {size} bytes is too large for an imatrix file")
        try:
            with open(path_or_doc, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise QuantError(f"{path_or_doc}: not a readable imatrix JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict):
        raise QuantError(f"{path_or_doc}: not a mixqrt imatrix (format != {FORMAT!r})")
    return {k: _check(k, v.get("values") if isinstance(v, dict) else None) for k, v in doc["tensors"].items()}


def _check(name, values) -> np.ndarray:
    try:
        a = np.asarray(values, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError):
        raise QuantError(f"imatrix entry {name!r} is not a list of numbers") from None
    if a.size == 0 or not np.isfinite(a).all() or (a < 0).any():
        raise QuantError(f"imatrix entry {name!r} must be a non-empty list of finite values >= 0")
    return a


def importance_for(imat: dict | None, name: str, cols: int):
    """Column weights for tensor `name` (None when the imatrix has no entry). A small floor (1e-3 of
    the mean) keeps columns never activated in calibration from being ignored entirely."""
    if not imat or name not in imat:
        return None
    a = imat[name]
    if a.size != cols:
        raise QuantError(f"imatrix entry {name!r} has {a.size} values, the tensor has {cols} columns")
    mean = float(a.mean())
    if not math.isfinite(mean) or mean <= 0:
        return None
    return (a / np.float32(mean) + np.float32(1e-3)).astype(np.float32)
