# Products from packed weights: activation quantization, GEMM tiles, matmul on the pool, dequantization. Included by _ops.pyx (one extension; module-level names are shared).

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
