"""Calibrated quantization: the streaming quantizer's per-tensor hook that runs GPTQ (gptq.py).

The quantizer (convert.quantize_model) asks for tensors in file order: embedding, then layer by
layer, then the final norm and lm_head. On the first request for a layer this module quantizes the
whole layer, product by product in the order the layer multiplies them, running the model's own
layer function (Model.layer_forward; models/base.py's layer API) on the calibration hidden states:

  the layer's vectors (norms, biases) first, with plain quantization; then, until every product is
  quantized: run the layer with what is quantized so far and record, through models.base's
  product_inputs hook, the input of the first product whose weight is not quantized yet (its
  Hessian), stopping the layer there; quantize that weight with GPTQ (a fusion group's parts share
  that input and that Hessian).

For the qwen2 graph that is q/k/v (Hessian of the normed layer input), o_proj (of the attention
output, which already goes through the quantized q/k/v and their biases), gate/up, down (of SiLU*up).
The hidden states then advance through the *quantized* layer, so every layer's Hessians come from
inputs that already carry the previous layers' quantization error (GPTQ's sequential mode). lm_head
gets the Hessian of the final norm's output (Model.head). Nothing here knows the layer's structure:
which products exist, in which order, with which input, is the model's; which norm feeds which
weights (for folding) is models/spec.py's.

Norm folding: a quantized norm vector ĝ scales the next linear layer's input columns by ĝ instead of
g, which W diag(g/ĝ) undoes exactly, so the linear weights that follow are quantized as
W diag(g/ĝ) (ratios outside [0.5, 2] are left at 1: a norm weight rounded to ~0 cannot be undone).
The norm's 5-bit error then costs nothing beyond the linear layer's own rounding.

Memory: the hidden states of the calibration tokens ([T, D] float32), one layer's weights and its
Hessians (diagonal blocks, gptq.Hessian), one chunk's copy of the hidden states and its activations. The
vocabulary-sized lm_head is the largest single weight: it is scaled in place and GPTQ works on it in
row slabs (gptq.ROWS), so its float32 source is the only full-size copy.
"""
from __future__ import annotations

import time

import numpy as np

from mixqrt.errors import QuantError
from mixqrt.models import get_model_class, spec
from mixqrt.models.base import product_inputs
from mixqrt.formats import rotation
from mixqrt.formats.codec import dequantize, to_storage
from mixqrt.formats.qtensor import QTensor
from mixqrt.quantize.gptq import GPTQ_FORMATS, Hessian, gptq_quantize


def calibration_ids(tokenizer, text: str, tokens: int, ctx: int) -> list[np.ndarray]:
    """The first `tokens` tokens of `text` as chunks of `ctx` (the last chunk may be shorter)."""
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
    if tokens < 2 or ctx < 2:
        raise QuantError(f"calibration needs tokens >= 2 and ctx >= 2, got {tokens}, {ctx}")
    if ids.size < 2:
        raise QuantError(f"calibration text has {ids.size} tokens; it needs at least 2")
    ids = ids[:tokens]
    return [ids[s:s + ctx] for s in range(0, ids.size, ctx) if ids[s:s + ctx].size >= 2]


