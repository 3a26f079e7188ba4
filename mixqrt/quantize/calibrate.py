"""Calibrated quantization: the streaming quantizer's per-tensor hook that runs GPTQ (gptq.py).

The quantizer (convert.quantize_model) asks for tensors in file order: embedding, then layer by
layer, then the final norm and lm_head. On the first request for a layer this module quantizes the
whole layer, in the order its inputs need:

  input norm -> q/k/v (Hessian of the normed layer input) -> attention -> o_proj (Hessian of the
  attention output) -> post norm -> gate/up (shared Hessian) -> SiLU*up -> down (its own Hessian)

and then advances the calibration hidden states through the *quantized* layer, so every layer's
Hessians come from inputs that already carry the previous layers' quantization error (GPTQ's
sequential mode). lm_head gets the Hessian of the final norm's output.

Norm folding: a quantized norm vector ĝ scales the next linear layer's input columns by ĝ instead of
g, which W diag(g/ĝ) undoes exactly, so the linear weights that follow are quantized as
W diag(g/ĝ) (ratios outside [0.5, 2] are left at 1: a norm weight rounded to ~0 cannot be undone).
The norm's 5-bit error then costs nothing beyond the linear layer's own rounding.

Memory: the hidden states of the calibration tokens ([T, D] float32), one layer's weights and its
Hessians (diagonal blocks, gptq.Hessian); the SiLU*up activations of one chunk at a time. The
vocabulary-sized lm_head is the largest single weight: it is scaled in place and GPTQ works on it in
row slabs (gptq.ROWS), so its float32 source is the only full-size copy.
"""
from __future__ import annotations

import time

import numpy as np

from mixqrt import ops
from mixqrt.errors import QuantError
from mixqrt.formats import rotation
from mixqrt.formats.codec import dequantize, dequantize_rows
from mixqrt.quantize.gptq import GPTQ_FORMATS, Hessian, gptq_quantize

_ATTN = ("q", "k", "v")


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


class Calibrator:
    """Quantizes tensors on request (quantize(name, fmt, plain)); see the module docstring.

    load(name) -> float32 source tensor (tied lm_head resolved), a fresh array this class may modify;
    plain(name, fmt, arr) -> the uncalibrated quantizer of the recipe (RTN with search, q5g options...)."""

    def __init__(self, args, chunks: list[np.ndarray], load, plain, *, damp: float = 0.01,
                 hblock: int = 1024, fold_norms: bool = True, refit: int = 0, progress: bool = True,
                 rotation_for=None):
        self.a = args
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
        if name == "model.embed_tokens.weight":
            qt = self.plain(name, fmt, arr)
            self.x = [dequantize_rows(qt, c) for c in self.chunks]
            return qt
        if name in self.out:
            return self.out.pop(name)
        if self.x is None:
            raise QuantError(f"calibration needs the embedding quantized before {name}")
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in self.done:
                self._layer(i)
                self.done.add(i)
        elif name in ("model.norm.weight", "lm_head.weight") and "final" not in self.done:
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
    def _layer(self, i: int) -> None:
        self._hrot.clear()
        a, fmts = self.a, self.fmts
        p = f"model.layers.{i}."
        eps = a.rms_norm_eps
        nq, nkv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        hq, hkv, dh = a.num_attention_heads, a.num_key_value_heads, a.head_dim

        gq, ratio = self._norm(p + "input_layernorm.weight", fmts[p + "input_layernorm.weight"])
        H = self._hess(a.hidden_size)
        for x in self.x:
            H.add(ops.rmsnorm(x, gq, eps))
        ws = [self._linear(p + f"self_attn.{n}_proj.weight", fmts[p + f"self_attn.{n}_proj.weight"], H, ratio)
              for n in _ATTN]
        bias = None
        if a.attention_bias:
            bias = np.concatenate([self.load(p + f"self_attn.{n}_proj.bias") for n in _ATTN]).astype(np.float32)
        atts = []
        Ho = self._hess(nq)
        for x in self.x:
            t = x.shape[0]
            qkv = np.concatenate([ops.matmul(w, ops.rmsnorm(x, gq, eps)) for w in ws], axis=-1)
            if bias is not None:
                qkv += bias
            qk = ops.rope(qkv[:, :nq + nkv].reshape(t, hq + hkv, dh), np.arange(t, dtype=np.int64), a.rope_theta)
            keys = np.ascontiguousarray(qk[:, hq:].transpose(1, 0, 2))                  # [Hkv, t, Dh]
            vals = np.ascontiguousarray(qkv[:, nq + nkv:].reshape(t, hkv, dh).transpose(1, 0, 2))
            att = ops.attention(qk[:, :hq], keys, vals, 0).reshape(t, nq)
            Ho.add(att)
            atts.append(att)
        o = self._linear(p + "self_attn.o_proj.weight", fmts[p + "self_attn.o_proj.weight"], Ho)
        o_bias = self.load(p + "self_attn.o_proj.bias") if (p + "self_attn.o_proj.bias") in fmts else None
        for x, att in zip(self.x, atts):
            x += ops.matmul(o, att)
            if o_bias is not None:
                x += o_bias
        del atts
        gq2, ratio2 = self._norm(p + "post_attention_layernorm.weight", fmts[p + "post_attention_layernorm.weight"])
        Hg = self._hess(a.hidden_size)
        for x in self.x:
            Hg.add(ops.rmsnorm(x, gq2, eps))
        gate = self._linear(p + "mlp.gate_proj.weight", fmts[p + "mlp.gate_proj.weight"], Hg, ratio2)
        up = self._linear(p + "mlp.up_proj.weight", fmts[p + "mlp.up_proj.weight"], Hg, ratio2)
        Hd = self._hess(a.intermediate_size)
        for x in self.x:
            h = ops.rmsnorm(x, gq2, eps)
            Hd.add(ops.silu_mul(ops.matmul(gate, h), ops.matmul(up, h)))
        down = self._linear(p + "mlp.down_proj.weight", fmts[p + "mlp.down_proj.weight"], Hd)
        for x in self.x:   # recomputed rather than kept: [T, I] activations are the largest buffer
            h = ops.rmsnorm(x, gq2, eps)
            x += ops.matmul(down, ops.silu_mul(ops.matmul(gate, h), ops.matmul(up, h)))

    def _final(self) -> None:
        self._hrot.clear()
        gq, ratio = self._norm("model.norm.weight", self.fmts["model.norm.weight"])
        H = self._hess(self.a.hidden_size)
        for x in self.x:
            H.add(ops.rmsnorm(x, gq, self.a.rms_norm_eps))
        if "lm_head.weight" in self.fmts:   # absent when the recipe ties it to the (RTN) embedding
            self._linear("lm_head.weight", self.fmts["lm_head.weight"], H, ratio)
        self.x = None
