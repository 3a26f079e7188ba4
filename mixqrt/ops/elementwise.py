"""Float ops of a layer, on the calling thread (rmsnorm and rope split rows over the pool's parts):
rmsnorm, rope, silu_mul, softmax, gelu_tanh_mul, the MoE router's product (the same bits on every
tier) and the block Hadamard rotation. Numpy reference: mixqrt.ops.ref.
"""
from __future__ import annotations

import numpy as np

from mixqrt.errors import KernelError
from mixqrt.formats import rotation
from mixqrt.ops import ref as ops_ref
from mixqrt.ops.pool import _ops, _parts


def hadamard(x, block: int, signs=None) -> np.ndarray:
    """Block Hadamard rotation H_b (signs * x) of the rows of x ([K] or [T, K] float32): blocks of
    `block` values (a power of two <= 1024 dividing K), scaled by 1/sqrt(block); signs: float32 [K]
    of +-1 or None. Bit-identical on every ISA tier and to ops_ref.hadamard (mixqrt.formats.rotation)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim not in (1, 2):
        raise KernelError(f"hadamard: x must be [K] or [T, K], got shape {x.shape}")
    k = x.shape[-1]
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block <= 1024 \
            or block & (block - 1) or k == 0 or k % block:
        raise KernelError(f"hadamard: block {block!r} must be a power of two <= 1024 dividing {k}")
    if signs is not None:
        signs = np.ascontiguousarray(signs, dtype=np.float32)
        if signs.shape != (k,):
            raise KernelError(f"hadamard: signs must be [{k}], got shape {signs.shape}")
    return rotation.hadamard(x, int(block), signs)


# The float ops below run on the calling thread.
def rmsnorm(x, weight, eps: float, out=None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if out is None:
        out = np.empty_like(x)
    return _ops.rmsnorm(x, weight, float(eps), out, _parts())


def rope(x, positions, theta: float) -> np.ndarray:
    """Rotate-half RoPE on x [T, H, Dh] at `positions` [T]; returns a new array."""
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    pos = np.ascontiguousarray(np.asarray(positions, dtype=np.int64).reshape(-1))
    return _ops.rope_(y, pos, float(theta), _parts())


def rope_freqs(x, positions, inv_freq) -> np.ndarray:
    """Rotate-half RoPE on x [T, H, Dh] with explicit inverse frequencies inv_freq [Dh/2] (scaled RoPE:
    Llama 3's frequency factors, linear scaling); returns a new array. Numpy (no C kernel): the angles
    in float64, cos/sin rounded to float32 as ops_ref.rope does."""
    x = np.asarray(x, dtype=np.float32)
    inv = np.asarray(inv_freq, dtype=np.float64).reshape(-1)
    if x.ndim != 3 or 2 * inv.size != x.shape[2]:
        raise KernelError(f"rope_freqs: x {x.shape} and {inv.size} frequencies do not fit (x [T, H, 2*F])")
    return ops_ref.rope(x, np.asarray(positions, dtype=np.int64).reshape(-1), 0.0, inv_freq=inv)


def gelu_tanh_mul(gate, up) -> np.ndarray:
    """gelu(gate) * up with GELU's tanh approximation (GeGLU, Gemma's FFN); numpy."""
    g = np.asarray(gate, dtype=np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
            * np.asarray(up, dtype=np.float32)).astype(np.float32, copy=False)


def router_logits(w, x) -> np.ndarray:
    """x [T, K] (or [K]) @ w [N, K]^T for a mixture-of-experts router: the same bits on every ISA tier
    and in ops.ref (float32 in one fixed summation order, no FMA contraction), so the experts a token is
    routed to do not depend on the CPU. w: a float array or a QTensor (a packed router, from a
    --tensor-type override, is dequantized once and cached, like the kernel arguments)."""
    w = _router_f32(w)
    x = np.asarray(x, dtype=np.float32)
    x2 = np.ascontiguousarray(x.reshape(1, -1) if x.ndim == 1 else x)
    if w.ndim != 2 or x2.ndim != 2 or x2.shape[1] != w.shape[1]:
        raise KernelError(f"router_logits: x {x.shape} against a router {w.shape}")
    if _ops is None:
        y = ops_ref.router_logits(w, x2)
    else:
        y = _ops.dot_rows(w, x2, np.empty((x2.shape[0], w.shape[0]), np.float32))
    return y.reshape(-1) if x.ndim == 1 else y


_ROUTER_CACHE: dict = {}


def _router_f32(w) -> np.ndarray:
    """w as a C-contiguous float32 array; other dtypes and QTensors converted once (cached per object,
    validated by its identity, bounded like _ARGS_CACHE)."""
    if isinstance(w, np.ndarray) and w.dtype == np.float32 and w.flags.c_contiguous:
        return w
    hit = _ROUTER_CACHE.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1]
    if isinstance(w, np.ndarray):
        f32 = np.ascontiguousarray(w, dtype=np.float32)
    else:
        from mixqrt.formats import codec
        f32 = np.ascontiguousarray(codec.dequantize(w), dtype=np.float32)
    if len(_ROUTER_CACHE) > 256:
        _ROUTER_CACHE.clear()
    _ROUTER_CACHE[id(w)] = (w, f32)
    return f32


def silu_mul(gate, up, out=None) -> np.ndarray:
    if (isinstance(gate, np.ndarray) and isinstance(up, np.ndarray) and gate.ndim == 2 and gate.shape == up.shape
            and gate.dtype == np.float32 and up.dtype == np.float32 and gate.strides[1] == 4 and up.strides[1] == 4
            and not (gate.flags.c_contiguous and up.flags.c_contiguous) and out is None):
        # strided rows (halves of a fused gate-up buffer): row by row in C instead of two copies
        return _ops.silu_mul_rows(gate, up, np.empty(gate.shape, np.float32), _parts())
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    up = np.ascontiguousarray(up, dtype=np.float32)
    if gate.shape != up.shape:
        raise KernelError(f"silu_mul: gate {gate.shape} and up {up.shape} differ")
    if out is None:
        out = np.empty_like(gate)
    return _ops.silu_mul(gate, up, out)


def softmax(x, axis: int = -1, fast: bool = True) -> np.ndarray:
    """Softmax; fast=True is the hybrid-precision path (fast exp in range, libm exp outside)."""
    x = np.asarray(x, dtype=np.float32)
    if axis not in (-1, x.ndim - 1):
        return ops_ref.softmax(x, axis)
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    return _ops.softmax_(y, fast)


if _ops is None:  # kernels not built: the numpy reference serves these ops
    rmsnorm, silu_mul = ops_ref.rmsnorm, ops_ref.silu_mul  # noqa: F811
    rope, softmax = ops_ref.rope, ops_ref.softmax  # noqa: F811
