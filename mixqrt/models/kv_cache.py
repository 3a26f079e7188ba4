"""Preallocated KV cache (gpt-fast style): one K and one V buffer per layer, allocated once.

The buffers of a cache are views of one anonymous mmap, so a cache sized for the whole context only
becomes resident as positions are written (page by page). np.zeros does not promise that: glibc
serves a 1 MiB array from recycled heap memory once its dynamic mmap threshold has risen, and
calloc then zeroes every page of it. A server keeping hundreds of idle caches (the prompt cache)
grew to 7-11 GB that way while it accounted for 1 GiB of written rows. Transparent huge pages are
refused on the mapping (MADV_NOHUGEPAGE) for the same reason: a 2 MiB page would make 8192 rows of
one head resident at the first write.
"""
from __future__ import annotations

import mmap

import numpy as np

from mixqrt.errors import GenerationError
from mixqrt.kv import check_room


def _lazy_zeros(n: int, dtype) -> np.ndarray:
    """n zeros of dtype in a private anonymous mapping: no page is resident before it is written."""
    dtype = np.dtype(dtype)
    m = mmap.mmap(-1, max(1, n * dtype.itemsize), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:      # a kernel without THP: nothing to refuse
            pass
    return np.frombuffer(m, dtype=dtype, count=n)


class KVCache:
    """Keys and values of every layer for positions 0 .. max_len-1.

    ``offset`` is the number of positions filled (the next token's position). The model writes
    positions pos0 .. pos0+T-1 of every layer with ``write`` and then calls ``advance``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype=np.float32):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_len", max_len)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise GenerationError(f"KVCache {name} must be a positive int, got {v!r}")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.max_len = int(max_len)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float16):
            raise GenerationError(f"KVCache dtype must be float32 or float16, got {self.dtype}")
        shape = (self.num_kv_heads, self.max_len, self.head_dim)
        flat = _lazy_zeros(2 * self.num_layers * int(np.prod(shape)), self.dtype)
        self.stacked = flat.reshape(2 * self.num_layers, *shape)   # [2L, Hkv, S, Dh]: every K, then every V
        self.keys = list(self.stacked[:self.num_layers])           # L x [Hkv, S, Dh]
        self.values = list(self.stacked[self.num_layers:])         # L x [Hkv, S, Dh]
        self.offset = 0                          # positions filled

    # ------------------------------------------------------------------ writes
    check_room = check_room                    # the rule of every KV cache (mixqrt.kv.check_room)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, pos0: int) -> None:
        """Store k, v ([T, Hkv, Dh]) at positions pos0 .. pos0+T-1 of `layer`."""
        t = k.shape[0]
        if pos0 + t > self.max_len:
            raise GenerationError(f"KV cache overflow: position {pos0 + t - 1} >= max_len {self.max_len}")
        self.keys[layer][:, pos0:pos0 + t] = k.transpose(1, 0, 2)
        self.values[layer][:, pos0:pos0 + t] = v.transpose(1, 0, 2)

    def advance(self, pos_end: int) -> None:
        self.offset = int(pos_end)

    # ------------------------------------------------------------------ housekeeping
    def trim(self, n: int) -> int:
        """Forget the last n positions (they are overwritten by later writes); returns how many went."""
        n = max(0, min(int(n), self.offset))
        self.offset -= n
        return n

    def reset(self) -> None:
        self.offset = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated (virtual) for all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.max_len * self.head_dim * self.dtype.itemsize

    def resident_bytes(self, rows: int) -> int:
        """Bytes of the pages that rows [0, rows) of every layer, K/V and head touch: what writing
        them makes resident (each of the 2 x layers x kv_heads runs starts on its own page or
        shares one with the previous run)."""
        rows = max(0, min(int(rows), self.max_len))
        if rows == 0:
            return 0
        page = mmap.PAGESIZE
        runs = 2 * self.num_layers * self.num_kv_heads
        run = self.max_len * self.head_dim * self.dtype.itemsize        # one head's rows in one layer
        used = rows * self.head_dim * self.dtype.itemsize
        if run % page == 0:                     # every run starts a page
            return runs * -(-used // page) * page
        starts = np.arange(runs, dtype=np.int64) * run
        first, last = starts // page, (starts + used - 1) // page
        pages = int((last - first + 1).sum()) - int((first[1:] == last[:-1]).sum())   # shared pages once
        return pages * page

    @staticmethod
    def bytes_needed(num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype=np.float32) -> int:
        """Size of a cache before allocating it (for memory estimates)."""
        return 2 * num_layers * num_kv_heads * max_len * head_dim * np.dtype(dtype).itemsize

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"max_len={self.max_len}, offset={self.offset}, nbytes={self.nbytes})")


# ============================================================================ KV types
# The KV cache's element type, chosen per Pipeline / Engine (kv_type=) and on the command line
# (--kv-type). f32 and f16 are the KVCache above; q8 and q4 are the packed, mixed-bit cache
# (mixqrt.kv.packed.PackedKVCache: keys per channel over 64-position blocks, values per position;
# q4: keys 4.875 bits narrowed per 16 positions, values 4.125 bits NF4 after a Hadamard rotation,
# 8-bit scales; q8: both 8 bits; the attention sink, a row's own partial block and the 3 before it
# read in f16;
# the format and arithmetic in mixqrt/kv/ref.py, the measurements in docs/long-context.md).
KV_TYPES = ("f32", "f16", "q8", "q4")
# the Pipeline's, the Engine's and the command line's default: q4, 4.5 bits a value, which at 8k
# and 16k tokens loses less than llama.cpp's q8_0 cache (8.5 bits) and decodes fastest at depth; q8
# (8.5 bits) is the option when long prompts must lose less still (docs/long-context.md)
DEFAULT_KV_TYPE = "q4"
_FLOAT_KV = {"f32": np.float32, "f16": np.float16}
_PACKED_BITS = {"q8": 8, "q4": 4}


def check_kv_type(kv_type, head_dim: int | None = None) -> str:
    """A kv_type name -> the checked name; GenerationError naming the choices. None: the default,
    DEFAULT_KV_TYPE, or with head_dim default_kv_type(head_dim) (f32 where the packed cache does not
    fit the heads): what a Pipeline, an Engine and the command line use."""
    if kv_type is None:
        return DEFAULT_KV_TYPE if head_dim is None else default_kv_type(head_dim)
    name = str(kv_type).strip().lower() if isinstance(kv_type, str) else None
    if name not in KV_TYPES:
        raise GenerationError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    return name


def default_kv_type(head_dim: int) -> str:
    """DEFAULT_KV_TYPE where the packed cache fits the model's heads (head_dim a multiple of 32 up to
    256), else f32."""
    if DEFAULT_KV_TYPE in _PACKED_BITS and (head_dim % 32 or head_dim > 256):
        return "f32"
    return DEFAULT_KV_TYPE


def kv_type_of_dtype(dtype) -> str:
    """np.float32 / np.float16 -> "f32" / "f16" (the dtype= spelling of older callers)."""
    d = np.dtype(dtype)
    for name, t in _FLOAT_KV.items():
        if d == t:
            return name
    raise GenerationError(f"KVCache dtype must be float32 or float16, got {d}")


def make_kv_cache(kv_type, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, windows=None):
    """A cache of `kv_type` for positions 0 .. max_len-1; windows: per-layer sliding window or None
    (a float cache keeps every position of every layer; a packed one keeps a windowed layer's window
    in f16)."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT_KV:
        return KVCache(num_layers, num_kv_heads, head_dim, max_len, _FLOAT_KV[kv_type])
    from mixqrt.kv.packed import PackedKVCache
    return PackedKVCache(num_layers, num_kv_heads, head_dim, max_len, kv_type, windows)


def kv_bytes_per_token(kv_type, num_layers: int, num_kv_heads: int, head_dim: int, windows=None) -> float:
    """Steady-state bytes per cached token, K and V, all layers (a packed cache's windowed layers
    cost nothing past their window)."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT_KV:
        return float(2 * num_layers * num_kv_heads * head_dim * np.dtype(_FLOAT_KV[kv_type]).itemsize)
    from mixqrt.kv import ref
    n = sum(1 for li in range(num_layers) if windows is None or windows[li] is None)
    return float(ref.block_bytes(head_dim, _PACKED_BITS[kv_type]) / ref.G * n * num_kv_heads)


def kv_bits_per_value(kv_type, head_dim: int) -> float:
    """Bits per cached value (scales included) of a packed block, or the float width."""
    kv_type = check_kv_type(kv_type)
    if kv_type in _FLOAT_KV:
        return 8.0 * np.dtype(_FLOAT_KV[kv_type]).itemsize
    from mixqrt.kv import ref
    return 8.0 * ref.block_bytes(head_dim, _PACKED_BITS[kv_type]) / (2 * ref.G * head_dim)
