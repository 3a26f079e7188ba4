"""Products: a weight's kernel arguments (format id, raw bytes, level tables; cached per tensor),
the GEMM tile cache, ``matmul``, ``embed`` and the fused single-token decode layer. They run on the
pool (mixqrt.ops.pool), or on the calling thread under ``local_threads``.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from mixqrt.errors import KernelError
from mixqrt.formats import layout, rotation
from mixqrt.ops import ref as ops_ref
from mixqrt.ops.elementwise import silu_mul
from mixqrt.ops.pool import _ops, _parts
from mixqrt.platform import tuning
from mixqrt.platform.isa import TIERS

_FMT_ID = layout.FMT_ID
_Q3P_DEFAULT = bytes(layout.Q3P_LEVELS.tobytes())


# ----------------------------------------------------------------------------- products
_ARGS_CACHE: dict = {}


def _weight_args(w):
    """-> (fmt id, raw uint8, N, K, q3p levels, q5 lo, q5 step); cached per QTensor (keyed by id,
    validated by the identity of its raw buffer and meta mapping, its format and shape: a QTensor's
    meta is read-only, so replacing it is the only change, and that misses the cache)."""
    if isinstance(w, np.ndarray):
        return _weight_args_uncached(w)
    meta = getattr(w, "meta", None)
    hit = _ARGS_CACHE.get(id(w))
    if hit is not None and hit[0] is w.raw and hit[1] is meta and hit[2] == w.fmt and hit[3] == w.shape:
        return hit[4]
    args = _weight_args_uncached(w)
    if len(_ARGS_CACHE) > 4096:
        _ARGS_CACHE.clear()
    _ARGS_CACHE[id(w)] = (w.raw, meta, w.fmt, w.shape, args)
    return args


def _q3p_levels(lv) -> bytes:
    """A q3p level table from a tensor's meta, checked as the kernels need it (layout.q3p_table)."""
    return layout.q3p_table(lv, KernelError).tobytes()


def _weight_args_uncached(w):
    if isinstance(w, np.ndarray):
        if w.ndim != 2:
            raise KernelError(f"matmul: weight must be [N, K], got shape {w.shape}")
        if w.dtype == np.float32:
            fid = _FMT_ID["f32"]
        elif w.dtype == np.float16:
            fid = _FMT_ID["f16"]
        else:
            w = w.astype(np.float32)
            fid = _FMT_ID["f32"]
        w = np.ascontiguousarray(w)
        return fid, w.reshape(-1).view(np.uint8), w.shape[0], w.shape[1], None, 0.0, 0.0
    fmt = w.fmt
    fid = _FMT_ID.get(fmt)
    if fid is None:
        raise KernelError(f"matmul: no kernel for format {fmt!r}")
    n, k = layout.rows_cols(w.shape)
    raw = w.raw
    lo = step = 0.0
    lv = None
    meta = getattr(w, "meta", None) or {}
    if fmt in ("q3p", "q3x"):
        lv = meta.get("q3p_levels")
        lv = _Q3P_DEFAULT if lv is None else _q3p_levels(lv)
    elif fmt == "q5g":
        lo32, hi32 = np.frombuffer(raw[-8:].tobytes(), dtype="<f4")
        lo, step = float(lo32), float((hi32 - lo32) / np.float32(31))
    return fid, raw, n, k, lv, lo, step


# ----------------------------------------------------------------------------- GEMM tile cache
class _TileCache:
    """Unpacked GEMM tiles per packed weight (set_gemm_cache): id(weight) -> (raw, tiles, weakref).
    An entry is checked against the identity of the weight's raw buffer and dropped (its bytes
    returned to the budget) when the weight is garbage-collected, so a model loaded after another
    one gets the room back. An RLock: that drop can run from the garbage collector inside a
    locked section of the same thread."""

    def __init__(self):
        self.budget = 0
        self.used = 0
        self.tiles: dict = {}
        self.lock = threading.RLock()

    def drop(self, key, ref) -> None:
        with self.lock:
            e = self.tiles.get(key)
            if e is not None and e[2] is ref:
                del self.tiles[key]
                self.used -= e[1].nbytes