def _fold_ratio(g: np.ndarray, gq: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(gq != 0, g / np.where(gq != 0, gq, 1), 1).astype(np.float32)
    return np.where((r >= 0.5) & (r <= 2.0), r, np.float32(1)).astype(np.float32)


class _Pending:
    """A linear weight not quantized yet, in the model's layer: its shape only. It is never multiplied:
    the recording hook stops the layer at the first product that takes one. Each has its own format
    name, so spec.fuse leaves a group of them as parts."""

    def __init__(self, name: str, shape):
        self.name, self.shape = name, tuple(shape)
        self.fmt, self.raw, self.meta = f"pending:{name}", None, {}

    def dequantize(self):
        raise QuantError(f"calibration: {self.name} was used before it was quantized")


class _Stop(Exception):
    """Raised by the recording hook at the product being calibrated: the rest of the layer waits."""


class Calibrator:
    """Quantizes tensors on request (quantize(name, fmt, plain)); see the module docstring.

    load(name) -> float32 source tensor (tied lm_head resolved), a fresh array this class may modify;
    plain(name, fmt, arr) -> the uncalibrated quantizer of the recipe (RTN with search, q5g options...)."""

    def __init__(self, args, chunks: list[np.ndarray], load, plain, *, damp: float = 0.01,
                 hblock: int = 1024, fold_norms: bool = True, refit: int = 0, progress: bool = True,
                 rotation_for=None, observe=None):
        if not chunks or any(np.ndim(c) != 1 or np.size(c) < 1 for c in chunks):
            raise QuantError("calibration needs at least one non-empty chunk of token ids")
        self.a = args
        self.model = get_model_class(args.model_type).empty(args)   # filled and run one layer at a time
        self.spec = spec.ModelSpec(vars(args), args.model_type)
        self.observe = observe        # observe(names, x): every recorded product input (tests)
        self._cache = self.model.make_cache(max(int(c.size) for c in chunks))
        self.chunks = chunks
        self.load, self.plain = load, plain
        self.damp, self.hblock, self.fold, self.refit = float(damp), int(hblock), bool(fold_norms), int(refit)
        self.x: list[np.ndarray] | None = None      # hidden states per chunk [t, D]
        self.done: set = set()
        self.out: dict = {}
        self.seconds: dict[str, float] = {}
        self.progress = progress
        self.tokens = int(sum(c.size for c in chunks))
        self.rotation_for = rotation_for or (lambda name, fmt, shape: None)
        self._hrot: dict = {}           # (id(Hessian), block, seed) -> rotated Hessian, per layer

    # ------------------------------------------------------------------ entry point
    def quantize(self, name: str, fmt: str, arr: np.ndarray):
        if name == spec.EMBED:
            qt = self.plain(name, fmt, arr)
            self.model.load_global(spec.EMBED, qt)
            self.x = [self.model.embed(c) for c in self.chunks]
            self.model.embed_tokens = None
            return qt
        if name in self.out:
            return self.out.pop(name)
        if self.x is None:
            raise QuantError(f"calibration needs the embedding quantized before {name}")
        i, _ = spec.split_layer(name)
        if i is not None:
            if i not in self.done:
                self._layer(i)
                self.done.add(i)
        elif name in (spec.FINAL_NORM, spec.LM_HEAD) and "final" not in self.done:
            self._final()
            self.done.add("final")
        if name in self.out:
            return self.out.pop(name)
        return self.plain(name, fmt, arr)

    # ------------------------------------------------------------------ helpers
    def _norm(self, name: str, fmt: str):
        g = self.load(name)
        qt = self.plain(name, fmt, g)
        self.out[name] = qt
        gq = dequantize(qt).astype(np.float32).reshape(-1)
        return gq, (_fold_ratio(g, gq) if self.fold else np.ones_like(gq))

    def _linear(self, name: str, fmt: str, h: Hessian, ratio=None):
        t0 = time.perf_counter()
        w = self.load(name)
        if ratio is not None:   # in place: a second copy of a 7B lm_head is 2.2 GB
            np.multiply(w, ratio[None, :], out=w)
        rot = self.rotation_for(name, fmt, w.shape)
        if fmt in GPTQ_FORMATS and rot is not None:
            # GPTQ on the stored rows W R with the Hessian of the rotated inputs R^T X^T X R
            key = (id(h), rot["block"], rot["seed"])
            if key not in self._hrot:
                self._hrot[key] = (h, h.rotated(rot))      # h kept alive: its id stays unique
            w = np.ascontiguousarray(w, dtype=np.float32)     # load() gives a fresh array: rotate it in place
            qt = gptq_quantize(rotation.rotate(w, rot, inplace=True), fmt, self._hrot[key][1], damp=self.damp,
                               refit=self.refit)
            qt.meta = {**qt.meta, "rot": rot}
        elif fmt in GPTQ_FORMATS:
            qt = gptq_quantize(w, fmt, h, damp=self.damp, refit=self.refit)
        else:
            qt = self.plain(name, fmt, w)
        self.out[name] = qt
        self.seconds[name] = time.perf_counter() - t0
        return qt

    def _hess(self, k: int) -> Hessian:
        return Hessian(k, 64, self.hblock)

    # ------------------------------------------------------------------ one decoder layer
    def _vectors(self, names) -> tuple[dict, dict]:
        """Quantize norms and biases (plain) -> ({name: stored QTensor}, {linear weight: fold ratio})."""
        vec, ratios = {}, {}
        for n in names:
            feeds = spec.norm_feeds(n, self.spec.arch)
            if feeds:
                _, ratio = self._norm(n, self.fmts[n])
                ratios.update(dict.fromkeys(feeds, ratio))
            else:
                self.out[n] = self.plain(n, self.fmts[n], self.load(n))
            vec[n] = self.out[n]
        return vec, ratios

    def _record(self, weights: dict, run) -> tuple[tuple, Hessian]:
        """Run run(x) on a copy of every chunk's hidden states, recording the input of the first product
        whose weight is still _Pending -> (the HF names that weight stands for, with the rest of its fusion
        group: one input; the Hessian of that input)."""
        pending = {}
        for name, w in weights.items():
            if isinstance(w, _Pending):
                g = spec.group_of(name)
                pending[id(w)] = g[1] if g is not None else (name,)
        got: list = []

        def hook(w, x):
            names = pending.get(id(w))
            if names is None:
                return
            x = np.asarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1])
            if not got:
                got[:] = [names, self._hess(x.shape[1])]
            if names != got[0]:
                raise QuantError(f"calibration: the graph multiplies {names[0]} where {got[0][0]} came before")
            got[1].add(x)
            if self.observe is not None:
                self.observe(names, x)
            raise _Stop

        with product_inputs(hook, prefetch=False):
            for x in self.x:
                try:
                    run(x.copy())
                except _Stop:
                    pass
        if not got:
            left = sorted(weights[n].name for n in weights if isinstance(weights[n], _Pending))
            if all(".mlp.experts." in n for n in left):
                return tuple(left), None     # routed experts no calibration token chose
            raise QuantError(f"calibration: the graph never multiplies {left}")
        return got[0], got[1]

    def _layer(self, i: int) -> None:
        self._hrot.clear()
        m, shapes = self.model, self.spec.layer_shapes(i)
        cur, ratios = self._vectors([n for n, shp in shapes.items() if len(shp) == 1])
        cur.update({n: _Pending(n, shp) for n, shp in shapes.items() if len(shp) != 1})

        def run(x):
            m.layer_forward(i, x, self._cache, 0)

        def stored(ws):           # run the layout the file will hold (q4 -> q4x ...): the runtime's kernels
            return {n: (to_storage(w) if isinstance(w, QTensor) else w) for n, w in ws.items()}

        while any(isinstance(w, _Pending) for w in cur.values()):
            m.load_layer(i, stored(cur))
            names, h = self._record(m.layer_weights(i), run)
            for n in names:       # h None: experts never routed in calibration, rounded without a Hessian
                if h is None:
                    cur[n] = self.out[n] = self.plain(n, self.fmts[n], self.load(n))
                else:
                    cur[n] = self._linear(n, self.fmts[n], h, ratios.get(n))
        m.load_layer(i, stored(cur))
        for x in self.x:
            run(x)
        m.unload_layer(i)

    def _final(self) -> None:
        self._hrot.clear()
        m = self.model
        vec, ratios = self._vectors([spec.FINAL_NORM])
        m.load_global(spec.FINAL_NORM, vec[spec.FINAL_NORM])
        if spec.LM_HEAD in self.fmts:   # absent when the recipe ties it to the (RTN) embedding
            m.load_global(spec.LM_HEAD, _Pending(spec.LM_HEAD, self.spec.shapes(with_lm_head=True)[spec.LM_HEAD]))
            names, h = self._record({spec.LM_HEAD: m.lm_head}, m.head)
            self._linear(spec.LM_HEAD, self.fmts[spec.LM_HEAD], h, ratios.get(spec.LM_HEAD))
        self.x = None
