"""Attention: ``attention`` (causal GQA over one sequence's cache, prefill or decode, with an optional
sliding window) and ``attention_batch`` (one decode query per sequence, each on its own cache), the
C kernels and the BLAS and window paths with their constants. Numpy reference: mixqrt.ops.ref.
"""
from __future__ import annotations

import math

import numpy as np

from mixqrt.errors import KernelError
from mixqrt.ops import ref as ops_ref
from mixqrt.ops.pool import _ops, _parts

# attention runs in C for any number of query rows when head_dim is a multiple of 16 (up to 256):
# prefill rows split over the pool by query position, each row computed exactly as the single-token
# decode at its position, so the result does not depend on the thread count or the tier. Other
# head sizes take BLAS products (numpy) above this many query rows (docs/lab/kernels-prefill.md, "Prefill on the pool")
ATTN_C_MAX_T = 8


ATTN_QBLOCK = 128   # prefill attention: query rows per causal block (keys up to the block's last position)


def _attention_blas(q, k_cache, v_cache, pos0, threads=0):
    """Prefill attention with BLAS products, blocked causally over the queries: block [i0, i1) only
    computes scores against keys [0, pos0 + i1) (about half the products and softmax work of the
    full T x T score matrix at pos0 = 0); masked keys inside a block are handled by the C causal softmax."""
    t, hq, dh = q.shape
    hkv = k_cache.shape[0]
    g = hq // hkv
    n = pos0 + t
    k = np.asarray(k_cache[:, :n], dtype=np.float32)
    v = np.asarray(v_cache[:, :n], dtype=np.float32)
    q4 = q.reshape(t, hkv, g, dh).transpose(1, 2, 0, 3)                     # [Hkv, g, T, Dh]
    out = np.empty((t, hkv, g, dh), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(dh))

    def head(h, sm_threads):   # (kv heads on Python threads were not measurably faster on the 2-core box)
        kh, vh = k[h], v[h]
        for i0 in range(0, t, ATTN_QBLOCK):
            i1 = min(t, i0 + ATTN_QBLOCK)
            tb, nb = i1 - i0, pos0 + i1
            qh = np.ascontiguousarray(q4[h, :, i0:i1]).reshape(g * tb, dh)
            s = np.dot(qh, kh[:nb].T)          # 2-D products: BLAS sgemm (stacked np.matmul was slower)
            s *= scale
            _ops.softmax_causal_(s, tb, pos0 + i0, sm_threads)  # rows (group, query): causal mask in C
            out[i0:i1, h] = np.dot(s, vh[:nb]).reshape(g, tb, dh).transpose(1, 0, 2)

    for h in range(hkv):
        head(h, threads)
    return out.reshape(t, hq, dh)


def attention(q, k_cache, v_cache, pos0: int, out=None, window: int | None = None) -> np.ndarray:
    """Causal GQA attention; q [T,Hq,Dh]; caches [Hkv,S,Dh] float32 or float16 -> [T,Hq,Dh].
    window: sliding-window attention, the query at position p sees keys p-window+1 .. p only."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    if q.ndim != 3 or k_cache.ndim != 3 or k_cache.shape[0] < 1 or q.shape[1] % k_cache.shape[0]:
        raise KernelError(f"attention: q {q.shape} and cache {k_cache.shape} do not fit (GQA needs Hq % Hkv == 0)")
    if pos0 < 0 or pos0 + q.shape[0] > k_cache.shape[1]:
        raise KernelError(f"attention: positions up to {pos0 + q.shape[0]} exceed the cache length {k_cache.shape[1]}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise KernelError(f"attention: window must be a positive integer, got {window!r}")
        if pos0 + q.shape[0] > window:              # some key falls outside some query's window
            return _attention_window(q, k_cache, v_cache, int(pos0), int(window), out)
    parts = _parts()
    if q.shape[0] > ATTN_C_MAX_T and (q.shape[2] % 16 or q.shape[2] > 256):
        o = _attention_blas(q, k_cache, v_cache, pos0, parts)
        if out is not None:
            out[...] = o
            return out
        return o
    if k_cache.dtype not in (np.float32, np.float16) or not k_cache.flags.c_contiguous:
        k_cache = np.ascontiguousarray(k_cache, dtype=np.float32)
    if v_cache.dtype != k_cache.dtype or not v_cache.flags.c_contiguous:
        v_cache = np.ascontiguousarray(v_cache, dtype=k_cache.dtype)
    if out is None:
        out = np.empty_like(q)
    return _ops.attention(q, k_cache, v_cache, int(pos0), out, parts)


def _attention_window(q, k_cache, v_cache, pos0, window, out):
    """Sliding-window attention. One query (decode): the C kernel over the window's keys (a copy of
    at most `window` positions). Several: numpy per block of queries over the keys their windows
    span, masked row by row (no C kernel takes a window yet)."""
    t = q.shape[0]
    if t == 1:
        lo = pos0 - window + 1
        return attention(q, np.ascontiguousarray(k_cache[:, lo:pos0 + 1]),
                         np.ascontiguousarray(v_cache[:, lo:pos0 + 1]), pos0 - lo, out)
    if out is None:
        out = np.empty_like(q)
    for s0 in range(0, t, 128):
        s1 = min(t, s0 + 128)
        p = pos0 + np.arange(s0, s1)                                    # the block's positions
        lo, hi = max(0, int(p[0]) - window + 1), int(p[-1]) + 1
        kp = np.arange(lo, hi)
        mask = (kp[None, :] > p[:, None]) | (kp[None, :] <= p[:, None] - window)     # [b, keys]
        block_attention(q[s0:s1], k_cache[:, lo:hi], v_cache[:, lo:hi], mask, out[s0:s1])
    return out


def block_attention(q, k, v, mask, out) -> np.ndarray:
    """Numpy attention of a block of queries q [b, Hq, Dh] over keys / values k, v [Hkv, n, Dh] (any
    float dtype), mask [b, n] True where a key is hidden (None: none) -> out [b, Hq, Dh] (written)."""
    hkv, g = k.shape[0], q.shape[1] // k.shape[0]
    scale = np.float32(1.0 / np.sqrt(q.shape[2]))
    for h in range(hkv):
        kh = np.asarray(k[h], dtype=np.float32)
        vh = np.asarray(v[h], dtype=np.float32)
        qh = q[:, h * g:(h + 1) * g].transpose(1, 0, 2)                  # [g, b, Dh]
        sc = (qh @ kh.T) * scale                                        # [g, b, keys]
        if mask is not None:
            sc[:, mask] = -np.inf
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        sc /= sc.sum(axis=-1, keepdims=True)
        out[:, h * g:(h + 1) * g] = (sc @ vh).transpose(1, 0, 2)
    return out


# attention_batch below this many keys in all (sum over the sequences) stays on the calling thread:
# one pool dispatch costs more than the work there
ATTN_BATCH_POOL_MIN = 1024


def attention_batch(q, k_caches, v_caches, positions, out=None) -> np.ndarray:
    """One decode query per sequence, each on its own cache: q [B,Hq,Dh]; k_caches[b], v_caches[b]
    [Hkv,S_b,Dh] float32 or float16; query b sits at positions[b] -> [B,Hq,Dh]. Row b equals
    attention(q[b:b+1], k_caches[b], v_caches[b], positions[b]) bit for bit; the (sequence, head)
    pairs share one pool dispatch (decode_batch ran one dispatch per sequence and layer before)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    pos = [int(p) for p in positions]
    if q.ndim != 3 or len(pos) != q.shape[0]:
        raise KernelError(f"attention_batch: q {q.shape} wants [B, Hq, Dh] with one position per row, got {len(pos)}")
    if out is None:
        out = np.empty_like(q)
    threads = _parts() if sum(pos) + len(pos) >= ATTN_BATCH_POOL_MIN else 1
    try:
        return _ops.attention_batch(q, list(k_caches), list(v_caches), pos, out, threads)
    except ValueError as e:
        raise KernelError(str(e)) from None


