"""Public ops used by the model graph. Signatures are those of mixqrt.ops_ref (the numpy spec);
the C kernels of mixqrt._kernels._ops do the work, on a native thread pool (started on first use,
``set_num_threads`` / ``get_num_threads``; MIXQRT_NUM_THREADS overrides the default,
platform.topology.usable_cpus: the affinity set capped by the cgroup CPU quota). A thread can keep
its ops off the pool with ``local_threads(1)`` (the core-slicing scheduler's stage threads do).

Extras over the reference: ``out=`` on the hot ops, ``softmax(fast=...)`` and f16 KV caches in
``attention``.
"""
from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from mixqrt import ops_ref
from mixqrt.platform import tuning
from mixqrt.errors import KernelError, MixqrtError
from mixqrt.platform.isa import TIERS
from mixqrt.ops_ref import rope_cos_sin  # noqa: F401  (re-exported)
from mixqrt.formats import layout, rotation
from mixqrt.platform import topology

try:
    from mixqrt._kernels import _ops
except ImportError:  # not built: everything falls back to numpy
    _ops = None
if _ops is not None:
    tuning.push(_ops)   # the C-side MIXQRT_* switches (mixqrt.platform.tuning), once

_FMT_ID = layout.FMT_ID
_Q3P_DEFAULT = bytes(layout.Q3P_LEVELS.tobytes())
# attention runs in C for any number of query rows when head_dim is a multiple of 16 (up to 256):
# prefill rows split over the pool by query position, each row computed exactly as the single-token
# decode at its position, so the result does not depend on the thread count or the tier. Other
# head sizes take BLAS products (numpy) above this many query rows (docs/lab/kernels-prefill.md, "Prefill on the pool")
ATTN_C_MAX_T = 8


# ----------------------------------------------------------------------------- threads
def default_num_threads() -> int:
    """MIXQRT_NUM_THREADS if set (mixqrt.platform.tuning), else platform.topology.usable_cpus() (the one
    CPU-count policy)."""
    n = tuning.value("MIXQRT_NUM_THREADS")
    return n if n is not None else topology.usable_cpus()


_blas_limiter = None


def _limit_blas(n: int) -> None:
    """Keep numpy's BLAS single-threaded while mixqrt's pool owns the cores (threadpoolctl)."""
    global _blas_limiter
    if n <= 1:
        if _blas_limiter is not None:
            _blas_limiter.restore_original_limits()
            _blas_limiter = None
        return
    if _blas_limiter is not None:
        return
    try:
        from threadpoolctl import threadpool_limits
        _blas_limiter = threadpool_limits(limits=1, user_api="blas")
    except Exception:  # threadpoolctl missing or no BLAS found: nothing to limit
        _blas_limiter = None


def _worker_order() -> list[int]:
    """Every allowed CPU in the pool's pinning order (platform.affinity.worker_cpus: compact over
    NUMA nodes, one thread per core before SMT siblings); worker i runs on the i-th."""
    from mixqrt.platform import affinity
    allowed = topology.allowed_cpus()
    try:
        topo = topology.topology()
    except MixqrtError:          # an unreadable sysfs must not stop the kernels: plain CPU order
        topo = None
    return affinity.worker_cpus(len(allowed), topo, allowed)


def set_num_threads(n: int) -> int:
    """Restart the native pool with n threads (the calling thread counts as one); returns n."""
    n = int(n)
    if n < 1:
        raise KernelError(f"set_num_threads: need at least 1 thread, got {n}")
    if _ops is None:
        return 1
    global _pool_started
    if _pool_started and _ops.pool_size() == n:
        return n             # already running with n threads (Pipeline and Engine may both ask)
    got = _ops.pool_start(n, _worker_order())
    _pool_started = True
    _limit_blas(got)
    return got


_pool_started = False


def _start_pool() -> None:
    """Importing ops starts nothing: the pool starts on the first op that uses it."""
    if not _pool_started and _ops is not None:
        set_num_threads(default_num_threads())


def get_num_threads() -> int:
    _start_pool()
    return _ops.pool_size() if _ops is not None else 1


_local = threading.local()


