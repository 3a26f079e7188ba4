"""KV caches by type: ``f32`` and ``f16`` (mixqrt.cache.KVCache: plain float rows) and the packed
types ``q4`` and ``q8`` (mixqrt.kv.packed.PackedKVCache: keys per channel over 64-position blocks,
values per position, 4 or 8 bits, f16 scales; the attention sink and a row's own partial block in
f16). Format and arithmetic: mixqrt/kv/ref.py; measurements: docs/long-context.md."""
from __future__ import annotations

import numpy as np

from mixqrt.cache import KVCache
from mixqrt.errors import GenerationError
from mixqrt.kv import ref
from mixqrt.kv.packed import KEEP, PackedKVCache

KV_TYPES = ("f32", "f16", "q8", "q4")
DEFAULT_KV_TYPE = "q4"
_FLOAT = {"f32": np.float32, "f16": np.float16}


def check_kv_type(kv_type) -> str:
    if kv_type not in KV_TYPES:
        raise GenerationError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    return kv_type


def dtype_kv_type(dtype) -> str:
    """float32 -> "f32", float16 -> "f16"."""
    d = np.dtype(dtype)
    if d == np.float32:
        return "f32"
    if d == np.float16:
        return "f16"
    raise GenerationError(f"a KV cache dtype must be float32 or float16, got {d}")


def make_kv_cache(kv_type, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, windows=None):
    """A cache of kv_type for max_len positions; windows: per layer a sliding window or None (a packed
    cache keeps a windowed layer in f16, its window only)."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT:
        return KVCache(num_layers, num_kv_heads, head_dim, max_len, _FLOAT[kv_type])
    return PackedKVCache(num_layers, num_kv_heads, head_dim, max_len, kv_type, windows)


def kv_bytes_per_token(kv_type, num_layers: int, num_kv_heads: int, head_dim: int, windows=None) -> float:
    """Steady-state bytes one more cached position costs (K and V, every layer; a windowed layer of a
    packed cache costs nothing past its window)."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT:
        return 2.0 * num_layers * num_kv_heads * head_dim * np.dtype(_FLOAT[kv_type]).itemsize
    per = ref.block_bytes(head_dim, PackedKVCache.bits_of(kv_type)) / ref.G
    n = sum(1 for li in range(num_layers) if windows is None or windows[li] is None)
    return float(per * n * num_kv_heads)


def bits_per_value(kv_type, head_dim: int) -> float:
    """Bits per cached value of a packed block (scales included), or the float width."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT:
        return 8.0 * np.dtype(_FLOAT[kv_type]).itemsize
    return 8.0 * ref.block_bytes(head_dim, PackedKVCache.bits_of(kv_type)) / (2 * ref.G * head_dim)


__all__ = ["KV_TYPES", "DEFAULT_KV_TYPE", "KEEP", "KVCache", "PackedKVCache", "make_kv_cache", "kv_bytes_per_token",
           "bits_per_value", "check_kv_type", "dtype_kv_type"]
