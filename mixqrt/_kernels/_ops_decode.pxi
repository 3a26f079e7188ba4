# The fused single-token decode layer (DecodeLayer). Included by _ops.pyx (one extension; module-level names are shared).

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
            int threads=0, size_t pf_bytes=0, blocks=None, int bits=0):
        """x [D] float32 (the residual stream, updated in place) at position pos; kc, vc: this layer's
        float32 cache [Hkv, S, Dh] (position pos written); work: float32 [work_floats(...)].
        bits 4 | 8: a packed KV cache's layer (mixqrt.kv): kc, vc its float16 stores, pk its blocks;
        position pos is written in f16, the block it completes is packed, and the attention is
        kv_attention's (the same bits as the op-by-op path); blocks: its packed blocks."""
        _f32c(x, "x"); _f32c(work, "work")
        cdef int D = self.D, Hq = self.Hq, Hkv = self.Hkv, Dh = self.Dh, ni = self.inter, nq = Hq * Dh
        if x.size != D:
            raise ValueError(f"DecodeLayer.run: x has {x.size} values, the layer takes {D}")
        cdef mq_kvatt ka
        cdef _kv_arg karg
        cdef uint16_t *k16 = NULL
        cdef uint16_t *v16 = NULL
        cdef uint8_t *ppk = NULL
        cdef int NB = 0, d
        cdef size_t o16
        if bits:
            if blocks is None:
                raise ValueError("DecodeLayer.run: a packed cache layer needs its blocks")
            _kv_fill(&ka, 1, Hq, Dh, kc, vc, blocks, pos, bits, 0, "DecodeLayer.run")
            if ka.Hkv != Hkv or ka.Dh != Dh:
                raise ValueError(f"DecodeLayer.run: the packed cache is [{ka.Hkv}, S, {ka.Dh}], the layer has {Hkv} x {Dh}")
            k16 = <uint16_t*>ka.kf; v16 = <uint16_t*>ka.vf; ppk = <uint8_t*>ka.pk; NB = ka.S // 64
        else:
            _f32c(kc, "k cache"); _f32c(vc, "v cache")
        if kc.ndim != 3 or vc.ndim != 3 or kc.shape[0] != Hkv or kc.shape[2] != Dh \
                or vc.shape[0] != Hkv or vc.shape[1] != kc.shape[1] or vc.shape[2] != Dh:
            raise ValueError(f"DecodeLayer.run: caches must be float32 [{Hkv}, S, {Dh}]")
        cdef int S = kc.shape[1]
        if pos < 0 or pos >= S:
            raise ValueError(f"DecodeLayer.run: position {pos} is outside the cache (length {S})")
        if <size_t>work.size < _work_floats(D, self.nqkv, nq, ni):
            raise ValueError("DecodeLayer.run: workspace too small")
        cdef float *px = <float*>_ptr(x)
        cdef float *pk = <float*>_ptr(kc)       # (a packed layer: unused, its stores are k16 / v16)
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
            if bits:
                for hh in range(Hkv):
                    o16 = (<size_t>hh * S + pos) * Dh
                    if bits == 4:                           # q4 stores values rotated (kv/ref.py fwht)
                        mq_kv_fwht(qkv + nq + (Hkv + hh) * Dh, Dh)
                    for d in range(Dh):
                        k16[o16 + d] = mq_f32_to_f16(qkv[nq + hh * Dh + d])
                        v16[o16 + d] = mq_f32_to_f16(qkv[nq + (Hkv + hh) * Dh + d])
                if (pos + 1) % 64 == 0 and pos >= 127:        # block pos // 64 (>= 1) is complete
                    mq_kv_pack(k16, v16, S, Dh, Hkv, pos // 64, pos // 64 + 1, bits, ppk, NB)
                ka.q = qkv; ka.out = att
                karg.seqs = &ka; karg.nseq = 1; karg.Hkv = Hkv; karg.chunk = 0
                mq_pool_run_n(_kv_task, &karg, Hkv, 1, threads)
            else:
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
