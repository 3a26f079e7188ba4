"""Kernels of mixqrt.ops: products from packed weights, activation quantization, the thread pool,
the bandwidth probe and the float ops of a layer. Thin wrappers: check shapes and dtypes, release
the GIL, run on the native pool. Declarations: _ops.pxd; C sources: src/ops/."""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
from libc.math cimport NAN
from mixqrt._kernels.cpu cimport mq_isa_get, mq_isa_set
from mixqrt._kernels.format cimport (MQ_FORMATS, MQ_NFMT, MQ_NPACKED, MQ_CHUNK, MQ_Q3P, MQ_Q3P_NLEVELS,
                                     MQ_Q3P_LEVEL_MAX, MQ_Q3X, MQ_XROWS, mq_row_bytes, mq_x_base)

cnp.import_array()


def set_isa(int isa):
    return mq_isa_set(isa)


def get_isa():
    return mq_isa_get()


cdef inline void* _ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


cdef void _mm_task(void *arg, int64_t i0, int64_t i1) noexcept nogil:
    mq_mm_rows(<const mq_mm_job*>arg, <int>i0, <int>i1)


cdef struct _qa_arg:
    const float *x
    size_t ldx
    mq_act *a
    int rot             # rotated weight: each row of x is rotated first (mq_hadamard)
    const float *rs     # its signs [K] (NULL: none)
    int rb              # its block
    float rscale
    int K
    int silu            # x's rows are [gate | up] (2K floats): the product's row is silu(gate) * up

cdef void _qa_task(void *arg, int64_t i0, int64_t i1) noexcept nogil:
    """Rows [i0, i1) of x quantized into a. A row that needs work first (silu(gate) * up of a fused
    gate-up row, a rotation) is made in this thread's scratch row and quantized from there (ldx 0):
    a prompt's activations or rotated rows are never all written out (a packed product reads only the
    quantized rows)."""
    cdef _qa_arg *p = <_qa_arg*>arg
    cdef float *row
    cdef const float *xt
    cdef int64_t t
    cdef int c
    if not p.rot and not p.silu:
        mq_quantize_act_rows(p.x, p.ldx, p.a, <int>i0, <int>i1)
        return
    row = <float*>mq_scratch(<size_t>p.K * 4)
    if row == NULL:        # no scratch row: NaN scales, so the product is NaN, never a silent wrong value
        for t in range(i0, i1):
            memset(p.a.q + <size_t>t * p.a.kp, 0, <size_t>p.a.kp)
            for c in range(p.a.ncp):
                p.a.d[<size_t>t * p.a.ncp + c] = NAN
                p.a.s[<size_t>t * p.a.ncp + c] = NAN
        return
    for t in range(i0, i1):
        xt = p.x + <size_t>t * p.ldx
        if p.silu:
            mq_silu_mul(xt, xt + p.K, row, <size_t>p.K)
            xt = row
        if p.rot:
            mq_hadamard(xt, row, p.rs, 1, p.K, p.rb, p.rscale)     # in place for a silu row
        mq_quantize_act_rows(row, 0, p.a, <int>t, <int>t + 1)


cdef struct _il_arg:
    const mq_act *a
    int fmt, gt
    uint8_t *out

cdef void _il_task(void *arg, int64_t g0, int64_t g1) noexcept nogil:
    cdef _il_arg *p = <_il_arg*>arg
    mq_gemm_interleave(p.a, p.fmt, p.gt, <int>g0, <int>g1, p.out)


cdef int _padded(int K) noexcept nogil:
    return (K + 127) // 128 * 128