# ----------------------------------------------------------------------------- the packed KV cache
# kv_attention below this many keys x rows stays on the calling thread (one pool dispatch costs more)
KV_POOL_MIN = 512


def kv_attention(q, kf, vf, pk, pos0: int, bits: int, window: int | None = None, out=None) -> np.ndarray:
    """Causal GQA attention of q [T, Hq, Dh] (positions pos0..) over one layer of a packed KV cache
    (mixqrt.kv): kf, vf [Hkv, S, Dh] float16 stores, pk [Hkv, S/64, block_bytes] uint8 packed blocks or
    None (f16 only), bits 4 | 8, window: sliding window or None -> [T, Hq, Dh]. Each row is exactly
    a one-row call at its position (the kernel's reference: mixqrt.kv.ref.attention)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    if out is None or not (out.flags.c_contiguous and out.dtype == np.float32):
        out = np.empty_like(q)
    if q.ndim != 3:
        raise KernelError(f"kv_attention: q {q.shape} wants [T, Hq, Dh]")
    threads = _parts() if q.shape[0] * (pos0 + q.shape[0]) >= KV_POOL_MIN else 1
    try:
        return _ops.kv_attention(q, kf, vf, pk, int(pos0), int(bits), int(window or 0), out, threads)
    except ValueError as e:
        raise KernelError(str(e)) from None


def kv_attention_batch(q, caches, layer: int, positions, out=None) -> np.ndarray:
    """One decode query per sequence on its own packed cache (mixqrt.kv.PackedKVCache, one kv type):
    q [B, Hq, Dh], query b at positions[b] on caches[b]'s layer `layer` -> [B, Hq, Dh]; row b is
    exactly caches[b].attend(layer, q[b:b+1], positions[b])."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    pos = [int(p) for p in positions]
    if q.ndim != 3 or len(pos) != q.shape[0] or len(caches) != len(pos):
        raise KernelError(f"kv_attention_batch: q {q.shape}, {len(caches)} caches, {len(pos)} positions")
    bits = {c.bits for c in caches}
    if len(bits) != 1:
        raise KernelError("kv_attention_batch: the caches are of different KV types")
    if out is None:
        out = np.empty_like(q)
    threads = _parts() if sum(pos) + len(pos) >= ATTN_BATCH_POOL_MIN else 1
    try:
        return _ops.kv_attention_batch(q, [c.kf[layer] for c in caches], [c.vf[layer] for c in caches],
                                       [c.pk[layer] for c in caches], pos, bits.pop(),
                                       [c.windows[layer] or 0 for c in caches], out, threads)
    except ValueError as e:
        raise KernelError(str(e)) from None


if _ops is None:  # kernels not built: the numpy reference serves attention
    attention = ops_ref.attention  # noqa: F811
