# Tuning switches of the products: the AVX-512 paths, the decode split over the pool, prefetch distances. Included by _ops.pyx (one extension; module-level names are shared).

_gemm_min_t = 18


def set_gemm_min_t(int t):
    """AVX-512 GEMM path for row-format matmuls with T >= t rows of x (t <= 0: off; default 18). Below it
    every row of a product is bit for bit the T = 1 row (q4x / q6x / q3x: at any T). Returns the old value."""
    global _gemm_min_t
    old = _gemm_min_t
    _gemm_min_t = t
    mq_set_gemm_min_t(t)
    return old


def set_lean_mv(on=None):
    """AVX-512 decode (T == 1) of q3p / q4 / q3u / q6 through the lean fused paths (on, the default; the
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


def set_mv_xpf(on=None):
    """AVX-512 decode (T == 1) of q4x / q6x with a software prefetch into L2, mv_q3x's distance ahead
    (MIXQRT_Q3X_PF; on, the default) or on the hardware prefetcher alone (off; MIXQRT_MV_XPF=0
    starts a process with it off). The same bits either way. on=None only queries. Returns the
    previous state."""
    return bool(mq_set_mv_xpf(-1 if on is None else (1 if on else 0)))


def set_few_max_t(t=None):
    """AVX-512 products of 9 up to t rows on the interleaved formats (q4x, q6x, q3x; a speculative verify
    of up to 64 drafts) through the few-row kernels over L2-sized blocks of weight rows, the rows in
    groups of 2-8 (default 64; 0: through the GEMM, whose per-call tile unpack costs about a decode
    step whatever the row count). The same bits either way (every row the T = 1 row). t=None only
    queries. Returns the previous value."""
    return mq_set_few_max_t(-1 if t is None else max(0, int(t)))


def set_q2c_mv(on=None):
    """AVX-512 decode of q2c (the routed experts' gate/up and embedding tables of the 2356 family)
    through mv_q2c, whole 128-weight blocks of 4 rows with one broadcast load and one level lookup
    per 64 codes (on, the default) or the generic unpack path (off; MIXQRT_Q2C_MV=0 starts a process
    with it off). Same integer sums; the float accumulation order differs. on=None only queries.
    Returns the previous state."""
    return bool(mq_set_q2c_mv(-1 if on is None else (1 if on else 0)))


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


def set_float_pf(size_t nbytes):
    """In-row prefetch distance, bytes, of set_float_mv's 4-row float decode (default 2048; 0: none)."""
    mq_set_float_pf(nbytes)


def set_q3x_prefetch(nbytes=None):
    """q3x decode's software prefetch distance into L2, bytes (default 16384; 0: none), AVX-512 and
    AVX2; also the AVX-512 few-row products' (q4x / q6x / q3x, 2-8 rows). None only queries. Returns
    the previous value."""
    cdef size_t old = mq_q3x_prefetch()
    if nbytes is not None:
        mq_set_q3x_prefetch(<size_t>_count(nbytes, "set_q3x_prefetch: nbytes"))
    return old


def set_spin_us(long us):
    """How long, in microseconds, an idle pool worker spins before it sleeps (default 100); takes
    effect at the next pool_start."""
    if us < 0:
        raise ValueError(f"set_spin_us: {us} is negative")
    mq_pool_set_spin_us(us)