def quantize_act(cnp.ndarray x):
    """x float32 [T, K] C-contiguous -> (q int8 [T, kp], d float32 [T, kp/32], s float32 [T, kp/32]).
    kp = K rounded up to 128; exactly what the products use."""
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("quantize_act wants a C-contiguous float32 [T, K] array")
    cdef int T = x.shape[0], K = x.shape[1], kp = _padded(K)
    q = np.empty((T, kp), np.int8)
    d = np.empty((T, kp // 32), np.float32)
    s = np.empty((T, kp // 32), np.float32)
    cdef mq_act a
    a.q = <int8_t*>_ptr(q); a.d = <float*>_ptr(d); a.s = <float*>_ptr(s)
    a.T = T; a.K = K; a.kp = kp; a.ncp = kp // 32; a.il = NULL; a.il_gt = 0
    cdef const float *px = <const float*>_ptr(x)
    with nogil:
        mq_quantize_act_rows(px, K, &a, 0, T)
    return q, d, s


_gemm_min_t = 8


def set_gemm_min_t(int t):
    """AVX-512 prefill GEMM path for matmuls with T >= t rows of x (t <= 0: off). Returns the old value."""
    global _gemm_min_t
    old = _gemm_min_t
    _gemm_min_t = t
    mq_set_gemm_min_t(t)
    return old


def set_few_t(on=None):
    """AVX-512 products of 2-4 rows (batched decode of 2-4 sequences, short prompt chunks) on the
    interleaved formats (q4x, q6x, q3x) through the decode kernels' unpack, each unpacked step serving
    every row (on, the default; MIXQRT_FEW_T=0 starts a process with it off), or through the GEMM's
    per-call tiles. The same bits either way. on=None only queries. Returns the previous state."""
    return bool(mq_set_few_t(-1 if on is None else (1 if on else 0)))


def set_lean_mv(on=None):
    """AVX-512 decode (T == 1) of q3p / q3u / q6 through the lean fused path (on, the default; the
    environment variable MIXQRT_LEAN_MV=0 starts a process with it off) or the generic unpack path.
    Same integer sums either way; the float accumulation order differs. on=None only queries.
    Returns the previous state."""
    return bool(mq_set_lean_mv(-1 if on is None else (1 if on else 0)))


def set_q6_fold(on=None):
    """AVX-512 decode of q6 with short rows (4 rows <= 4 KB, e.g. K = 896) through mv_q6f, the lean
    q6 unpack with the float work of 4 rows folded into one vector (on, the default: faster end to
    end since the decode prefetch goes to L2, docs/kernels.md) or the unpack path (off;
    MIXQRT_Q6_FOLD=0 starts a process with it off). on=None only queries. Returns the previous state."""
    return bool(mq_set_q6_fold(-1 if on is None else (1 if on else 0)))


cdef size_t _decode_chunk = 256 << 10   # bytes per chunk of a decode product's rows (0: static halves)


def set_decode_chunk(nbytes=None):
    """Decode products (one row of x) are cut in chunks of about `nbytes` of weight rows (whole groups
    of 16 rows, at least one) that the pool's threads take in turn (default 256 KiB); 0 splits them in
    one static part per thread, as are products on at most set_decode_static_threads() threads
    whatever nbytes is. Results do not depend on it. nbytes=None only queries. Returns the previous
    value."""
    global _decode_chunk
    old = _decode_chunk
    if nbytes is not None:
        _decode_chunk = _count(nbytes, "set_decode_chunk: bytes")
    return old


def _count(v, str what):
    """int(v), which must be >= 0 (what: the ValueError's subject)."""
    n = int(v)
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return n


cdef int _decode_static_upto = 2   # decode products on at most this many threads: one static part each


def set_decode_static_threads(n=None):
    """Decode products that run on at most n threads are split in one static part per thread (one
    contiguous stream each) whatever set_decode_chunk says; the chunks taken in turn apply above it.
    Default 2 (at 2 threads the static split decoded 1-7 % faster on the 2356t models, docs/kernels.md;
    the chunks were measured where many threads share small products). 0: chunks at any thread
    count. None only queries. Returns the previous value."""
    global _decode_static_upto
    old = _decode_static_upto
    if n is not None:
        _decode_static_upto = _count(n, "set_decode_static_threads: n")
    return old


cdef inline int _parts_of(int threads) noexcept nogil:
    """Parts a pool job of `threads` (0: the whole pool) runs in."""
    cdef int p = mq_pool_size()
    return threads if 0 < threads < p else p


cdef inline int _decode_chunked(int threads) noexcept nogil:
    """Whether a decode product on `threads` parts (0: the whole pool) is cut in chunks."""
    return _decode_chunk != 0 and _parts_of(threads) > _decode_static_upto


cdef inline int64_t _chunk_units(size_t row_bytes, int threads) noexcept nogil:
    """Chunk of a decode product, in units of 16 rows (0: static split)."""
    if not _decode_chunked(threads) or row_bytes == 0:
        return 0
    cdef size_t u = _decode_chunk // (16 * row_bytes)
    return <int64_t>(u if u > 0 else 1)


cdef inline int _pf_parts(int threads) noexcept nogil:
    """Slices of the gap prefetch of a product on `threads` parts (0: the whole pool): the chunked
    split takes it from its start, the static one from the start of each thread's part."""
    return 1 if _decode_chunked(threads) else _parts_of(threads)


def set_float_mv(on=None):
    """AVX-512 decode (T == 1) of f32/f16/bf16 weights 4 rows at a time with prefetched row streams
    (on; MIXQRT_FLOAT_MV=1 starts a process with it on) or one row at a time (the default, faster
    where measured: docs/kernels.md).
    on=None only queries. Returns the previous state."""
    return bool(mq_set_float_mv(-1 if on is None else (1 if on else 0)))


cdef size_t _row_geometry(int fmt, int K, mq_mm_job *j, str who) except 0:
    """Row bytes of a [*, K] tensor in fmt (mq_format.h); sets j.nc, the chunks per row."""
    if fmt < 0 or fmt >= MQ_NFMT:
        raise ValueError(f"{who}: unknown format id {fmt}")
    if K < 1:
        raise ValueError(f"{who}: K must be positive, got {K}")
    j.nc = 0
    if fmt < MQ_NPACKED:
        j.nc = (K + MQ_FORMATS[fmt].group - 1) // MQ_FORMATS[fmt].group * (MQ_FORMATS[fmt].group // MQ_CHUNK)
    return <size_t>mq_row_bytes(fmt, K)


cdef int _check_height(int fmt, int N, str who) except -1:
    """q4x / q6x / q3x hold whole groups of MQ_XROWS rows (the kernels read a group at a time)."""
    if 0 <= fmt < MQ_NFMT and mq_x_base(fmt) >= 0 and N % MQ_XROWS:
        raise ValueError(f"{who}: a {MQ_FORMATS[fmt].name.decode()} weight has a multiple of {MQ_XROWS} rows, got {N}")
    return 0


cdef const uint8_t *_levels(int fmt, q3p_levels, str who) except? NULL:
    """The q3p level table (always passed by the caller: the table a tensor was quantized with)."""
    if fmt != MQ_Q3P and fmt != MQ_Q3X:
        return NULL
    if not isinstance(q3p_levels, bytes) or len(q3p_levels) != MQ_Q3P_NLEVELS:
        raise ValueError(f"{who}: q3p needs its {MQ_Q3P_NLEVELS}-byte level table, got {q3p_levels!r}")
    if max(q3p_levels) > MQ_Q3P_LEVEL_MAX:
        raise ValueError(f"{who}: q3p levels must be <= {MQ_Q3P_LEVEL_MAX}, got {list(q3p_levels)}")
    return <const uint8_t*><bytes>q3p_levels


def gemm_tiles_bytes(int fmt, int N, int K):
    """Bytes of the cached GEMM tiles of a packed [N, K] tensor (gemm_tiles)."""
    cdef mq_mm_job j
    _row_geometry(fmt, K, &j, "gemm_tiles")
    if fmt >= MQ_NPACKED:
        raise ValueError("gemm_tiles: float weights have no tiles")
    return <size_t>((N + 15) // 16) * mq_gemm_tile_stride(j.nc)


def gemm_tiles(int fmt, cnp.ndarray raw, int N, int K, cnp.ndarray out, q3p_levels=None,
               float q5_lo=0.0, float q5_step=0.0):
    """Fill `out` (uint8, gemm_tiles_bytes(fmt, N, K) bytes, 64-byte aligned) with the tensor's
    unpacked GEMM tiles; False (nothing written) where this CPU has no AVX-512 tier."""
    cdef mq_mm_job j
    cdef size_t row_bytes = _row_geometry(fmt, K, &j, "gemm_tiles")
    _check_height(fmt, N, "gemm_tiles")
    if fmt >= MQ_NPACKED:
        raise ValueError("gemm_tiles: float weights have no tiles")
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous or <size_t>raw.shape[0] < <size_t>N * row_bytes:
        raise ValueError(f"gemm_tiles: raw must be contiguous uint8 with {N * row_bytes} bytes")
    _check_tiles(out, fmt, N, K, "gemm_tiles")
    if not out.flags.writeable:
        raise ValueError("gemm_tiles: out must be writable")
    j.fmt = fmt; j.w = <const uint8_t*>_ptr(raw); j.row_bytes = row_bytes; j.N = N; j.K = K
    j.q3p_levels = _levels(fmt, q3p_levels, "gemm_tiles"); j.q5_lo = q5_lo; j.q5_step = q5_step
    j.a = NULL; j.x = NULL; j.y = NULL; j.T = 0; j.tiles = NULL
    cdef uint8_t *po = <uint8_t*>_ptr(out)
    cdef int rc
    with nogil:
        rc = mq_gemm_tiles_build(&j, po, 0, N)
    return rc == 0


cdef int _check_tiles(cnp.ndarray t, int fmt, int N, int K, str who) except -1:
    if t.dtype != np.uint8 or t.ndim != 1 or not t.flags.c_contiguous \
            or <size_t>t.shape[0] < gemm_tiles_bytes(fmt, N, K) or (<uintptr_t>_ptr(t)) % 64:
        raise ValueError(f"{who}: tiles must be a 64-byte aligned contiguous uint8 array of "
                         f"{gemm_tiles_bytes(fmt, N, K)} bytes")
    return 0


cdef int _mm_run(mq_mm_job *j, const float *rs, int rb, float rscale, int threads, int silu=0) noexcept nogil:
    """The product of a filled-in job (weight, x, T, y): a packed weight's activations quantized into
    this thread's call buffer first (rotated first when rb > 0: rs signs, rscale), on the pool for
    T > 1; decode (T == 1) in chunks taken in turn above set_decode_static_threads() parts, else (and
    more rows) in one static part per thread; threads == 1 on the calling thread. matmul() and DecodeLayer's products. silu: a packed weight's x rows are
    [gate | up] (ldx >= 2K), the product's rows silu(gate) * up. -1 when no buffer could be had."""
    cdef mq_act a
    cdef _qa_arg qa
    cdef _il_arg ia
    cdef int T = j.T, K = j.K, kp = _padded(K), gt = 0
    cdef size_t abytes, ilbytes = 0
    cdef char *buf = NULL
    if j.fmt < MQ_NPACKED:
        abytes = (<size_t>T * kp + <size_t>T * (kp // 32) * 8 + 63) // 64 * 64
        a.T = T; a.K = K; a.kp = kp; a.ncp = kp // 32; a.il = NULL; a.il_gt = 0
        j.a = &a
        if T > 1 and threads != 1:       # a GEMM on several threads: its activation layout made once
            gt = mq_gemm_shared_gt(j)
            if gt:
                ilbytes = mq_gemm_act_bytes(&a, gt)
        buf = <char*>mq_call_buf(abytes + ilbytes + 64)
        if buf == NULL:
            j.a = NULL
            return -1
        a.q = <int8_t*>buf; a.d = <float*>(buf + <size_t>T * kp); a.s = a.d + <size_t>T * (kp // 32)
        qa.x = j.x; qa.ldx = j.ldx; qa.a = &a; qa.K = K
        qa.rot = rb > 0; qa.rs = rs; qa.rb = rb; qa.rscale = rscale; qa.silu = silu
        if T > 1 and threads != 1:
            mq_pool_run_n(_qa_task, &qa, T, 1, threads)
        else:
            _qa_task(&qa, 0, T)
        if ilbytes:
            ia.a = &a; ia.fmt = j.fmt; ia.gt = gt; ia.out = <uint8_t*>(buf + abytes)
            mq_pool_run_n(_il_task, &ia, (T + gt - 1) // gt, 1, threads)
            a.il = ia.out; a.il_gt = gt
    if threads == 1:
        mq_mm_rows(j, 0, j.N)
    elif T == 1:
        mq_pool_run_chunked(_mm_task, j, j.N, 16, threads, _chunk_units(j.row_bytes, threads))
    else:
        mq_pool_run_n(_mm_task, j, j.N, 64, threads)
    mq_call_buf_release(buf)
    j.a = NULL
    return 0


def matmul(int fmt, cnp.ndarray raw, int N, int K, cnp.ndarray x, cnp.ndarray y,
           q3p_levels=None, float q5_lo=0.0, float q5_step=0.0, int threads=0, cnp.ndarray tiles=None,
           rot_signs=None, int rot_block=0, float rot_scale=0.0, cnp.ndarray then=None, size_t then_bytes=0,
           bint silu=False):
    """y[t, n] = sum_k W[n, k] x[t, k] for packed (or f32/f16/bf16) W [N, K] in `raw`.

    silu (packed W only): x is [T, 2K], a fused gate-up output, and the product takes
    silu(x[t, :K]) * x[t, K:] for row t, made row by row inside the call (the same bits as silu_mul
    then matmul, without writing the [T, K] activations out).

    then: the raw bytes of the weight the caller multiplies next (decode): once this product is done,
    the pool's workers read its first then_bytes in the background (prefetch), while the caller
    does the work in between.

    x: float32 [T, K] C-contiguous; y: float32 [T, N] (rows may be strided, columns contiguous).
    raw: uint8 1-D with at least N * row_bytes bytes. Runs on the native pool without the GIL;
    threads: 0 = the whole pool, 1 = on the calling thread only (pool untouched), n = at most n parts.
    tiles: the tensor's cached GEMM tiles (gemm_tiles), used for T >= 2 on the AVX-512 tier; the
    result is bit-identical to the unpacking path.
    rot_block > 0: a rotated packed weight (stores W R): x's rows go through mq_hadamard (H_b(signs * x),
    scaled by rot_scale) into this call's scratch before the activation quantization, on the pool for
    T > 1; bit-identical to hadamard() then matmul, without a Python call or array per product."""
    cdef mq_mm_job j
    cdef int T
    cdef size_t row_bytes
    cdef const uint8_t *lv
    cdef int kx = 2 * K if silu else K
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != kx or not x.flags.c_contiguous:
        raise ValueError(f"matmul: x must be C-contiguous float32 [T, {kx}], got {x.dtype} {np.shape(x)}")
    if silu and fmt >= MQ_NPACKED:
        raise ValueError("matmul: silu needs a packed weight")
    T = x.shape[0]
    if y.dtype != np.float32 or y.ndim != 2 or y.shape[0] != T or y.shape[1] != N or y.strides[1] != 4 \
            or not y.flags.writeable:
        raise ValueError(f"matmul: out must be a writable float32 [{T}, {N}] array with contiguous rows")
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raise ValueError("matmul: raw must be a contiguous 1-D uint8 array")
    row_bytes = _row_geometry(fmt, K, &j, "matmul")
    _check_height(fmt, N, "matmul")
    if <size_t>raw.shape[0] < <size_t>N * row_bytes:
        raise ValueError(f"matmul: raw holds {raw.shape[0]} bytes, [{N}, {K}] needs {N * row_bytes}")
    lv = _levels(fmt, q3p_levels, "matmul")
    j.fmt = fmt; j.w = <const uint8_t*>_ptr(raw); j.row_bytes = row_bytes; j.N = N; j.K = K
    j.x = <const float*>_ptr(x); j.T = T; j.ldx = kx
    j.y = <float*>_ptr(y); j.ldy = <size_t>(y.strides[0] // 4)
    j.q3p_levels = lv; j.q5_lo = q5_lo; j.q5_step = q5_step
    j.a = NULL; j.tiles = NULL
    if tiles is not None and fmt < MQ_NPACKED:
        _check_tiles(tiles, fmt, N, K, "matmul")
        j.tiles = <const uint8_t*>_ptr(tiles)
    if T == 0 or N == 0:
        return y
    cdef const float *rs = NULL
    cdef cnp.ndarray sa
    cdef int rc
    if rot_block:
        if fmt >= MQ_NPACKED:
            raise ValueError("matmul: a rotation needs a packed weight")
        if rot_signs is None:
            raise ValueError("matmul: a rotation needs its signs")
        sa = rot_signs                        # a reference: the signs outlive the nogil section
        rs = _rot_args(K, rot_block, sa, "matmul")
    with nogil:
        rc = _mm_run(&j, rs, rot_block, rot_scale, threads, silu)
    if rc:
        raise MemoryError()
    if then is not None and threads != 1:
        prefetch(then, then_bytes, _pf_parts(threads))
    return y


def dequant_rows(int fmt, cnp.ndarray raw, int N, int K, cnp.ndarray ids, cnp.ndarray out,
                 q3p_levels=None, float q5_lo=0.0, float q5_step=0.0):
    """out[i] = row ids[i] of W dequantized (w = d*L + m in float32). ids int64 1-D; out float32 [len, K]."""
    cdef mq_mm_job j
    cdef int i, n = ids.shape[0]
    cdef size_t row_bytes
    cdef const uint8_t *lv
    if ids.dtype != np.int64 or ids.ndim != 1 or not ids.flags.c_contiguous:
        raise ValueError("dequant_rows: ids must be contiguous int64")
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[0] != n or out.shape[1] != K or not out.flags.c_contiguous:
        raise ValueError("dequant_rows: out must be C-contiguous float32 [len(ids), K]")
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raise ValueError("dequant_rows: raw must be a contiguous 1-D uint8 array")
    row_bytes = _row_geometry(fmt, K, &j, "dequant_rows")
    _check_height(fmt, N, "dequant_rows")
    if <size_t>raw.shape[0] < <size_t>N * row_bytes:
        raise ValueError(f"dequant_rows: raw holds {raw.shape[0]} bytes, [{N}, {K}] needs {N * row_bytes}")
    lv = _levels(fmt, q3p_levels, "dequant_rows")
    cdef const int64_t *pi = <const int64_t*>_ptr(ids)
    for i in range(n):
        if pi[i] < 0 or pi[i] >= N:
            raise IndexError(f"token id {pi[i]} out of range [0, {N})")
    cdef const uint8_t *pw = <const uint8_t*>_ptr(raw)
    cdef float *po = <float*>_ptr(out)
    with nogil:
        for i in range(n):
            mq_dequant_row_at(fmt, pw, pi[i], row_bytes, K, po + <size_t>i * K, lv, q5_lo, q5_step)
    return out


# ------------------------------------------------------------------ pool and bandwidth
def pool_start(int n, cpus=()):
    """(Re)start the pool with n threads (caller included), pinning thread i to cpus[i % len]."""
    cdef int nc = len(cpus), i, r
    cdef int *c = <int*>malloc(sizeof(int) * (nc + 1))
    for i in range(nc):
        c[i] = int(cpus[i])
    with nogil:
        r = mq_pool_start(n, c, nc)
    free(c)
    return r


def pool_size():
    return mq_pool_size()


def set_hot(bint hot):
    """Hot mode: idle pool workers spin instead of sleeping (no futex wake-up per job)."""
    mq_pool_set_hot(hot)


def get_hot():
    return bool(mq_pool_get_hot())


_pf_keep = None      # the array a gap prefetch reads: referenced until the next one (an mmap stays open)


def prefetch(cnp.ndarray raw, size_t nbytes, int parts=0):
    """Gap prefetch: the pool's workers read the first `nbytes` of `raw` (uint8, contiguous) in the
    background, the starts of its `parts` equal slices first (0: one per pool thread, the split of
    a decode product); the next pool job aborts it. Returns at once. A no-op with one thread."""
    global _pf_keep
    if parts <= 0:
        parts = mq_pool_size()
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raise ValueError("prefetch: raw must be a contiguous 1-D uint8 array")
    if nbytes > <size_t>raw.shape[0]:
        nbytes = <size_t>raw.shape[0]
    # wait, swap the reference and post with the GIL held (the workers never take it; the wait is an
    # abort within 4 KiB): another Python thread cannot post in between and have its array let go
    # while the workers read it
    mq_pool_prefetch_wait()
    _pf_keep = raw
    mq_pool_prefetch(<const uint8_t*>_ptr(raw), nbytes, parts)


def prefetch_wait():
    """Stop a running gap prefetch, wait for it and drop its array (a closed model's mapping can go)."""
    global _pf_keep
    mq_pool_prefetch_wait()
    _pf_keep = None


def pool_stop():
    with nogil:
        mq_pool_stop()


def read_bandwidth(size_t nbytes=1 << 28, int threads=1, int reps=3):
    """Read bandwidth in bytes/s: the best of every probe pattern this CPU runs (src/ops/bw.c)."""
    cdef double r
    with nogil:
        r = mq_read_bandwidth(nbytes, threads, reps)
    return r


def bw_set_cpus(cpus):
    """Pin the probe's thread i to cpus[i % len(cpus)] (at most 64 kept); empty: the affinity mask
    in CPU order."""
    cdef int buf[64]
    cdef int n = 0
    for c in list(cpus)[:64]:
        buf[n] = int(c)
        n += 1
    return mq_bw_set_cpus(buf, n)


def bw_patterns():
    """Names of the probe's read patterns this CPU can run, in probe order."""
    return [mq_bw_pattern_name(i).decode() for i in range(mq_bw_npatterns()) if mq_bw_pattern_available(i)]


def read_bandwidth_all(size_t nbytes=1 << 28, int threads=1, int reps=3):
    """{pattern: bytes/s} for every probe pattern this CPU runs, all on one buffer."""
    cdef int n = mq_bw_npatterns(), i
    cdef double *out = <double*>malloc(sizeof(double) * n)
    if out == NULL:
        raise MemoryError()
    with nogil:
        mq_read_bandwidth_all(nbytes, threads, reps, out)
    r = {mq_bw_pattern_name(i).decode(): out[i] for i in range(n) if mq_bw_pattern_available(i)}
    free(out)
    return r


def read_bandwidth_pattern(str name, size_t nbytes=1 << 28, int threads=1, int reps=3):
    """Read bandwidth in bytes/s of one probe pattern (see bw_patterns)."""
    cdef int i, idx = -1
    cdef double r
    for i in range(mq_bw_npatterns()):
        if mq_bw_pattern_name(i).decode() == name and mq_bw_pattern_available(i):
            idx = i
    if idx < 0:
        raise ValueError(f"unknown or unavailable bandwidth pattern {name!r}; have {bw_patterns()}")
    with nogil:
        r = mq_read_bandwidth_pattern(nbytes, threads, reps, idx)
    return r


# ------------------------------------------------------------------ float ops
cdef _f32c(cnp.ndarray a, str name):
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous float32, got {a.dtype}")


def rmsnorm(cnp.ndarray x, cnp.ndarray w, float eps, cnp.ndarray out, int threads=0):
    _f32c(x, "x"); _f32c(w, "weight"); _f32c(out, "out")
    cdef int D = x.shape[x.ndim - 1]
    cdef int T = x.size // D if D else 0
    if w.size != D or out.size != x.size:
        raise ValueError(f"rmsnorm: weight has {w.size} values for rows of {D}")
    cdef _norm_arg a
    a.x = <const float*>_ptr(x); a.w = <const float*>_ptr(w); a.y = <float*>_ptr(out); a.D = D; a.eps = eps
    with nogil:
        _rows_run(_norm_task, &a, T, D, threads)
    return out


cdef const float *_rot_args(int K, int block, signs, str who) except? NULL:
    """The checks of a block Hadamard rotation of rows of K values (block a power of two <= 1024
    dividing K; signs None or float32 [K]): the signs' pointer, NULL for None. The caller keeps a
    reference to signs while the pointer is used."""
    if block < 1 or block > 1024 or block & (block - 1) or K == 0 or K % block:
        raise ValueError(f"{who}: rows of {K} values do not split into blocks of {block} (a power of two <= 1024)")
    if signs is None:
        return NULL
    cdef cnp.ndarray sa = signs
    _f32c(sa, "signs")
    if sa.size != K:
        raise ValueError(f"{who}: {sa.size} rotation signs for rows of {K}")
    return <const float*>_ptr(sa)


def hadamard(cnp.ndarray x, cnp.ndarray out, signs, int block, float scale):
    """out = H_b (signs * x) on the rows of float32 [T, K] (C-contiguous; out may be x); signs: float32
    [K] or None; block a power of two in [1, 1024] dividing K (the caller's checks, repeated here)."""
    _f32c(x, "x"); _f32c(out, "out")
    cdef int K = x.shape[x.ndim - 1] if x.ndim else 0
    if x.ndim not in (1, 2) or out.size != x.size:
        raise ValueError(f"hadamard: x and out must be the same [K] or [T, K] float32, got {np.shape(x)}, {np.shape(out)}")
    cdef const float *ps = _rot_args(K, block, signs, "hadamard")
    cdef int T = x.size // K
    cdef const float *px = <const float*>_ptr(x)
    cdef float *po = <float*>_ptr(out)
    with nogil:
        mq_hadamard(px, po, ps, T, K, block, scale)
    return out


# element-wise ops on rows (rope, silu_mul, rmsnorm) split their rows over the pool from this many
# values on: below it, one dispatch costs more than the work
cdef size_t ROWS_POOL_MIN = 1 << 16


cdef void _rows_run(mq_task_fn fn, void *arg, int64_t rows, size_t width, int threads) noexcept nogil:
    """fn(arg, r0, r1) over rows [0, rows): on the pool in static parts (at most `threads`, 0: all)
    when the rows hold at least ROWS_POOL_MIN values, else on the calling thread."""
    if rows <= 0:
        return
    if <size_t>rows * width >= ROWS_POOL_MIN and rows > 1:
        mq_pool_run_n(fn, arg, rows, 1, threads)
    else:
        fn(arg, 0, rows)


cdef struct _rope_arg:
    float *x
    const int64_t *pos
    int H, Dh
    double theta

cdef void _rope_task(void *arg, int64_t t0, int64_t t1) noexcept nogil:
    cdef _rope_arg *p = <_rope_arg*>arg
    mq_rope(p.x + <size_t>t0 * p.H * p.Dh, p.pos + t0, <int>(t1 - t0), p.H, p.Dh, p.theta)


cdef struct _silu_arg:
    const char *g
    const char *u
    char *y
    Py_ssize_t sg, su, sy
    size_t n

cdef void _silu_task(void *arg, int64_t t0, int64_t t1) noexcept nogil:
    cdef _silu_arg *p = <_silu_arg*>arg
    cdef int64_t t
    for t in range(t0, t1):
        mq_silu_mul(<const float*>(p.g + t * p.sg), <const float*>(p.u + t * p.su), <float*>(p.y + t * p.sy), p.n)


cdef struct _norm_arg:
    const float *x
    const float *w
    float *y
    int D
    float eps

cdef void _norm_task(void *arg, int64_t t0, int64_t t1) noexcept nogil:
    cdef _norm_arg *p = <_norm_arg*>arg
    mq_rmsnorm(p.x + <size_t>t0 * p.D, p.w, p.y + <size_t>t0 * p.D, <int>(t1 - t0), p.D, p.eps)


def rope_(cnp.ndarray x, cnp.ndarray pos, double theta, int threads=0):
    """In place on x [T, H, Dh]; pos int64 [T]."""
    _f32c(x, "x")
    if x.ndim != 3 or pos.dtype != np.int64 or pos.ndim != 1 or pos.shape[0] != x.shape[0] or x.shape[2] % 2 \
            or x.shape[2] > 1024 or not pos.flags.c_contiguous:
        raise ValueError("rope: x must be [T, H, Dh] (Dh even, <= 1024) and positions int64 [T]")
    cdef _rope_arg a
    a.x = <float*>_ptr(x); a.pos = <const int64_t*>_ptr(pos)
    a.H = x.shape[1]; a.Dh = x.shape[2]; a.theta = theta
    with nogil:
        _rows_run(_rope_task, &a, x.shape[0], <size_t>a.H * a.Dh, threads)
    return x


def silu_mul(cnp.ndarray g, cnp.ndarray u, cnp.ndarray out):
    _f32c(g, "gate"); _f32c(u, "up"); _f32c(out, "out")
    if g.size != u.size or out.size != g.size:
        raise ValueError("silu_mul: gate, up and out must have the same size")
    cdef const float *pg = <const float*>_ptr(g)
    cdef const float *pu = <const float*>_ptr(u)
    cdef float *po = <float*>_ptr(out)
    cdef size_t n = g.size
    with nogil:
        mq_silu_mul(pg, pu, po, n)
    return out


def silu_mul_rows(cnp.ndarray g, cnp.ndarray u, cnp.ndarray out, int threads=0):
    """silu_mul on 2-D float32 [T, n] arrays whose rows are contiguous but may be strided (the two
    halves of a fused gate-up buffer): no copies."""
    if g.ndim != 2 or u.ndim != 2 or out.ndim != 2 or g.dtype != np.float32 or u.dtype != np.float32 \
            or out.dtype != np.float32 or g.shape[0] != u.shape[0] or g.shape[0] != out.shape[0] \
            or g.shape[1] != u.shape[1] or g.shape[1] != out.shape[1] or not out.flags.writeable \
            or (g.shape[1] > 1 and (g.strides[1] != 4 or u.strides[1] != 4 or out.strides[1] != 4)):
        raise ValueError("silu_mul_rows: gate, up, out must be float32 [T, n] with contiguous rows")
    cdef _silu_arg a
    a.g = <const char*>cnp.PyArray_DATA(g); a.u = <const char*>cnp.PyArray_DATA(u)
    a.y = <char*>cnp.PyArray_DATA(out)
    a.sg = g.strides[0]; a.su = u.strides[0]; a.sy = out.strides[0]; a.n = g.shape[1]
    with nogil:
        _rows_run(_silu_task, &a, g.shape[0], a.n, threads)
    return out


cdef struct _smc_arg:
    float *x
    int n, T, pos0

cdef void _smc_task(void *arg, int64_t r0, int64_t r1) noexcept nogil:
    cdef _smc_arg *p = <_smc_arg*>arg
    mq_softmax_causal(p.x, p.n, p.T, p.pos0, <int>r0, <int>r1)


def softmax_causal_(cnp.ndarray x, int T, int pos0, int threads=0):
    """In place on scores x [..., n] (rows = x.size / n): row r is query r % T at position pos0 + r % T;
    softmax over its first min(n, pos0 + r % T + 1) entries, zeros after. Rows run on the pool."""
    _f32c(x, "x")
    if x.ndim < 1 or T < 1 or pos0 < 0:
        raise ValueError("softmax_causal_: bad arguments")
    cdef _smc_arg a
    a.x = <float*>_ptr(x); a.n = x.shape[x.ndim - 1]; a.T = T; a.pos0 = pos0
    cdef int64_t rows = x.size // a.n if a.n else 0
    with nogil:
        mq_pool_run_n(_smc_task, &a, rows, 8, threads)
    return x


def softmax_(cnp.ndarray x, bint fast=True):
    """In place over the last axis."""
    _f32c(x, "x")
    cdef int n = x.shape[x.ndim - 1] if x.ndim else 1
    cdef int rows = x.size // n if n else 0
    cdef float *px = <float*>_ptr(x)
    with nogil:
        mq_softmax_rows(px, rows, n, fast)
    return x


def expf_fast(float v):
    return mq_expf_fast(v)


cdef struct _att_arg:
    const float *q
    const void *k
    const void *v
    int f16, T, Hq, Hkv, Dh, S, pos0
    float *out

cdef void _att_task(void *arg, int64_t h0, int64_t h1) noexcept nogil:
    cdef _att_arg *p = <_att_arg*>arg
    cdef float *scr = <float*>mq_scratch(sizeof(float) * MQ_ATT_SCRATCH(p.S, p.Dh, p.T))
    if scr == NULL:
        return
    mq_attention(p.q, p.k, p.v, p.f16, p.out, p.T, p.Hq, p.Hkv, p.Dh, p.S, p.pos0, <int>h0, <int>h1, scr)


# attention with at least this many query rows (prefill) splits by query position instead of by head
cdef int ATT_ROWS_MIN_T = 16


cdef void _att_rows_task(void *arg, int64_t t0, int64_t t1) noexcept nogil:
    # query positions [t0, t1), every head: each row exactly as a single-query call at pos0 + t
    cdef _att_arg *p = <_att_arg*>arg
    cdef float *scr = <float*>mq_scratch(sizeof(float) * MQ_ATT_SCRATCH(p.S, p.Dh, <int>(t1 - t0)))
    cdef size_t off = <size_t>t0 * p.Hq * p.Dh
    if scr == NULL:
        return
    mq_attention(p.q + off, p.k, p.v, p.f16, p.out + off, <int>(t1 - t0), p.Hq, p.Hkv, p.Dh, p.S,
                 p.pos0 + <int>t0, 0, p.Hq, scr)


cdef struct _attb_arg:
    _att_arg *seq
    int Hq

cdef void _attb_task(void *arg, int64_t i0, int64_t i1) noexcept nogil:
    # items are (sequence, head) pairs in sequence-major order
    cdef _attb_arg *p = <_attb_arg*>arg
    cdef int64_t i = i0, e
    cdef int b, h0
    cdef _att_arg *a
    cdef float *scr
    while i < i1:
        b = <int>(i // p.Hq)
        h0 = <int>(i - <int64_t>b * p.Hq)
        e = min(i1, (<int64_t>b + 1) * p.Hq)
        a = &p.seq[b]
        scr = <float*>mq_scratch(sizeof(float) * MQ_ATT_SCRATCH(a.S, a.Dh, 1))
        if scr == NULL:
            return
        mq_attention(a.q, a.k, a.v, a.f16, a.out, 1, a.Hq, a.Hkv, a.Dh, a.S, a.pos0, h0,
                     <int>(e - <int64_t>b * p.Hq), scr)
        i = e


def attention_batch(cnp.ndarray q, list ks, list vs, positions, cnp.ndarray out, int threads=0):
    """One decode query per sequence on its own cache: q [B,Hq,Dh] f32, ks[b]/vs[b] [Hkv,S_b,Dh] f32|f16,
    positions [B] (query b at positions[b], keys 0..positions[b]), out [B,Hq,Dh]. Every (sequence,
    head) pair is one pool item; each is exactly attention(q[b:b+1], ks[b], vs[b], positions[b])."""
    _f32c(q, "q"); _f32c(out, "out")
    if q.ndim != 3 or out.ndim != 3 or out.shape[0] != q.shape[0] or out.shape[1] != q.shape[1] \
            or out.shape[2] != q.shape[2]:
        raise ValueError("attention_batch: q and out must be [B, Hq, Dh]")
    cdef int B = q.shape[0], Hq = q.shape[1], Dh = q.shape[2], b
    pos = list(positions)
    if len(ks) != B or len(vs) != B or len(pos) != B:
        raise ValueError(f"attention_batch: {B} queries but {len(ks)} key caches, {len(vs)} value caches, "
                         f"{len(pos)} positions")
    cdef cnp.ndarray k, v
    cdef _att_arg *seq = <_att_arg*>malloc(sizeof(_att_arg) * max(B, 1))
    if seq == NULL:
        raise MemoryError()
    cdef _attb_arg arg
    try:
        for b in range(B):
            k = ks[b]; v = vs[b]
            if k.ndim != 3 or v.ndim != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1] \
                    or k.shape[2] != Dh or v.shape[2] != Dh or k.shape[0] < 1 or Hq % k.shape[0] \
                    or k.dtype != v.dtype \
                    or k.dtype not in (np.float32, np.float16) or not k.flags.c_contiguous \
                    or not v.flags.c_contiguous:
                raise ValueError(f"attention_batch: cache {b} is not [Hkv,S,Dh] f32|f16 contiguous with Hq % Hkv == 0")
            if pos[b] < 0 or pos[b] + 1 > k.shape[1]:
                raise ValueError(f"attention_batch: position {pos[b]} of sequence {b} exceeds its cache length {k.shape[1]}")
            seq[b].q = <const float*>_ptr(q) + <size_t>b * Hq * Dh
            seq[b].k = _ptr(k); seq[b].v = _ptr(v); seq[b].f16 = k.dtype == np.float16
            seq[b].T = 1; seq[b].Hq = Hq; seq[b].Hkv = k.shape[0]; seq[b].Dh = Dh; seq[b].S = k.shape[1]
            seq[b].pos0 = <int>pos[b]; seq[b].out = <float*>_ptr(out) + <size_t>b * Hq * Dh
        arg.seq = seq; arg.Hq = Hq
        with nogil:
            mq_pool_run_n(_attb_task, &arg, <int64_t>B * Hq, 1, threads)
    finally:
        free(seq)
    return out


def attention(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, int pos0, cnp.ndarray out, int threads=0):
    """Causal GQA attention; q [T,Hq,Dh] f32, k/v [Hkv,S,Dh] f32 or f16, out [T,Hq,Dh] f32."""
    _f32c(q, "q"); _f32c(out, "out")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1] \
            or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2] or k.shape[0] < 1 \
            or q.shape[1] % k.shape[0] \
            or k.dtype != v.dtype or k.dtype not in (np.float32, np.float16) \
            or not k.flags.c_contiguous or not v.flags.c_contiguous or out.shape[0] != q.shape[0] \
            or out.shape[1] != q.shape[1] or out.shape[2] != q.shape[2]:
        raise ValueError("attention: bad shapes/dtypes: q [T,Hq,Dh], k/v [Hkv,S,Dh] f32|f16 contiguous, Hq % Hkv == 0")
    if pos0 < 0 or pos0 + q.shape[0] > k.shape[1]:
        raise ValueError(f"attention: positions {pos0}..{pos0 + q.shape[0] - 1} exceed the cache length {k.shape[1]}")
    cdef _att_arg a
    a.q = <const float*>_ptr(q); a.k = _ptr(k); a.v = _ptr(v); a.f16 = k.dtype == np.float16
    a.T = q.shape[0]; a.Hq = q.shape[1]; a.Hkv = k.shape[0]; a.Dh = q.shape[2]; a.S = k.shape[1]
    a.pos0 = pos0; a.out = <float*>_ptr(out)
    cdef int np_ = threads if 0 < threads < mq_pool_size() else mq_pool_size()
    with nogil:
        if a.T >= ATT_ROWS_MIN_T and np_ > 1:
            # prefill: chunks of query positions taken in turn (a row's cost grows with its
            # position, so static parts would leave the first thread idle)
            mq_pool_run_chunked(_att_rows_task, &a, a.T, 1, np_, max(1, a.T // (16 * np_)))
        else:
            mq_pool_run_n(_att_task, &a, a.Hq, 1, threads)
    return out


# ------------------------------------------------------------------------------ fused decode layer
cdef struct _wt:
    mq_mm_job j          # fmt, w, row_bytes, N, K, nc, levels, q5 range; x/y/a set per product
    const float *rs      # rotation signs (NULL: none)
    int rb               # rotation block (0: not rotated)
    float rscale


cdef int _mm1(_wt *w, const float *x, float *y, int threads) noexcept nogil:
    """y [N] = W x [K] for one row: matmul()'s product (_mm_run) on the layer's weight."""
    cdef mq_mm_job j = w.j
    j.x = x; j.y = y; j.a = NULL; j.T = 1; j.ldx = j.K; j.ldy = j.N; j.tiles = NULL
    return _mm_run(&j, w.rs, w.rb, w.rscale, threads)


cdef inline void _gap(_wt *nxt, size_t nbytes, int threads) noexcept nogil:
    """matmul(then=...)'s gap prefetch of the next weight's first nbytes."""
    cdef size_t total
    if nxt == NULL or nbytes == 0 or threads == 1:
        return
    total = <size_t>nxt.j.N * nxt.j.row_bytes
    mq_pool_prefetch_wait()
    mq_pool_prefetch(nxt.j.w, nbytes if nbytes < total else total, _pf_parts(threads))


cdef inline size_t _work_floats(int D, int nqkv, int nq, int inter) noexcept:
    """DecodeLayer.run's workspace: h [D], qkv [nqkv], att [nq], o [D], gate_up [2 inter], act [inter]."""
    return <size_t>3 * D + nqkv + nq + <size_t>3 * inter + 64


cdef class DecodeLayer:
    """One decoder layer of the Qwen2/Llama graph for a single token, in one call without the GIL:
    norm, qkv (+bias), RoPE, the KV write, attention, o_proj (+bias), residual, norm, gate_up, SiLU,
    down, residual. Each step is the kernel the per-op path calls (models/qwen2.py), in the same
    order on the same values, so the result is bit-identical; what goes is ~14 Python-level ops per
    layer and their arrays. Weights: (fmt id, raw, N, K, levels, q5 lo, q5 step, rotation or None)
    as ops._weight_args / ops._rot give them; `nxt` is the raw bytes of the weight multiplied after
    this layer's down projection (gap prefetch)."""
    cdef _wt w[4]                    # qkv, o, gate_up, down
    cdef _wt wnext
    cdef int has_next
    cdef object refs                 # every array a pointer below points into
    cdef const float *in_norm
    cdef const float *post_norm
    cdef const float *qkv_bias
    cdef const float *o_bias
    cdef float eps
    cdef double theta
    cdef readonly int D, Hq, Hkv, Dh, inter, nqkv
    cdef readonly object next_raw

    def __init__(self, weights, in_norm, post_norm, qkv_bias, o_bias, float eps, double theta,
                 int Hq, int Hkv, int Dh, nxt=None):
        refs = []
        cdef int i
        if len(weights) != 4:
            raise ValueError("DecodeLayer: weights are (qkv, o_proj, gate_up, down)")
        for i in range(4):
            self._set(&self.w[i], weights[i], refs, "DecodeLayer")
        self.has_next = nxt is not None
        if nxt is not None:
            self._set(&self.wnext, nxt, refs, "DecodeLayer next")
        self.next_raw = nxt[1] if nxt is not None else None
        D = self.w[0].j.K
        self.D = D; self.Hq = Hq; self.Hkv = Hkv; self.Dh = Dh
        self.nqkv = (Hq + 2 * Hkv) * Dh
        self.inter = self.w[3].j.K
        if Dh < 2 or Dh % 2 or Dh > 1024 or Hq % Hkv:
            raise ValueError("DecodeLayer: head_dim must be even and <= 1024, heads a multiple of KV heads")
        if (self.w[0].j.N != self.nqkv or self.w[1].j.N != D or self.w[1].j.K != Hq * Dh
                or self.w[2].j.N != 2 * self.inter or self.w[2].j.K != D or self.w[3].j.N != D):
            raise ValueError("DecodeLayer: weight shapes do not form a layer")
        self.in_norm = self._vec(in_norm, D, refs)
        self.post_norm = self._vec(post_norm, D, refs)
        self.qkv_bias = self._vec(qkv_bias, self.nqkv, refs) if qkv_bias is not None else NULL
        self.o_bias = self._vec(o_bias, D, refs) if o_bias is not None else NULL
        self.eps = eps; self.theta = theta
        self.refs = refs

    cdef const float *_vec(self, a, int n, list refs) except NULL:
        cdef cnp.ndarray arr = a
        _f32c(arr, "DecodeLayer vector")
        if arr.size != n:
            raise ValueError(f"DecodeLayer: a vector of {arr.size} values where {n} are needed")
        refs.append(arr)
        return <const float*>_ptr(arr)

    cdef int _set(self, _wt *w, args, list refs, str who) except -1:
        fmt, raw, N, K, lv, lo, step, rot = args
        cdef cnp.ndarray r = raw
        if r.dtype != np.uint8 or r.ndim != 1 or not r.flags.c_contiguous:
            raise ValueError(f"{who}: raw must be a contiguous 1-D uint8 array")
        memset(w, 0, sizeof(_wt))
        w.j.row_bytes = _row_geometry(fmt, K, &w.j, who)
        _check_height(fmt, N, who)
        if <size_t>r.shape[0] < <size_t>N * w.j.row_bytes:
            raise ValueError(f"{who}: raw holds {r.shape[0]} bytes, [{N}, {K}] needs {N * w.j.row_bytes}")
        w.j.fmt = fmt; w.j.w = <const uint8_t*>_ptr(r); w.j.N = N; w.j.K = K
        w.j.q3p_levels = _levels(fmt, lv, who); w.j.q5_lo = lo; w.j.q5_step = step
        refs.append(r); refs.append(lv)
        if rot is not None:
            block, signs, scale = rot
            if fmt >= MQ_NPACKED:
                raise ValueError(f"{who}: a rotation needs a packed weight")
            w.rs = _rot_args(K, block, signs, who)
            w.rb = block; w.rscale = scale
            refs.append(signs)
        return 0

    @staticmethod
    def work_floats(int D, int nqkv, int Hq, int Dh, int inter):
        """Floats of the workspace run() needs."""
        return _work_floats(D, nqkv, Hq * Dh, inter)

    def run(self, cnp.ndarray x, cnp.ndarray kc, cnp.ndarray vc, int pos, cnp.ndarray work,
            int threads=0, size_t pf_bytes=0):
        """x [D] float32 (the residual stream, updated in place) at position pos; kc, vc: this layer's
        float32 cache [Hkv, S, Dh] (position pos written); work: float32 [work_floats(...)]."""
        _f32c(x, "x"); _f32c(kc, "k cache"); _f32c(vc, "v cache"); _f32c(work, "work")
        cdef int D = self.D, Hq = self.Hq, Hkv = self.Hkv, Dh = self.Dh, ni = self.inter, nq = Hq * Dh
        if x.size != D:
            raise ValueError(f"DecodeLayer.run: x has {x.size} values, the layer takes {D}")
        if kc.ndim != 3 or vc.ndim != 3 or kc.shape[0] != Hkv or kc.shape[2] != Dh \
                or vc.shape[0] != Hkv or vc.shape[1] != kc.shape[1] or vc.shape[2] != Dh:
            raise ValueError(f"DecodeLayer.run: caches must be float32 [{Hkv}, S, {Dh}]")
        cdef int S = kc.shape[1]
        if pos < 0 or pos >= S:
            raise ValueError(f"DecodeLayer.run: position {pos} is outside the cache (length {S})")
        if <size_t>work.size < _work_floats(D, self.nqkv, nq, ni):
            raise ValueError("DecodeLayer.run: workspace too small")
        cdef float *px = <float*>_ptr(x)
        cdef float *pk = <float*>_ptr(kc)
        cdef float *pv = <float*>_ptr(vc)
        cdef float *h = <float*>_ptr(work)
        cdef float *qkv = h + D
        cdef float *att = qkv + self.nqkv
        cdef float *o = att + nq
        cdef float *gu = o + D
        cdef float *act = gu + 2 * ni
        cdef int64_t p64 = pos
        cdef int i, hh, rc = 0
        cdef _att_arg aa
        cdef _wt *nxt = &self.wnext if self.has_next else NULL
        with nogil:
            mq_rmsnorm(px, self.in_norm, h, 1, D, self.eps)
            rc |= _mm1(&self.w[0], h, qkv, threads)
            _gap(&self.w[1], pf_bytes, threads)
            if self.qkv_bias != NULL:
                for i in range(self.nqkv):
                    qkv[i] = qkv[i] + self.qkv_bias[i]
            mq_rope(qkv, &p64, 1, Hq + Hkv, Dh, self.theta)
            for hh in range(Hkv):
                memcpy(pk + (<size_t>hh * S + pos) * Dh, qkv + nq + hh * Dh, <size_t>Dh * 4)
                memcpy(pv + (<size_t>hh * S + pos) * Dh, qkv + nq + (Hkv + hh) * Dh, <size_t>Dh * 4)
            aa.q = qkv; aa.k = pk; aa.v = pv; aa.f16 = 0; aa.T = 1; aa.Hq = Hq; aa.Hkv = Hkv; aa.Dh = Dh
            aa.S = S; aa.pos0 = pos; aa.out = att
            mq_pool_run_n(_att_task, &aa, Hq, 1, threads)
            rc |= _mm1(&self.w[1], att, o, threads)
            _gap(&self.w[2], pf_bytes, threads)
            for i in range(D):
                px[i] = px[i] + o[i]
            if self.o_bias != NULL:
                for i in range(D):
                    px[i] = px[i] + self.o_bias[i]
            mq_rmsnorm(px, self.post_norm, h, 1, D, self.eps)
            rc |= _mm1(&self.w[2], h, gu, threads)
            _gap(&self.w[3], pf_bytes, threads)
            mq_silu_mul(gu, gu + ni, act, <size_t>ni)
            rc |= _mm1(&self.w[3], act, o, threads)
            _gap(nxt, pf_bytes, threads)
            for i in range(D):
                px[i] = px[i] + o[i]
        if rc:
            raise MemoryError("DecodeLayer.run: no activation buffer")
        global _pf_keep
        if pf_bytes and threads != 1 and self.has_next:
            _pf_keep = self.next_raw
        return x