_TILES = _TileCache()
_N_PACKED = layout.NPACKED                    # format ids below this are packed (the kernels' numbering)
_AVX512 = TIERS.index("avx512")              # the only tier whose GEMM reads tiles


def set_gemm_cache(nbytes: int | None) -> int:
    """Memory (bytes) the batched products may spend on cached GEMM tiles; 0 or None turns the cache
    off and frees it. Returns the previous budget.

    A product with T >= 2 rows (batched decode, prefill) on the AVX-512 tier unpacks the packed
    weight into VNNI-interleaved u8 tiles on every call; with a budget, the first such product of a
    tensor stores its tiles (about 1.25 bytes per weight: 2.9x a q3p tensor, 1.5x a q6 one) and the
    later ones read them instead, bit-identical. It trades memory for the batched step's unpack
    time (docs/kernels.md, "GEMM tile cache"); tensors are cached first come, first served, until
    the budget is spent. Single-sequence decode (T = 1) never reads the tiles. Other tiers: no-op."""
    nb = 0 if nbytes is None else nbytes
    if isinstance(nb, bool) or not isinstance(nb, (int, np.integer)) or nb < 0:
        raise KernelError(f"gemm cache must be a byte count >= 0 (or None), got {nbytes!r}")
    with _TILES.lock:
        before = _TILES.budget
        _TILES.budget = int(nb)
        if not nb:
            _TILES.tiles.clear()
            _TILES.used = 0
    return before


def gemm_cache_info() -> dict:
    """{"budget": bytes, "used": bytes, "tensors": count} of the GEMM tile cache."""
    with _TILES.lock:
        return {"budget": _TILES.budget, "used": _TILES.used, "tensors": len(_TILES.tiles)}


def _gemm_tiles(w, fid, raw, n, k, lv, lo, step):
    """The cached tiles of packed weight w (built on first use within the budget) or None."""
    c = _TILES
    hit = c.tiles.get(id(w))
    if hit is not None and hit[0] is raw:
        return hit[1]
    if isinstance(w, np.ndarray) or fid >= _N_PACKED or _ops.get_isa() < _AVX512:
        return None
    nb = _ops.gemm_tiles_bytes(fid, n, k)
    with c.lock:
        stale = c.tiles.pop(id(w), None)        # id reused by a new weight, or its raw replaced
        if stale is not None:
            c.used -= stale[1].nbytes
        if not c.budget or c.used + nb > c.budget:
            return None
        buf = np.empty(nb + 64, dtype=np.uint8)
        off = (-buf.ctypes.data) % 64
        t = buf[off:off + nb]
        if not _ops.gemm_tiles(fid, raw, n, k, t, lv, lo, step):
            return None
        key = id(w)
        ref = weakref.ref(w, lambda r, key=key: c.drop(key, r))
        c.tiles[key] = (raw, t, ref)
        c.used += nb
    return t


# matmul(..., then=W2) on a single row (decode): the pool's workers read the first this-many bytes of
# W2 while the caller does the work between the two products (docs/lab/kernels-interleaved.md, "Gap prefetch").
# 0 turns it off; MIXQRT_GAP_PF sets it for a process (mixqrt.platform.tuning).
GAP_PREFETCH_BYTES = tuning.value("MIXQRT_GAP_PF")


def set_decode_chunk(nbytes: int | None = None) -> int:
    """Decode products (one row of x) go to the pool in chunks of about nbytes of weight rows, taken by
    the threads in turn (default 256 KiB, MIXQRT_DECODE_CHUNK); 0 = one static part per thread. Products
    on at most set_decode_static_threads() threads (default 2) are split statically anyway. The
    results do not change. None only queries; returns the previous value."""
    return _ops.set_decode_chunk(nbytes) if _ops is not None else 0