class local_threads:
    """Pool parts for the ops the *calling thread* runs: 1 = on this thread only, the pool untouched
    (the GIL is released, so several Python threads can run products at once); n = at most n pool
    parts; None = the whole pool (the default). ``ops.local_threads(1)`` sets it for the rest of the
    thread; ``with ops.local_threads(1):`` restores the previous setting on exit."""

    def __init__(self, n: int | None):
        self._before = getattr(_local, "parts", 0)
        _local.parts = _threads(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _local.parts = self._before
        return False


def _parts() -> int:
    """This thread's pool parts (0: the whole pool); starts the pool when it will be used."""
    p = getattr(_local, "parts", 0)
    if p != 1 and not _pool_started:
        _start_pool()
    return p


class hot:
    """Hot mode of the pool: idle workers spin instead of futex-sleeping between jobs, so the ~100
    products of a decode step pay no wake-up each. ``ops.hot(True)`` switches it on (``False`` off);
    also a context manager (``with ops.hot():``) restoring the previous state. It burns the pool's
    cores while on: use it around a generation loop, not for an idle process."""

    def __init__(self, on: bool = True):
        self._before = is_hot()
        if _ops is not None:
            _ops.set_hot(bool(on))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if _ops is not None:
            _ops.set_hot(self._before)
        return False


def is_hot() -> bool:
    return bool(_ops.get_hot()) if _ops is not None else False


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


def run_decode_layers(layers, x, keys, values, pos: int) -> np.ndarray:
    """x [1, D] float32 through the fused layers at position pos; keys[i], values[i]: layer i's float32
    cache [Hkv, S, Dh] (position pos is written). x is updated in place and returned."""
    if not layers:
        return x
    l0 = layers[0]
    work = np.empty(_ops.DecodeLayer.work_floats(l0.D, l0.nqkv, l0.Hq, l0.Dh, max(L.inter for L in layers)),
                    dtype=np.float32)
    xr = x.reshape(-1)
    parts, pf = _parts(), GAP_PREFETCH_BYTES
    for L, kc, vc in zip(layers, keys, values):
        L.run(xr, kc, vc, pos, work, parts, pf)
    return x


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


def _threads(threads) -> int:
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise KernelError(f"threads must be an int >= 1 (or None for the whole pool), got {threads!r}")
    return int(threads)


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


# ----------------------------------------------------------------------------- float ops
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
    and in ops_ref (float32 in one fixed summation order, no FMA contraction), so the experts a token is
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
    hq, dh, hkv = q.shape[1], q.shape[2], k_cache.shape[0]
    g = hq // hkv
    scale = np.float32(1.0 / np.sqrt(dh))
    for s0 in range(0, t, 128):
        s1 = min(t, s0 + 128)
        p = pos0 + np.arange(s0, s1)                                    # the block's positions
        lo, hi = max(0, int(p[0]) - window + 1), int(p[-1]) + 1
        kp = np.arange(lo, hi)
        mask = (kp[None, :] > p[:, None]) | (kp[None, :] <= p[:, None] - window)     # [b, keys]
        for h in range(hkv):
            kh = np.asarray(k_cache[h, lo:hi], dtype=np.float32)
            vh = np.asarray(v_cache[h, lo:hi], dtype=np.float32)
            qh = q[s0:s1, h * g:(h + 1) * g].transpose(1, 0, 2)          # [g, b, Dh]
            sc = (qh @ kh.T) * scale                                    # [g, b, keys]
            sc[:, mask] = -np.inf
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(axis=-1, keepdims=True)
            out[s0:s1, h * g:(h + 1) * g] = (sc @ vh).transpose(1, 0, 2)
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


def probe_bytes(nbytes: int) -> int:
    """The probe's buffer: ``nbytes``, but at least 4x the machine's last-level cache
    (:func:`platform.topology.llc_bytes`), so that it reads memory, not the cache."""
    return max(int(nbytes), 4 * topology.llc_bytes())


def read_bandwidth(nbytes: int = 1 << 28, threads: int = 1, reps: int = 3) -> float:
    """Measured read bandwidth, bytes/s: the best of every read pattern of the C probe
    (:func:`read_bandwidth_patterns` reports each), over :func:`probe_bytes` (nbytes) bytes."""
    _ops.bw_set_cpus(_worker_order())      # the cores the pool's workers use, in their order
    return _ops.read_bandwidth(probe_bytes(nbytes), int(threads), int(reps))


def read_bandwidth_patterns(nbytes: int = 1 << 28, threads: int = 1, reps: int = 3) -> dict[str, float]:
    """Bytes/s per read pattern of the probe (one stream, several prefetched streams, AVX2 /
    AVX-512 wide and non-temporal loads where the CPU has them; hugepage-advised buffer at least 4x
    the last-level cache, threads pinned in the pool's order)."""
    _ops.bw_set_cpus(_worker_order())
    return _ops.read_bandwidth_all(probe_bytes(nbytes), int(threads), int(reps))


if _ops is None:  # kernels not built: the numpy reference serves every op
    rmsnorm, silu_mul, attention = ops_ref.rmsnorm, ops_ref.silu_mul, ops_ref.attention  # noqa: F811
    rope, softmax = ops_ref.rope, ops_ref.softmax  # noqa: F811
