"""Helpers shared by the model graphs: tensor shapes, float32 conversion (row fusion: models/spec.fuse),
the public layer API every model offers, and the hook that sees every product's input.

The layer API. A model module (models/qwen2.py; llama.py builds on it) defines the graph once;
everything else runs the model through these methods, never through its private ones:

    n_layers, embed(ids) -> x [T, D], head(x) -> logits [T, V], make_cache(n), check_tokens(tokens)
    layer_forward(li, x, cache, pos0, positions)   layer li over T rows of one sequence, x in place
    forward_hidden(ids, cache, pos0[, last_row]) -> x  every layer (fused native decode where it has one)
    begin_batch / layer_batch(li, x, step) / end_batch    one batched decode step, layer by layer
    attn_stage / ffn_stage, ffn_in / ffn_halves / ffn_out  a layer's two halves (core-slicing)
    layer_weights(li), named_weights()               the runtime tensors by spec name (fused targets
                                                     as such, unfused groups as their parts)
    Model.empty(args), load_layer(i, tensors), unload_layer(i), load_global(name, t)
                                                     build (and run) a model piece by piece

Clients: the forward and decode_batch themselves, runtime/scheduler's runners (which call the
prefetcher between layers), GPTQ calibration (quantize/calibrate.py: one layer at a time, recording
product inputs with product_inputs below) and the imatrix (quantize/imatrix.py).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

from mixqrt.errors import ModelError


def is_qtensor(t) -> bool:
    return hasattr(t, "raw") and hasattr(t, "fmt") and hasattr(t, "dequantize")


def tensor_shape(t) -> tuple:
    if is_qtensor(t):
        return tuple(t.shape)
    if isinstance(t, np.ndarray):
        return t.shape
    raise ModelError(f"expected a QTensor or numpy array, got {type(t).__name__}")


def to_f32(t, name: str = "tensor") -> np.ndarray:
    """A float32 array for norm weights, biases and float matrices (QTensors are dequantized)."""
    arr = t.dequantize() if is_qtensor(t) else t
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.floating):
        raise ModelError(f"tensor {name!r} must be a float array or QTensor, got "
                         f"{getattr(arr, 'dtype', type(arr).__name__)}")
    return np.ascontiguousarray(arr, dtype=np.float32)


_HOOK = threading.local()


@contextmanager
def product_inputs(fn, *, prefetch: bool = True):
    """Within the block, each product the model graph makes (ops.matmul, and ops.router_logits for a
    MoE router) first calls fn(w, x): w the
    weight object multiplied, x its input [T, K] as the weight sees it (for a down projection fed the
    fused gate-up output, silu=True, the SiLU product). fn may raise to stop the forward right there.
    prefetch=False drops the gap-prefetch hint (then=), whose weight may be a placeholder.

    One hook for every reader of product inputs (imatrix, GPTQ calibration, the tests that compare
    them), so what calibration records is what the forward multiplies. Not reentrant across threads:
    the graph must run on the calling thread (the forward does; core-slicing runners do not)."""
    from mixqrt import ops
    orig, orig_router = ops.matmul, ops.router_logits

    def matmul(w, x, out=None, then=None, silu=False):
        if not getattr(_HOOK, "inside", False):      # ops.matmul's own fallbacks call matmul again
            if silu:
                xa = np.asarray(x, dtype=np.float32)
                k = xa.shape[-1] // 2
                fn(w, ops.silu_mul(xa[..., :k], xa[..., k:]))
            else:
                fn(w, x)
        _HOOK.inside = True
        try:
            return orig(w, x, out, then if prefetch else None, silu)
        finally:
            _HOOK.inside = False

    def router_logits(w, x):              # a MoE router's product (tier-exact, not ops.matmul)
        fn(w, x)
        return orig_router(w, x)

    ops.matmul, ops.router_logits = matmul, router_logits
    try:
        yield
    finally:
        ops.matmul, ops.router_logits = orig, orig_router
