"""Numpy reference for every op of a Qwen2/Llama layer: the spec the C kernels are tested against.

Shapes follow the model: x [T, D] (T tokens), heads split as [T, H, Dh].
"""
from __future__ import annotations

import numpy as np

from mixqrt.formats.rotation import hadamard_ref as hadamard  # noqa: F401  (the spec lives below ops)


def matmul(w, x: np.ndarray) -> np.ndarray:
    """y = x @ W^T. w: QTensor or float array [N, K]; x: [K] or [T, K] float32 -> [N] or [T, N]."""
    wf = w.dequantize() if hasattr(w, "dequantize") else np.asarray(w, dtype=np.float32)
    wf = wf.reshape(-1, wf.shape[-1])
    return (np.asarray(x, dtype=np.float32) @ wf.T).astype(np.float32)


def embed(w, ids) -> np.ndarray:
    """Rows `ids` of the table w ([V, D]) as float32 [T, D]."""
    wf = w.dequantize() if hasattr(w, "dequantize") else np.asarray(w, dtype=np.float32)
    return wf[np.asarray(ids, dtype=np.int64)].astype(np.float32)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r * weight.astype(np.float64)).astype(np.float32)


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float, inv_freq=None):
    """cos, sin tables [T, head_dim/2] for the HF (NeoX, rotate-half) convention; inv_freq [head_dim/2]
    replaces theta's inverse frequencies (scaled RoPE)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)) if inv_freq is None \
        else np.asarray(inv_freq, dtype=np.float64)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, inv_freq=None) -> np.ndarray:
    """Rotate-half RoPE on x [T, H, Dh] at `positions` [T] (inv_freq: explicit inverse frequencies)."""
    t, h, dh = x.shape
    cos, sin = rope_cos_sin(positions, dh, theta, inv_freq)
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def router_logits(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ w [N, K]^T as the kernels' mq_dot_rows computes it, bit for bit, in float32: lane l
    (l < 16) sums the rounded products of k = l mod 16 in order (the K % 16 tail into lane 0), then
    the 16 lanes in a fixed tree."""
    w = np.asarray(w, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    n, k = w.shape
    k16 = k // 16 * 16
    p = x[:, None, :] * w[None, :, :]                                       # [T, N, K] float32 products
    a = np.zeros(p.shape[:2] + (16,), np.float32)
    if k16:
        a = np.cumsum(p[..., :k16].reshape(p.shape[0], n, k16 // 16, 16), axis=2, dtype=np.float32)[:, :, -1, :]
    a = np.array(a, dtype=np.float32)
    for i in range(k16, k):
        a[..., 0] = a[..., 0] + p[..., i]

    def s(i, j):
        return a[..., i] + a[..., j]
    return ((((s(0, 1) + s(2, 3)) + (s(4, 5) + s(6, 7))) + ((s(8, 9) + s(10, 11)) + (s(12, 13) + s(14, 15)))))


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int, window=None) -> np.ndarray:
    """Causal GQA attention.

    q: [T, Hq, Dh] for positions pos0 .. pos0+T-1; k_cache, v_cache: [Hkv, S, Dh] holding at least
    pos0+T filled positions. Query t attends to cache positions 0 .. pos0+t (with a window: only
    pos0+t-window+1 .. pos0+t). Returns [T, Hq, Dh].
    """
    t, hq, dh = q.shape
    hkv = k_cache.shape[0]
    g = hq // hkv
    n = pos0 + t
    out = np.empty((t, hq, dh), dtype=np.float32)
    scale = 1.0 / np.sqrt(dh)
    mask = np.arange(n)[None, :] > (pos0 + np.arange(t))[:, None]          # [T, n]
    if window is not None:
        mask |= np.arange(n)[None, :] <= (pos0 + np.arange(t))[:, None] - window
    for h in range(hq):
        kh, vh = k_cache[h // g, :n].astype(np.float64), v_cache[h // g, :n].astype(np.float64)
        s = (q[:, h].astype(np.float64) @ kh.T) * scale                      # [T, n]
        s[mask] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[:, h] = (p @ vh).astype(np.float32)
    return out
