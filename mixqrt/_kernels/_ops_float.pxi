# The float ops of a layer: rmsnorm, hadamard, rope, silu, softmax, attention. Included by _ops.pyx (one extension; module-level names are shared).

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


def dot_rows(cnp.ndarray w, cnp.ndarray x, cnp.ndarray out):
    """out [T, N] = x [T, K] @ w [N, K]^T, float32 C-contiguous, the same bits on every ISA tier
    (16 float lanes summed in a fixed order, no FMA contraction): a MoE router's scores."""
    _f32c(w, "w"); _f32c(x, "x"); _f32c(out, "out")
    if w.ndim != 2 or x.ndim != 2 or out.ndim != 2 or x.shape[1] != w.shape[1] \
            or out.shape[0] != x.shape[0] or out.shape[1] != w.shape[0]:
        raise ValueError("dot_rows: w [N, K], x [T, K] and out [T, N]")
    cdef const float *pw = <const float*>_ptr(w)
    cdef const float *px = <const float*>_ptr(x)
    cdef float *po = <float*>_ptr(out)
    cdef int N = w.shape[0], K = w.shape[1], T = x.shape[0]
    with nogil:
        mq_dot_rows(pw, px, po, N, K, T)
    return out


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
