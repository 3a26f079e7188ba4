# Attention over the packed KV cache and its block packer (misc.h mq_kvattn / mq_kv_pack; the numpy
# reference is mixqrt/kv/ref.py). Included by _ops.pyx (one extension; module-level names are shared).

cdef struct _kv_arg:
    mq_kvatt *seqs       # one per sequence
    int nseq
    int Hkv
    int chunk            # rows per item (a single sequence's prompt), 0: every row of its sequence


cdef void _kv_task(void *arg, int64_t i0, int64_t i1) noexcept nogil:
    # items: (row chunk or sequence, KV head), head-minor
    cdef _kv_arg *p = <_kv_arg*>arg
    cdef float *scr = <float*>mq_scratch(sizeof(float) * MQ_KV_SCRATCH_FLOATS(256))
    cdef int64_t i
    cdef int s, h, r0, r1
    cdef mq_kvatt *a
    if scr == NULL:
        return
    for i in range(i0, i1):
        s = <int>(i // p.Hkv)
        h = <int>(i - <int64_t>s * p.Hkv)
        if p.chunk:
            a = &p.seqs[0]
            r0 = s * p.chunk
            r1 = min(a.T, r0 + p.chunk)
        else:
            a = &p.seqs[s]
            r0 = 0
            r1 = a.T
        mq_kvattn(a, h, r0, r1, scr)


cdef int _kv_fill(mq_kvatt *a, int T, int Hq, int qdh, kf, vf, pk, int pos0, int bits, int window,
                  str who) except -1:
    """Checks one sequence's stores against T query rows of Hq heads of qdh and fills a (q and out are
    the caller's to set)."""
    cdef cnp.ndarray k16 = kf, v16 = vf, p8
    if k16.dtype not in (np.uint16, np.float16) or v16.dtype != k16.dtype or k16.ndim != 3 \
            or v16.ndim != 3 or k16.shape[0] != v16.shape[0] or k16.shape[1] != v16.shape[1] \
            or k16.shape[2] != v16.shape[2] or not k16.flags.c_contiguous or not v16.flags.c_contiguous:
        raise ValueError(f"{who}: the f16 stores must be contiguous [Hkv, S, Dh] float16 arrays")
    cdef int Hkv = k16.shape[0], S = k16.shape[1], Dh = k16.shape[2]
    if Dh % 32 or Dh > 256 or Dh < 32 or S % 64 or Hkv < 1 or qdh != Dh or Hq % Hkv:
        raise ValueError(f"{who}: q ({T}, {Hq}, {qdh}) against stores [{Hkv}, {S}, {Dh}] (head_dim a multiple of "
                         f"32 up to 256, length a multiple of 64, query heads a multiple of KV heads)")
    if bits not in (4, 8) or window < 0:
        raise ValueError(f"{who}: bits must be 4 or 8 and window >= 0, got {bits}, {window}")
    if pos0 < 0 or pos0 + T > S:
        raise ValueError(f"{who}: positions {pos0}..{pos0 + T - 1} exceed the cache length {S}")
    a.block_bytes = MQ_KV_BLOCK_BYTES(Dh, bits)
    a.pk = NULL
    if pk is not None:
        p8 = pk
        if p8.dtype != np.uint8 or p8.ndim != 3 or p8.shape[0] != Hkv or p8.shape[1] != S // 64 \
                or p8.shape[2] != a.block_bytes or not p8.flags.c_contiguous:
            raise ValueError(f"{who}: the packed store must be contiguous uint8 [{Hkv}, {S // 64}, {a.block_bytes}]")
        a.pk = <const uint8_t*>_ptr(p8)
    a.q = NULL; a.out = NULL
    a.kf = <const uint16_t*>_ptr(k16); a.vf = <const uint16_t*>_ptr(v16)
    a.T = T; a.Hq = Hq; a.Hkv = Hkv; a.Dh = Dh; a.S = S; a.pos0 = pos0
    a.bits = bits; a.window = window
    return 0


def kv_attention(cnp.ndarray q, kf, vf, pk, int pos0, int bits, int window, cnp.ndarray out, int threads=0):
    """Causal GQA attention of q [T, Hq, Dh] (positions pos0..) over one layer of a packed KV cache:
    kf, vf [Hkv, S, Dh] float16 stores, pk [Hkv, S/64, block_bytes] uint8 blocks or None (f16 only),
    bits 4 | 8, window 0 (none) or the sliding window -> out [T, Hq, Dh]. Row t is exactly a one-row
    call at pos0 + t."""
    _f32c(q, "q"); _f32c(out, "out")
    if q.ndim != 3 or out.ndim != 3 or out.shape[0] != q.shape[0] or out.shape[1] != q.shape[1] or out.shape[2] != q.shape[2]:
        raise ValueError("kv_attention: q and out must be [T, Hq, Dh]")
    cdef mq_kvatt a
    _kv_fill(&a, q.shape[0], q.shape[1], q.shape[2], kf, vf, pk, pos0, bits, window, "kv_attention")
    a.q = <const float*>_ptr(q); a.out = <float*>_ptr(out)
    cdef _kv_arg arg
    arg.seqs = &a; arg.nseq = 1; arg.Hkv = a.Hkv
    arg.chunk = MQ_KV_TR if a.T > 1 else 0
    cdef int64_t items = <int64_t>((a.T + MQ_KV_TR - 1) // MQ_KV_TR) * a.Hkv if a.T > 1 else a.Hkv
    cdef int np_ = threads if 0 < threads < mq_pool_size() else mq_pool_size()
    with nogil:
        if items > a.Hkv and np_ > 1:
            # a row's cost grows with its position: chunks taken in turn
            mq_pool_run_chunked(_kv_task, &arg, items, 1, np_, max(1, items // (8 * np_)))
        else:
            mq_pool_run_n(_kv_task, &arg, items, 1, threads)
    return out


def kv_attention_batch(cnp.ndarray q, list kfs, list vfs, list pks, positions, int bits, windows,
                       cnp.ndarray out, int threads=0):
    """One decode query per sequence on its own packed cache: q [B, Hq, Dh], the stores of sequence
    b (kfs[b], vfs[b], pks[b]), query b at positions[b], windows[b] (0: none) -> out [B, Hq, Dh]. Row b
    is exactly kv_attention(q[b:b+1], ...) at positions[b]."""
    _f32c(q, "q"); _f32c(out, "out")
    cdef int B = q.shape[0] if q.ndim == 3 else -1
    if B < 1 or out.ndim != 3 or out.shape[0] != B or out.shape[1] != q.shape[1] or out.shape[2] != q.shape[2]:
        raise ValueError("kv_attention_batch: q and out must be [B, Hq, Dh]")
    pos = [int(p) for p in positions]
    win = [int(w) for w in windows]
    if len(kfs) != B or len(vfs) != B or len(pks) != B or len(pos) != B or len(win) != B:
        raise ValueError(f"kv_attention_batch: {B} queries need {B} caches, positions and windows")
    cdef size_t nb = sizeof(mq_kvatt) * B
    cdef mq_kvatt *seqs = <mq_kvatt*>malloc(nb)
    if seqs == NULL:
        raise MemoryError()
    cdef int b, hkv = -1
    cdef _kv_arg arg
    try:
        for b in range(B):
            _kv_fill(&seqs[b], 1, q.shape[1], q.shape[2], kfs[b], vfs[b], pks[b], pos[b], bits, win[b],
                     "kv_attention_batch")
            seqs[b].q = <const float*>_ptr(q) + <size_t>b * q.shape[1] * q.shape[2]
            seqs[b].out = <float*>_ptr(out) + <size_t>b * q.shape[1] * q.shape[2]
            if hkv < 0:
                hkv = seqs[b].Hkv
            elif seqs[b].Hkv != hkv:
                raise ValueError("kv_attention_batch: the caches have different KV heads")
        arg.seqs = seqs; arg.nseq = B; arg.Hkv = hkv; arg.chunk = 0
        with nogil:
            mq_pool_run_n(_kv_task, &arg, <int64_t>B * hkv, 1, threads if B * hkv > 1 else 1)
    finally:
        free(seqs)
    return out


def kv_pack(kf, vf, int b0, int b1, int bits, cnp.ndarray pk):
    """Pack blocks [b0, b1) of every head from the f16 stores kf, vf [Hkv, S, Dh] into pk
    [Hkv, S/64, block_bytes] (mixqrt/kv/ref.py pack_block)."""
    cdef cnp.ndarray k16 = kf, v16 = vf
    if k16.dtype not in (np.uint16, np.float16) or v16.dtype != k16.dtype or k16.ndim != 3 \
            or k16.shape[0] != v16.shape[0] or k16.shape[1] != v16.shape[1] or k16.shape[2] != v16.shape[2] \
            or not k16.flags.c_contiguous or not v16.flags.c_contiguous:
        raise ValueError("kv_pack: the f16 stores must be contiguous [Hkv, S, Dh] float16 arrays")
    cdef int Hkv = k16.shape[0], S = k16.shape[1], Dh = k16.shape[2]
    if bits not in (4, 8) or Dh % 32 or Dh > 256 or S % 64:
        raise ValueError(f"kv_pack: bits {bits}, head_dim {Dh}, length {S} (4|8, a multiple of 32 <= 256, of 64)")
    cdef int NB = S // 64
    if pk.dtype != np.uint8 or pk.ndim != 3 or pk.shape[0] != Hkv or pk.shape[1] != NB \
            or pk.shape[2] != MQ_KV_BLOCK_BYTES(Dh, bits) or not pk.flags.c_contiguous:
        raise ValueError("kv_pack: the packed store must be contiguous uint8 [Hkv, S/64, block_bytes]")
    if b0 < 0 or b1 > NB or b0 > b1:
        raise ValueError(f"kv_pack: blocks {b0}..{b1} outside 0..{NB}")
    cdef const uint16_t *pkf = <const uint16_t*>_ptr(k16)
    cdef const uint16_t *pvf = <const uint16_t*>_ptr(v16)
    cdef uint8_t *pp = <uint8_t*>_ptr(pk)
    with nogil:
        mq_kv_pack(pkf, pvf, S, Dh, Hkv, b0, b1, bits, pp, NB)
    return pk