def set_decode_static_threads(n: int | None = None) -> int:
    """Decode products on at most n threads (default 2, MIXQRT_DECODE_STATIC_THREADS) take one static
    part per thread; set_decode_chunk's chunks apply above it (0: at any thread count). The results do
    not change. None only queries; returns the previous value."""
    return _ops.set_decode_static_threads(n) if _ops is not None else 0


def prefetch_wait() -> None:
    """Stop a running gap prefetch (matmul's then=) and drop its reference to the weight it reads."""
    if _ops is not None:
        _ops.prefetch_wait()


def matmul(w, x, out=None, then=None, silu: bool = False):
    """y = x @ W^T. w: QTensor or float array [N, K]; x: [K] or [T, K] -> [N] or [T, N] float32.
    Runs on the pool (or this thread: local_threads). then: the weight the caller multiplies next; for
    a single row (decode) the pool's idle workers start reading it (GAP_PREFETCH_BYTES) once this
    product is done. silu: x is a fused gate-up output [..., 2K] and the product takes
    silu_mul(x[..., :K], x[..., K:]); for a packed weight made row by row inside the call (the same
    bits, without the [T, K] activations in memory)."""
    if silu:
        k2 = np.shape(x)[-1] if np.ndim(x) else -1
        if k2 % 2:
            raise KernelError(f"matmul: silu wants [gate | up] rows of even length, got shape {np.shape(x)}")
        if k2 // 2 != np.shape(w)[-1]:
            raise KernelError(f"matmul: silu wants x [T, 2K] for a weight [N, K], got {np.shape(x)} for {tuple(np.shape(w))}")
        if _ops is None or _weight_args(w)[0] >= _N_PACKED or np.ndim(x) not in (1, 2):
            x = np.asarray(x, dtype=np.float32)
            return matmul(w, silu_mul(x[..., :k2 // 2], x[..., k2 // 2:]), out, then)
    if _ops is None:
        return ops_ref.matmul(w, x)
    fid, raw, n, k, lv, lo, step = _weight_args(w)
    x = np.asarray(x, dtype=np.float32)
    vec = x.ndim == 1
    x2 = x.reshape(1, -1) if vec else x
    if x2.ndim != 2 or x2.shape[1] != (2 * k if silu else k):
        raise KernelError(f"matmul: x has shape {x.shape}, weight is [{n}, {k}]" + (" (silu: [T, 2K])" if silu else ""))
    if not x2.flags.c_contiguous:
        x2 = np.ascontiguousarray(x2)
    if out is None:
        y = np.empty((x2.shape[0], n), dtype=np.float32)
    else:
        y = out.reshape(1, n) if vec else out
    rot = _rot(w, k)                         # checks a rotation record before anything is built
    tiles = _gemm_tiles(w, fid, raw, n, k, lv, lo, step) if _TILES.budget and x2.shape[0] >= 2 else None
    nxt = None
    if then is not None and x2.shape[0] == 1 and GAP_PREFETCH_BYTES:
        nxt = _weight_args(then)[1]
    if rot is None:
        _ops.matmul(fid, raw, n, k, x2, y, lv, lo, step, _parts(), tiles, None, 0, 0.0, nxt, GAP_PREFETCH_BYTES,
                    silu)
    else:                                    # a rotated weight stores W R: the C call feeds it R^T x
        _ops.matmul(fid, raw, n, k, x2, y, lv, lo, step, _parts(), tiles, rot[1], rot[0], rot[2], nxt,
                    GAP_PREFETCH_BYTES, silu)
    return y.reshape(n) if vec else y


def layer_weight(w) -> tuple:
    """(fmt id, raw uint8, N, K, q3p levels, q5 lo, q5 step, rotation (block, signs, scale) or None):
    a weight as matmul hands it to the kernels, for DecodeLayer."""
    fid, raw, n, k, lv, lo, step = _weight_args(w)
    rot = _rot(w, k)
    return fid, raw, n, k, lv, lo, step, (None if rot is None else (rot[0], rot[1], rot[2]))


# One token through a layer in one native call (DecodeLayer) instead of ~14 ops from Python: the same
# kernels in the same order, bit-identical. MIXQRT_FUSED_DECODE=0 (or this attribute) turns it off.
FUSED_DECODE = tuning.value("MIXQRT_FUSED_DECODE") == 1


def decode_layer(weights, in_norm, post_norm, qkv_bias, o_bias, eps, theta, hq, hkv, dh, nxt=None):
    """A fused single-token layer (see _ops.DecodeLayer): weights = (qkv, o_proj, gate_up, down) as
    QTensors or float arrays, nxt the weight multiplied after down (gap prefetch), or None."""
    if _ops is None:
        raise KernelError("fused decode layers need the compiled kernels")
    f32 = [None if v is None else np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
           for v in (in_norm, post_norm, qkv_bias, o_bias)]
    try:
        return _ops.DecodeLayer([layer_weight(w) for w in weights], *f32, float(eps), float(theta),
                                int(hq), int(hkv), int(dh), None if nxt is None else layer_weight(nxt))
    except ValueError as e:
        raise KernelError(str(e)) from None


def run_decode_layers(layers, x, keys, values, pos: int, blocks=None, bits: int = 0) -> np.ndarray:
    """x [1, D] float32 through the fused layers at position pos; keys[i], values[i]: layer i's float32
    cache [Hkv, S, Dh] (position pos is written), or with bits 4 | 8 a packed cache's float16 stores
    and blocks[i] its packed blocks (mixqrt.kv). x is updated in place and returned."""
    if not layers:
        return x
    l0 = layers[0]
    work = np.empty(_ops.DecodeLayer.work_floats(l0.D, l0.nqkv, l0.Hq, l0.Dh, max(L.inter for L in layers)),
                    dtype=np.float32)
    xr = x.reshape(-1)
    parts, pf = _parts(), GAP_PREFETCH_BYTES
    if bits:
        for L, kc, vc, pk in zip(layers, keys, values, blocks):
            L.run(xr, kc, vc, pos, work, parts, pf, pk, bits)
        return x
    for L, kc, vc in zip(layers, keys, values):
        L.run(xr, kc, vc, pos, work, parts, pf)
    return x


def embed(w, ids) -> np.ndarray:
    """Rows `ids` of the table w ([V, D]) as float32 [T, D]."""
    ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    if _ops is None:
        return ops_ref.embed(w, ids)
    if isinstance(w, np.ndarray):
        return np.asarray(w[ids], dtype=np.float32)
    fid, raw, n, k, lv, lo, step = _weight_args(w)
    out = np.empty((ids.shape[0], k), dtype=np.float32)
    out = _ops.dequant_rows(fid, raw, n, k, ids, out, lv, lo, step)
    rot = _rot(w, k)
    if rot is not None:                      # stored rows are rotated: s * H_b row
        _ops.hadamard(out, out, None, rot[0], rot[2])
        out *= rot[1]
    return out


_ROT_CACHE: dict = {}


def _rot(w, k: int):
    """(block, signs, scale) of a rotated tensor (meta["rot"], mixqrt.formats.rotation), else None;
    checked once per (block, seed, K)."""
    meta = getattr(w, "meta", None)
    r = meta.get("rot") if meta else None
    if r is None:
        return None
    key = (r.get("block"), r.get("seed"), k) if hasattr(r, "get") else None
    hit = _ROT_CACHE.get(key) if key is not None and all(isinstance(v, int) for v in key) else None
    if hit is None:
        b, seed = rotation.check(r, k, "matmul: weight rotation")
        hit = (b, rotation.signs(seed, k), float(rotation.scale(b)))
        if len(_ROT_CACHE) > 256:
            _ROT_CACHE.clear()
        _ROT_CACHE[(b, seed, k)] = hit
    return hit


