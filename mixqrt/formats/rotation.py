"""Randomized block Hadamard rotation of a weight's input dimension (incoherence processing).

A rotated tensor stores W R instead of W, with R = diag(s) H_b: s a fixed pattern of +-1 signs over
the K input columns and H_b the block-diagonal Sylvester Hadamard matrix, blocks of b columns
(orthonormal: entries +-1/sqrt(b)). The product is unchanged when the input is rotated the same way:

    W x = (W diag(s) H_b)(H_b diag(s) x)          (H_b H_b = I, diag(s)^2 = I)

so ``ops.matmul`` applies ``rotate(x)`` = H_b (s * x) to the activations of a rotated tensor before its
kernel, and ``dequantize`` returns the effective W (``unrotate`` of the stored rows). Rotated weight
rows are ``rotate(w_row)``, the same map, because H_b is symmetric.

Why: a block of b weights is quantized with one header; the rotation spreads an outlier weight (or an
outlier activation channel) over the b values of its block, so the block's values are closer to
Gaussian and the rounding error is spread instead of concentrated (QuIP#, QuaRot). b is the format's
group size or a multiple of it, so a rotated block never straddles two headers' spans unevenly.

The rotation is part of a tensor's format: ``meta["rot"] = {"block": b, "seed": S}``, written to the
.mxq tensor entry (file version 3). The signs are a pure function of (seed, K) (splitmix64 below), the
same on every machine and numpy version.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from mixqrt.errors import QuantError

try:
    from mixqrt._kernels import _ops
except ImportError:  # not built: the numpy reference (bit-identical)
    _ops = None

MAX_BLOCK = 1024
DEFAULT_SEED = 0x2356
_M64 = (1 << 64) - 1


def rotatable(fmt: str, shape) -> bool:
    """Whether a tensor of this format and shape can be stored rotated: a packed matrix (the plain
    formats have no groups to protect, q5g holds vectors)."""
    from mixqrt.formats import layout
    t = layout.TRAITS.get(fmt)
    return t is not None and t.rotatable and len(tuple(shape)) == 2


def record(rot, fmt: str, shape, where: str = "rotation") -> dict:
    """The checked rotation record {"block": b, "seed": s} of a tensor of fmt and shape, or QuantError
    naming what is wrong (the quantizer, the .mxq writer and the .mxq reader all go through here)."""
    if not rotatable(fmt, shape):
        raise QuantError(f"{where}: a rotation needs a packed matrix format, not {fmt} {tuple(shape)}")
    b, seed = check(rot, tuple(shape)[1], where)
    return {"block": b, "seed": seed}


def check(rot, k: int, where: str = "rotation") -> tuple[int, int]:
    """-> (block, seed) of a rotation record {"block": b, "seed": s} for rows of k values, or
    QuantError naming what is wrong."""
    if not isinstance(rot, dict) and not hasattr(rot, "keys") or set(rot.keys()) != {"block", "seed"}:
        raise QuantError(f"{where}: must be an object with keys block and seed, got {str(rot)[:80]}")
    b, s = rot["block"], rot["seed"]
    ok_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)   # noqa: E731
    if not ok_int(b) or not 2 <= b <= MAX_BLOCK or b & (b - 1):
        raise QuantError(f"{where}: block {str(b)[:40]} must be a power of two in [2, {MAX_BLOCK}]")
    if not ok_int(s) or not 0 <= s <= _M64:
        raise QuantError(f"{where}: seed {str(s)[:40]} must be an integer in [0, 2**64)")
    if k % b:
        raise QuantError(f"{where}: block {b} does not divide the {k} input columns")
    return int(b), int(s)


@lru_cache(maxsize=64)
def _signs(seed: int, k: int) -> np.ndarray:
    i = np.arange(1, k + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    s = np.where((z >> np.uint64(63)) == 0, np.float32(1), np.float32(-1)).astype(np.float32)
    s.setflags(write=False)
    return s


def signs(seed: int, k: int) -> np.ndarray:
    """The k +-1 signs (float32, read-only) of seed: bit 63 of splitmix64 of the column index."""
    return _signs(int(seed), int(k))


def scale(block: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(block))


def hadamard_ref(x: np.ndarray, block: int, signs=None) -> np.ndarray:
    """H_b (signs * x) per block of `block` values of the last axis (Sylvester order, scaled by
    1/sqrt(block)): the butterflies of the C op in the same order, in float32, so bit-identical.
    The numpy spec of ops.hadamard (mixqrt.ops.ref.hadamard), kept here below the ops layer."""
    y = np.array(x, dtype=np.float32, copy=True)
    if signs is not None:
        y *= np.asarray(signs, dtype=np.float32)
    k = y.shape[-1]
    v = y.reshape(-1, k // block, block)
    h = 1
    while h < block:
        u = v.reshape(v.shape[0], v.shape[1], block // (2 * h), 2, h)
        a, c = u[:, :, :, 0].copy(), u[:, :, :, 1].copy()
        u[:, :, :, 0] = a + c
        u[:, :, :, 1] = a - c
        h *= 2
    y *= np.float32(1.0 / np.sqrt(block))
    return y


def hadamard(x: np.ndarray, b: int, s, inplace: bool = False) -> np.ndarray:
    """H_b (s * x) on the rows of x (any leading shape) by the C kernel (numpy reference when not
    built), without argument checks: ops.hadamard checks and calls this (this module sits below
    mixqrt.ops, tests/test_layers.py). inplace: x (float32, C-contiguous) is overwritten and returned."""
    if inplace and not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous
                        and x.flags.writeable):
        raise QuantError("an in-place rotation needs a writeable C-contiguous float32 array")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if _ops is None:
        y = hadamard_ref(x, b, s)
        if inplace:
            x[...] = y
            return x
        return y
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 1 else x
    y = x2 if inplace else np.empty_like(x2)
    _ops.hadamard(x2, y, s, b, float(scale(b)))
    return x if inplace else y.reshape(x.shape)


def rotate(x: np.ndarray, rot, inplace: bool = False) -> np.ndarray:
    """H_b (s * x) on the last axis of x (a new float32 array, or x itself with inplace=True: no copy
    of a vocabulary-sized weight): the activations of a rotated tensor, or the stored rows of a weight."""
    if not inplace:
        x = np.asarray(x, dtype=np.float32)
    b, seed = check(rot, x.shape[-1])
    return hadamard(x, b, signs(seed, x.shape[-1]), inplace)


def unrotate(y: np.ndarray, rot) -> np.ndarray:
    """s * H_b y on the last axis (a new float32 array): the inverse of rotate."""
    y = np.asarray(y, dtype=np.float32)
    b, seed = check(rot, y.shape[-1])
    out = hadamard(y, b, None)
    out *= signs(seed, y.shape[-1])
    return out


def rotate_hessian(h: np.ndarray, rot, sgn=None) -> np.ndarray:
    """R^T H R for input Hessian H = X^T X (float64 [K, K]) of a tensor rotated by rot: the Hessian of
    the rotated inputs, in float64 (GPTQ on the stored, rotated rows). sgn: the signs of H's columns
    when H is one diagonal block of a wider input (default: rot's signs for K = H's width)."""
    k = h.shape[0]
    b, seed = check(rot, k)
    s = (signs(seed, k) if sgn is None else np.asarray(sgn)).astype(np.float64)
    hb = _sylvester(b)
    r = (h * s[None, :] * s[:, None]).reshape(k, k // b, b) @ hb          # H diag(s) blockdiag(Hb)
    r = r.reshape(k, k)
    return np.ascontiguousarray((hb @ r.reshape(k // b, b, k)).reshape(k, k))   # blockdiag(Hb) ... again


@lru_cache(maxsize=8)
def _sylvester(b: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(b)
    h.setflags(write=False)
    return h
