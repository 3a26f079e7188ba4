/* AVX-512 tier, decode: the fused matvec kernels (T == 1) of every packed format, and the few-token
 * products (2 <= T <= MQ_FEW_T) of the interleaved formats. Internals: kern_avx512_impl.h. */
#include "kern_avx512_impl.h"

/* the interleaved kernels' software prefetch: the `bytes` of a chunk / block pfd ahead of b into L2,
 * where that stays inside the product's rows (pfd 0: none) */
static inline __attribute__((always_inline)) void l2_ahead(const uint8_t *b, size_t pfd, int bytes, const uint8_t *end) {
    if (pfd && b + pfd + bytes <= end)
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)b + pfd + o, _MM_HINT_T1);
}

/* mv_q4x / mv_q6x software prefetch into L2, mv_q3x's distance (MIXQRT_Q3X_PF) ahead (MIXQRT_MV_XPF) */
static int mq_mv_xpf = 1;
int mq_avx512_set_mv_xpf(int on) { int old = mq_mv_xpf; if (on >= 0) mq_mv_xpf = on != 0; return old; }

/* ------------------------------------------------------------------ decode: fused, 2 rows at once */
/* pv[p]: dx of chunk 2p in lanes 0-7 and of 2p+1 in lanes 8-15, then s of 2p in lane 0 and of
 * 2p+1 in lane 8 (other lanes 0) */
static void pair_vectors(const mq_act *a, int np, __m512 *pv) {
    for (int p = 0; p < np; p++) {
        pv[2 * p] = pairvec(a->d[2 * p], a->d[2 * p + 1]);
        pv[2 * p + 1] = _mm512_maskz_mov_ps(0x0101, pairvec(a->s[2 * p], a->s[2 * p + 1]));
    }
}

#define NR 2
/* Decode prefetch goes to L2 (T1), PF_ROWS rows ahead (at most MV_PF_MAX bytes): prefetching into L1
 * 16 KB ahead evicted the lines before use (q4 gate_up 9728 x 896 streamed 8 GB/s per core with T0,
 * 18-20 with T1; end to end decode 1.3-1.5x, docs/kernels.md "Prefetch level") */
#ifndef PF_ROWS
#define PF_ROWS 32
#endif
#ifndef MV_PF_MAX
#define MV_PF_MAX 65536
#endif
#ifndef MV_PF_HINT
#define MV_PF_HINT _MM_HINT_T1   /* mv_fmt's software prefetch level */
#endif
static inline __attribute__((always_inline)) void
mv_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    int np = (j->nc + 1) / 2;
    __m512 *pv = (__m512 *)mq_scratch((size_t)np * 128);
    pair_vectors(j->a, np, pv);
    const size_t pf_rows = (size_t)PF_ROWS * j->row_bytes <= MV_PF_MAX ? PF_ROWS
                         : (MV_PF_MAX / j->row_bytes > NR ? MV_PF_MAX / j->row_bytes : NR);
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        const uint8_t *r0 = j->w + (size_t)n * j->row_bytes, *r1 = r0 + j->row_bytes;
        /* software prefetch PF_ROWS ahead: the hardware prefetcher alone left decode at ~40 % of
         * the read bandwidth on tensors that miss the LLC */
        const uint8_t *pf = r0 + pf_rows * j->row_bytes;
        if (pf + NR * j->row_bytes <= cx->end)
            for (size_t o = 0; o < NR * j->row_bytes; o += 64) _mm_prefetch((const char *)pf + o, MV_PF_HINT);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, am0 = acc0, am1 = acc0;
        for (int p = 0; p < np; p++) {
            __m512 d0, m0, d1, m1;
            __m512i l0 = unpack_pair(cx, fmt, r0, p, &d0, &m0);
            __m512i l1 = unpack_pair(cx, fmt, r1, p, &d1, &m1);
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p)), corr = q8_corr(fmt, xq);
            __m512 dx = pv[2 * p], sx = pv[2 * p + 1];
            __m512i i0 = q8_fix(fmt, _mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, xq), corr);
            __m512i i1 = q8_fix(fmt, _mm512_dpbusd_epi32(_mm512_setzero_si512(), l1, xq), corr);
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(d0, dx), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(d1, dx), acc1);
            am0 = _mm512_fmadd_ps(m0, sx, am0);
            am1 = _mm512_fmadd_ps(m1, sx, am1);
        }
        j->y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, am0));
        j->y[n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc1, am1));
    }
    for (; n < n1; n++) {
        const uint8_t *r0 = j->w + (size_t)n * j->row_bytes;
        __m512 acc0 = _mm512_setzero_ps(), am0 = acc0;
        for (int p = 0; p < np; p++) {
            __m512 d0, m0;
            __m512i l0 = unpack_pair(cx, fmt, r0, p, &d0, &m0);
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            __m512i i0 = q8_fix(fmt, _mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, xq), q8_corr(fmt, xq));
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(d0, pv[2 * p]), acc0);
            am0 = _mm512_fmadd_ps(m0, pv[2 * p + 1], am0);
        }
        j->y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, am0));
    }
}

/* ------------------------------------------------------------------ decode: lean path for q3p, q3u, q6
 * The formats that carry most decode bytes (FFN q3p, attention and lm_head q6) get a leaner fused
 * matvec than unpack_pair: the bit planes are broadcast qwords / 128-bit lanes (no vpermb), q3's
 * high bits go from memory straight into a mask register, the block scales of a pair are converted
 * once as an xmm, and the activation side keeps 4 floats per 64 weights (dx of both chunks and the
 * offset term's s) instead of two zmm, so ffn_down's K = 18944 stays in L1 beside the weight
 * streams. NRL rows run at once; each row stream is prefetched LEAN_PF bytes ahead inside the loop
 * (continuing into the same row of the next tile past the row's end): the old whole-rows-ahead
 * prefetch overflowed L1 on long rows (ffn_down ran at 0.6x the speed of gate_up per byte).
 * Short rows prefetch whole tiles 16 KB ahead instead; q6 with short rows (the 0.5B model's K = 896,
 * lm_head 151936 x 896) stays on the unpack path, which measured faster there at 2 threads.
 * Measured on the 7B shapes: docs/kernels.md. */
#ifndef LEAN_PF
#define LEAN_PF 1536
#endif
#ifndef LEAN_TILE_PF
#define LEAN_TILE_PF 16384
#endif
#ifndef LEAN_PF_HINT
#define LEAN_PF_HINT _MM_HINT_T1   /* the decode kernels' software prefetch level (see MV_PF_HINT) */
#endif
/* short rows (a tile <= LEAN_SHORT_TILE): the whole 4-row tile tile_pf bytes ahead, in lines, where
 * it lies inside the tensor */
static inline __attribute__((always_inline)) void
lean_tile_prefetch(const uint8_t *r, size_t tile, size_t tile_pf, const uint8_t *end) {
    if (r + tile_pf + tile <= end)
        for (size_t o = 0; o < tile; o += 64) _mm_prefetch((const char *)r + tile_pf + o, LEAN_PF_HINT);
}
static inline __attribute__((always_inline)) __m512i q3_codes(const uint8_t *blk) {   /* q3u */
    const __m512i sh2 = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6);
    __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x((long long)rd64(blk + Q3_C0))),
                                    _mm256_set1_epi64x((long long)rd64(blk + Q3_C1)), 1);
    lo = _mm512_and_si512(_mm512_srlv_epi64(lo, sh2), _mm512_set1_epi8(3));
    __mmask64 k = _cvtu64_mask64((uint64_t)rd32(blk + Q3_C0 + MQ_PACK3_HI) | ((uint64_t)rd32(blk + Q3_C1 + MQ_PACK3_HI) << 32));
    lo = _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(4));
    return lo;
}

static inline __attribute__((always_inline)) __m512i q6_codes(const uint8_t *A) {
    const uint8_t *B = A + MQ_Q6_BLOCK;
    const __m512i sh4 = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(A + MQ_Q6_HEADER)))),
                                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(B + MQ_Q6_HEADER))), 1);
    lo = _mm512_and_si512(_mm512_srlv_epi64(lo, sh4), _mm512_set1_epi8(15));
    __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x((long long)rd64(A + Q6_HI))),
                                    _mm256_set1_epi64x((long long)rd64(B + Q6_HI)), 1);
    hi = _mm512_rolv_epi64(hi, _mm512_setr_epi64(4, 2, 0, 62, 4, 2, 0, 62));
    return _mm512_ternarylogic_epi64(lo, hi, _mm512_set1_epi8(0x30), 0xF8); /* lo | (hi & 0x30) */
}

/* one pair (64 weights) of one row into acc / am; fmt is a constant after inlining */
static inline __attribute__((always_inline)) void
lean_pair(const int fmt, const uint8_t *row, int p, __m512i tab, __m512i xq, __m512 dxv, __m128 dx2, __m128 sv,
          __m512 *acc, __m128 *am) {
    const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    if (fmt == MQ_Q6) {
        const uint8_t *A = row + (size_t)p * 2 * MQ_Q6_BLOCK;
        __m512i l = q6_codes(A);
        __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(rd32(A) & 0xffff) | (int)((uint32_t)rd32(A + MQ_Q6_BLOCK) << 16)));
        __m512 w = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_mul_ps(d2, dx2)));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xq)), w, *acc);
        *am = _mm_fmadd_ps(d2, sv, *am);
    } else {
        const uint8_t *blk = row + (size_t)p * MQ_Q3_BLOCK;
        __m512i l = q3_codes(blk);
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(blk)));
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xq)), dxv);
        *acc = _mm512_fmadd_ps(f, _mm512_broadcastss_ps(dm), *acc);
        *am = _mm_fmadd_ps(dm, sv, *am);
    }
}

static inline __attribute__((always_inline)) void
mv_lean(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const int np = (j->nc + 1) / 2, pb = fmt == MQ_Q6 ? 2 * MQ_Q6_BLOCK : MQ_Q3_BLOCK;
    const size_t rb = j->row_bytes;
    const float *dx = j->a->d, *s = j->a->s;
    /* offset-term activations per pair: q6 (-32 s_2p, -32 s_2p+1) against (d_A, d_B);
     * q3 (0, s_2p + s_2p+1) against (d, m) */
    float *sp = (float *)mq_scratch((size_t)np * 8 + 64);
    for (int p = 0; p < np; p++) {
        if (fmt == MQ_Q6) { sp[2 * p] = -32.0f * s[2 * p]; sp[2 * p + 1] = -32.0f * s[2 * p + 1]; }
        else { sp[2 * p] = 0.0f; sp[2 * p + 1] = s[2 * p] + s[2 * p + 1]; }
    }
    const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const size_t pd = rb < LEAN_PF ? rb : LEAN_PF;
    /* long rows: in-row prefetch; short rows (a 4-row tile of at most LEAN_SHORT_TILE bytes, e.g.
     * K = 896): whole tiles LEAN_TILE_PF bytes ahead, the in-row distance being too short for DRAM */
    const size_t tile = (size_t)NRL * rb;
    const int in_row = tile > LEAN_SHORT_TILE;
    const size_t tile_pf = tile * ((LEAN_TILE_PF + tile - 1) / tile);
    int n = n0;
    for (; n + NRL <= n1; n += NRL) {
        const uint8_t *r = j->w + (size_t)n * rb;
        if (!in_row) lean_tile_prefetch(r, tile, tile_pf, cx->end);
        __m512 acc[NRL];
        __m128 am[NRL];
        for (int i = 0; i < NRL; i++) { acc[i] = _mm512_setzero_ps(); am[i] = _mm_setzero_ps(); }
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            __m128 dx2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
            __m512 dxv = fmt == MQ_Q6 ? _mm512_setzero_ps() : _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dx2));
            __m128 sv = _mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)));
            size_t v = (size_t)p * pb + pd;
            size_t pfo = v < rb ? v : v - rb + (size_t)NRL * rb;   /* past the row: same row, next tile */
            for (int i = 0; i < NRL; i++) {
                /* prefetch never faults; one per 64 B consumed is enough */
                if (in_row && (fmt == MQ_Q6 || (p & 1) == 0)) _mm_prefetch((const char *)(r + i * rb + pfo), LEAN_PF_HINT);
                lean_pair(fmt, r + i * rb, p, cx->tab, xq, dxv, dx2, sv, &acc[i], &am[i]);
            }
        }
        for (int i = 0; i < NRL; i++) {
            __m128 t = _mm_add_ss(am[i], _mm_movehdup_ps(am[i]));
            j->y[n + i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(t);
        }
    }
    for (; n < n1; n++) {
        const uint8_t *r = j->w + (size_t)n * rb;
        __m512 acc = _mm512_setzero_ps();
        __m128 am = _mm_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            __m128 dx2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
            __m512 dxv = fmt == MQ_Q6 ? _mm512_setzero_ps() : _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dx2));
            __m128 sv = _mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)));
            lean_pair(fmt, r, p, cx->tab, xq, dxv, dx2, sv, &acc, &am);
        }
        __m128 t = _mm_add_ss(am, _mm_movehdup_ps(am));
        j->y[n] = _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(t);
    }
}

/* ------------------------------------------------------------------ decode: q3p (pack3c)
 * Per pair and row: one 32-byte load, q3c_levels (3 shuffles), one vpdpbusd. The float work is
 * shared by the 4 rows of a tile: their 4 x 16 int32 lanes are folded (unpacklo/hi + add, 6 ops)
 * into one vector whose lane 4j + r holds row r's partial sum of 128-bit lane j (j < 2: chunk A,
 * else chunk B), converted once and scaled by (d_r * dx_chunk); the 4 rows' (d, m) come from one
 * vcvtph2ps of their gathered headers, and m * (s_A + s_B) accumulates in one ymm. The prefetch is
 * mv_lean's (in-row LEAN_PF ahead for long rows, whole tiles LEAN_TILE_PF ahead for short ones). */
static inline __attribute__((always_inline)) __m512i red4(__m512i i0, __m512i i1, __m512i i2, __m512i i3) {
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(i2, i3), _mm512_unpackhi_epi32(i2, i3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

static inline __attribute__((always_inline)) __m256i q3_block(const uint8_t *blk, const uint8_t *end) {
    return blk + 32 <= end ? _mm256_loadu_si256((const __m256i *)blk) : _mm256_maskz_loadu_epi8(0x0fffffff, blk);
}

#ifndef DXV_MAX_PAIRS
#define DXV_MAX_PAIRS 160
#endif
static __attribute__((noinline)) void mv_q3c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const int np = (j->nc + 1) / 2;
    const size_t rb = j->row_bytes;
    const float *dx = j->a->d, *s = j->a->s;
    /* per pair: (0, s_2p + s_2p+1) against (d, m); rows up to DXV_MAX_PAIRS pairs also keep the
     * dx lane vector (dx_2p in lanes 0-7, dx_2p+1 in 8-15) in scratch instead of permuting it in
     * every tile (a shuffle less per pair and tile: ~1.1x), longer ones would push it out of L1 */
    const int dxs_on = np <= DXV_MAX_PAIRS;
    uint8_t *scr = (uint8_t *)mq_scratch((size_t)np * 8 + 64 + (dxs_on ? (size_t)np * 64 + 64 : 0));
    float *sp = (float *)scr;
    __m512 *dxs = (__m512 *)(((uintptr_t)(scr + (size_t)np * 8) + 63) & ~(uintptr_t)63);
    const __m512i dsel = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int p = 0; p < np; p++) {
        sp[2 * p] = 0.0f; sp[2 * p + 1] = s[2 * p] + s[2 * p + 1];
        if (dxs_on) dxs[p] = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)))));
    }
    const size_t pd = rb < LEAN_PF ? rb : LEAN_PF, tile = (size_t)NRL * rb;
    const int in_row = tile > LEAN_SHORT_TILE;
    const size_t tile_pf = tile * ((LEAN_TILE_PF + tile - 1) / tile);
    /* the 32-byte block loads read 4 bytes past a block: the tensor's last row goes to the
     * guarded one-row loop */
    const int nf = j->w + (size_t)n1 * rb + 4 > cx->end ? n1 - 1 : n1;
    int n = n0;
    for (; n + NRL <= nf; n += NRL) {
        const uint8_t *r = j->w + (size_t)n * rb;
        if (!in_row) lean_tile_prefetch(r, tile, tile_pf, cx->end);
        __m512 acc = _mm512_setzero_ps();
        __m256 am = _mm256_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            __m512 dxv = dxs_on ? dxs[p] : _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)))));
            __m256 sv = _mm256_broadcast_ss(sp + 2 * p + 1);   /* the d lanes of am collect junk, never read */
            const uint8_t *b0 = r + (size_t)p * MQ_Q3_BLOCK;
            if (in_row && (p & 1) == 0) {
                size_t v = (size_t)p * MQ_Q3_BLOCK + pd;
                size_t pfo = v < rb ? v : v - rb + tile;   /* past the row: same row, next tile */
                for (int i = 0; i < NRL; i++) _mm_prefetch((const char *)(r + i * rb + pfo), LEAN_PF_HINT);
            }
            __m256i v0 = _mm256_loadu_si256((const __m256i *)b0), v1 = _mm256_loadu_si256((const __m256i *)(b0 + rb));
            __m256i v2 = _mm256_loadu_si256((const __m256i *)(b0 + 2 * rb)), v3 = _mm256_loadu_si256((const __m256i *)(b0 + 3 * rb));
            const __m512i z = _mm512_setzero_si512();
            __m512i i0 = _mm512_dpbusd_epi32(z, q3c_levels(v0, cx->tab64), xq);
            __m512i i1 = _mm512_dpbusd_epi32(z, q3c_levels(v1, cx->tab64), xq);
            __m512i i2 = _mm512_dpbusd_epi32(z, q3c_levels(v2, cx->tab64), xq);
            __m512i i3 = _mm512_dpbusd_epi32(z, q3c_levels(v3, cx->tab64), xq);
            __m128i h = _mm_unpacklo_epi64(_mm_unpacklo_epi32(_mm256_castsi256_si128(v0), _mm256_castsi256_si128(v1)),
                                           _mm_unpacklo_epi32(_mm256_castsi256_si128(v2), _mm256_castsi256_si128(v3)));
            __m256 dm = _mm256_cvtph_ps(h);                   /* d0 m0 d1 m1 d2 m2 d3 m3 */
            __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, _mm512_castps256_ps512(dm)), dxv);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(i0, i1, i2, i3)), wv, acc);
            am = _mm256_fmadd_ps(dm, sv, am);
        }
        float t[16], u[8];
        _mm512_storeu_ps(t, acc); _mm256_storeu_ps(u, am);
        for (int i = 0; i < NRL; i++) j->y[n + i] = ((t[i] + t[4 + i]) + (t[8 + i] + t[12 + i])) + u[2 * i + 1];
    }
    for (; n < n1; n++) {
        const uint8_t *r = j->w + (size_t)n * rb;
        __m512 acc = _mm512_setzero_ps();
        __m128 am = _mm_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            __m128 dx2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
            __m512 dxv = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dx2));
            __m128 sv = _mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)));
            __m256i v = q3_block(r + (size_t)p * MQ_Q3_BLOCK, cx->end);
            __m128 dm = _mm_cvtph_ps(_mm256_castsi256_si128(v));
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_levels(v, cx->tab64), xq)), dxv);
            acc = _mm512_fmadd_ps(f, _mm512_broadcastss_ps(dm), acc);
            am = _mm_fmadd_ps(dm, sv, am);
        }
        __m128 t = _mm_add_ss(am, _mm_movehdup_ps(am));
        j->y[n] = _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(t);
    }
}

/* ------------------------------------------------------------------ decode: q4, even chunk count
 * mv_q3c's 4-row fold on q4's pairs of 20-byte blocks (d, m, 16 code bytes; 40 bytes per 64 weights):
 * per pair and row one 64-byte load, a vpermb that puts each block's 16 code bytes in two 128-bit
 * lanes, a per-qword shift (0 or 4) and a mask for the nibbles, one vpdpbusd. The 4 rows' 16 header
 * halves (d_A m_A d_B m_B per row) come from two vpermt2d and one insert of the loaded vectors, one
 * vcvtph2ps; then the float work of mv_q3c (lane 4j + r: j < 2 block A, else block B), and m * s
 * accumulates lane-wise against (0, s_A, 0, s_B) per row. Odd chunk counts take mv_fmt. */
static const uint8_t PERM_Q4P[64] = {
     4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,18,19,  4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,18,19,
    24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39, 24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39};
_Static_assert(MQ_Q4_HEADER == 4 && MQ_Q4_BLOCK == 20 && MQ_HDR_M == 2, "PERM_Q4P / the header gather index q4 blocks");

static inline __attribute__((always_inline)) __m512i q4p_levels(__m512i v, __m512i perm) {
    const __m512i sh4 = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    return _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi8(perm, v), sh4), _mm512_set1_epi8(15));
}

static __attribute__((noinline)) void mv_q4c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const int np = j->nc / 2;
    const size_t rb = j->row_bytes, pb = 2 * MQ_Q4_BLOCK;
    const float *dx = j->a->d, *s = j->a->s;
    /* per pair: dx lanes (dx_2p in 0-7, dx_2p+1 in 8-15) and the offset-term activations
     * (0, s_2p, 0, s_2p+1) in every 4 lanes, against the gathered (d_A, m_A, d_B, m_B) of a row */
    uint8_t *scr = (uint8_t *)mq_scratch((size_t)np * 128 + 64);
    __m512 *pv = (__m512 *)(((uintptr_t)scr + 63) & ~(uintptr_t)63);
    const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i sidx = _mm512_setr_epi32(2, 0, 2, 1, 2, 0, 2, 1, 2, 0, 2, 1, 2, 0, 2, 1);
    for (int p = 0; p < np; p++) {
        __m128 v = _mm_setr_ps(s[2 * p], s[2 * p + 1], 0.0f, 0.0f);
        pv[2 * p] = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)))));
        pv[2 * p + 1] = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(v));
    }
    const __m512i perm = _mm512_loadu_si512(PERM_Q4P);
    const __m512i hsel = _mm512_setr_epi32(0, 5, 16, 21, 0, 5, 16, 21, 0, 5, 16, 21, 0, 5, 16, 21);
    /* wv lane 4j + r = d of row r's block (j >= 2): dm lane 4r (A) or 4r + 2 (B) */
    const __m512i dsel = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 2, 6, 10, 14, 2, 6, 10, 14);
    const size_t pd = rb < LEAN_PF ? rb : LEAN_PF, tile = (size_t)NRL * rb;
    const int in_row = tile > LEAN_SHORT_TILE;
    const size_t tile_pf = tile * ((LEAN_TILE_PF + tile - 1) / tile);
    /* the 64-byte loads read 24 bytes past a pair: the tensor's last row goes to the guarded loop */
    const int nf = j->w + (size_t)n1 * rb + 24 > cx->end ? n1 - 1 : n1;
    int n = n0;
    for (; n + NRL <= nf; n += NRL) {
        const uint8_t *r = j->w + (size_t)n * rb;
        if (!in_row) lean_tile_prefetch(r, tile, tile_pf, cx->end);
        __m512 acc = _mm512_setzero_ps(), am = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            const uint8_t *b0 = r + (size_t)p * pb;
            if (in_row) {
                size_t v = (size_t)p * pb + pd;
                size_t pfo = v < rb ? v : v - rb + tile;   /* past the row: same row, next tile */
                for (int i = 0; i < NRL; i++) _mm_prefetch((const char *)(r + i * rb + pfo), LEAN_PF_HINT);
            }
            __m512i v0 = _mm512_loadu_si512((const void *)b0), v1 = _mm512_loadu_si512((const void *)(b0 + rb));
            __m512i v2 = _mm512_loadu_si512((const void *)(b0 + 2 * rb)), v3 = _mm512_loadu_si512((const void *)(b0 + 3 * rb));
            const __m512i z = _mm512_setzero_si512();
            __m512i i0 = _mm512_dpbusd_epi32(z, q4p_levels(v0, perm), xq);
            __m512i i1 = _mm512_dpbusd_epi32(z, q4p_levels(v1, perm), xq);
            __m512i i2 = _mm512_dpbusd_epi32(z, q4p_levels(v2, perm), xq);
            __m512i i3 = _mm512_dpbusd_epi32(z, q4p_levels(v3, perm), xq);
            /* dwords 0 (d_A, m_A) and 5 (d_B, m_B) of each row: rows 0-1 and 2-3, then one ymm */
            __m512i h01 = _mm512_permutex2var_epi32(v0, hsel, v1), h23 = _mm512_permutex2var_epi32(v2, hsel, v3);
            __m256i h = _mm256_inserti128_si256(_mm512_castsi512_si256(h01), _mm512_castsi512_si128(h23), 1);
            __m512 dm = _mm512_cvtph_ps(h);                   /* row r: lanes 4r .. 4r+3 = d_A m_A d_B m_B */
            __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, dm), pv[2 * p]);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(i0, i1, i2, i3)), wv, acc);
            am = _mm512_fmadd_ps(dm, pv[2 * p + 1], am);
        }
        float t[16], u[16];
        _mm512_storeu_ps(t, acc); _mm512_storeu_ps(u, am);
        for (int i = 0; i < NRL; i++)
            j->y[n + i] = ((t[i] + t[4 + i]) + (t[8 + i] + t[12 + i])) + (u[4 * i + 1] + u[4 * i + 3]);
    }
    if (n < n1) mv_fmt(cx, MQ_Q4, j, n, n1);
}

/* ------------------------------------------------------------------ decode: q2c, whole blocks
 * q2c (2-bit codes, a u8 level table per 128-weight block: L = lut[q]; chunk bytes hold codes b,
 * 8 + b, 16 + b, 24 + b at bits 0, 2, 4, 6) through the generic unpack ran at ~3.5 GB/s a thread, the
 * slowest kernel of a MoE decode step (the routed experts' gate/up, docs/moe.md). Here a block of a
 * row is one 32-byte broadcast load (lanes c0 c1 c2 c3 c0 c1 c2 c3, no shuffle): a per-qword shift by
 * (0, 0, 0, 0, 2, 2, 2, 2) puts codes 0-7 of chunk c in qword c and 8-15 in qword 4 + c, a shift by
 * (4, .., 6, ..) codes 16-31, and one vpermb on the block's level table broadcast as a dword
 * (entry i = lut[i & 3]: the bits above a code are ignored) gives the levels. The activations are
 * re-ordered to match once per call (xa). Two vpdpbusd per row and block; the 4 rows' 16 x 16 int32
 * lanes are folded (4 lane shuffles, 4 unpacks, 3 adds) to lane 4k + e = row (e & 1 ? 2 : 0) + (k >> 1),
 * chunk 2 (k & 1) + (e >> 1) of the block, converted once and scaled by d_row x dx_chunk; m x (sum of
 * the block's 4 s) accumulates per row. Tail rows run as a tile of one row repeated: each lane
 * depends on its own row only, so a row's bits do not depend on the tile it falls in. Chunk counts
 * that are not whole blocks take mv_fmt. */
static inline __attribute__((always_inline)) void
q2c_tile(const uint8_t *const rp[4], int nb, const __m512i *xa, const __m512 *dxa, const float *sb,
         float out[4], const size_t pd, const size_t rb, const int in_row, const size_t tile) {
    const __m512i sh0 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2), sh1 = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
    /* d of row(lane) from (d0 m0 d1 m1 d2 m2 d3 m3): lane 4k + e -> 2 row */
    const __m512i dsel = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 2, 6, 2, 6, 2, 6, 2, 6);
    __m512 acc = _mm512_setzero_ps();
    __m256 am = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const size_t o = (size_t)b * MQ_Q2C_BLOCK;
        if (in_row) {
            size_t v = o + pd;
            size_t pfo = v < rb ? v : v - rb + tile;   /* past the row: same row, next tile */
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(rp[i] + pfo), LEAN_PF_HINT);
        }
        __m512i I[4];
        for (int i = 0; i < 4; i++) {
            const uint8_t *B = rp[i] + o;
            const __m512i c = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(B + MQ_Q2C_HEADER)));
            const __m512i lut = _mm512_set1_epi32((int)rd32(B + MQ_Q2C_LUT));
            const __m512i l0 = _mm512_permutexvar_epi8(_mm512_srlv_epi64(c, sh0), lut);
            const __m512i l1 = _mm512_permutexvar_epi8(_mm512_srlv_epi64(c, sh1), lut);
            I[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, xa[2 * b]), l1, xa[2 * b + 1]);
        }
        /* dword d of I[i]: chunk (d >> 1) & 3. Rows 0, 1 (2, 3): 128-bit lanes 0-1 + 2-3 of each */
        const __m512i A = _mm512_add_epi32(_mm512_shuffle_i64x2(I[0], I[1], 0x44), _mm512_shuffle_i64x2(I[0], I[1], 0xEE));
        const __m512i Bv = _mm512_add_epi32(_mm512_shuffle_i64x2(I[2], I[3], 0x44), _mm512_shuffle_i64x2(I[2], I[3], 0xEE));
        const __m512i lo = _mm512_unpacklo_epi32(A, Bv), hi = _mm512_unpackhi_epi32(A, Bv);
        const __m512i R = _mm512_add_epi32(_mm512_unpacklo_epi64(lo, hi), _mm512_unpackhi_epi64(lo, hi));
        const __m128i h = _mm_setr_epi32((int)rd32(rp[0] + o), (int)rd32(rp[1] + o), (int)rd32(rp[2] + o), (int)rd32(rp[3] + o));
        const __m256 dm = _mm256_cvtph_ps(h);   /* d0 m0 d1 m1 d2 m2 d3 m3 */
        const __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, _mm512_castps256_ps512(dm)), dxa[b]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(R), wv, acc);
        am = _mm256_fmadd_ps(dm, _mm256_broadcast_ss(sb + b), am);   /* the d lanes collect junk, never read */
    }
    float t[16], u[8];
    _mm512_storeu_ps(t, acc); _mm256_storeu_ps(u, am);
    /* row 0: lanes 0 2 4 6, row 2: 1 3 5 7, row 1: 8 10 12 14, row 3: 9 11 13 15 */
    static const int base[4] = {0, 8, 1, 9};
    for (int i = 0; i < 4; i++) {
        const float *q = t + base[i];
        out[i] = ((q[0] + q[2]) + (q[4] + q[6])) + u[2 * i + 1];
    }
}

static __attribute__((noinline)) void mv_q2c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const int nb = j->nc / 4;
    const size_t rb = j->row_bytes;
    const float *dx = j->a->d, *s = j->a->s;
    /* per block: the activations in the weights' qword order (2 zmm), dx of chunk(lane), sum of s */
    uint8_t *scr = (uint8_t *)mq_scratch((size_t)nb * 196 + 128);
    __m512i *xa = (__m512i *)(((uintptr_t)scr + 63) & ~(uintptr_t)63);
    __m512 *dxa = (__m512 *)(xa + 2 * nb);
    float *sb = (float *)(dxa + nb);
    for (int b = 0; b < nb; b++) {
        uint8_t *x0 = (uint8_t *)(xa + 2 * b), *x1 = (uint8_t *)(xa + 2 * b + 1);
        const int8_t *xb = q + 128 * b;
        for (int c = 0; c < 4; c++) {
            memcpy(x0 + 8 * c, xb + 32 * c, 8); memcpy(x0 + 32 + 8 * c, xb + 32 * c + 8, 8);
            memcpy(x1 + 8 * c, xb + 32 * c + 16, 8); memcpy(x1 + 32 + 8 * c, xb + 32 * c + 24, 8);
        }
        float f[16];
        for (int l = 0; l < 16; l++) f[l] = dx[4 * b + 2 * ((l >> 2) & 1) + ((l & 3) >> 1)];   /* lane 4k + e: chunk 2 (k & 1) + (e >> 1) */
        dxa[b] = _mm512_loadu_ps(f);
        sb[b] = (s[4 * b] + s[4 * b + 1]) + (s[4 * b + 2] + s[4 * b + 3]);
    }
    const size_t pd = rb < LEAN_PF ? rb : LEAN_PF, tile = (size_t)NRL * rb;
    const int in_row = tile > LEAN_SHORT_TILE;
    const size_t tile_pf = tile * ((LEAN_TILE_PF + tile - 1) / tile);
    float out[4];
    int n = n0;
    for (; n + NRL <= n1; n += NRL) {
        const uint8_t *r = j->w + (size_t)n * rb;
        if (!in_row) lean_tile_prefetch(r, tile, tile_pf, cx->end);
        const uint8_t *rp[4] = {r, r + rb, r + 2 * rb, r + 3 * rb};
        q2c_tile(rp, nb, xa, dxa, sb, out, pd, rb, in_row, tile);
        for (int i = 0; i < 4; i++) j->y[n + i] = out[i];
    }
    for (; n < n1; n++) {
        const uint8_t *r = j->w + (size_t)n * rb;
        const uint8_t *rp[4] = {r, r, r, r};
        q2c_tile(rp, nb, xa, dxa, sb, out, pd, rb, 0, tile);
        j->y[n] = out[0];
    }
}

/* q6 with an even chunk count: mv_q3c's 4-row fold of the float work (lanes 4j + r, j < 2 chunk A
 * of the pair, else chunk B) on mv_lean's q6 unpack; the 4 rows' 8 fp16 scales (d of both blocks)
 * are gathered by scalar loads into one xmm, the offset term (-32 d s) accumulates in one ymm.
 * For the short rows (K = 896: the 0.5B model's attention and lm_head). On by default since the
 * decode prefetch went to L2 (1.02-1.10x end to end on the 0.5B 2356 decode, docs/kernels.md
 * "Prefetch level"); with the old L1 prefetch it lost (0.85-0.9x). MIXQRT_Q6_FOLD=0 or
 * _ops.set_q6_fold(False) selects the unpack path. */
static __attribute__((noinline)) void mv_q6f(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const int np = j->nc / 2;
    const size_t rb = j->row_bytes;
    const float *dx = j->a->d, *s = j->a->s;
    uint8_t *scr = (uint8_t *)mq_scratch((size_t)np * 72 + 128);
    float *sp = (float *)scr;                                   /* -32 s_2p, -32 s_2p+1 */
    __m512 *dxs = (__m512 *)(((uintptr_t)(scr + (size_t)np * 8) + 63) & ~(uintptr_t)63);
    const __m512i didx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i dsel = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);
    for (int p = 0; p < np; p++) {
        sp[2 * p] = -32.0f * s[2 * p]; sp[2 * p + 1] = -32.0f * s[2 * p + 1];
        dxs[p] = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)))));
    }
    const size_t pd = rb < LEAN_PF ? rb : LEAN_PF, tile = (size_t)NRL * rb, pb = 2 * MQ_Q6_BLOCK;
    const int in_row = tile > LEAN_SHORT_TILE;
    const size_t tile_pf = tile * ((LEAN_TILE_PF + tile - 1) / tile);
    int n = n0;
    for (; n + NRL <= n1; n += NRL) {
        const uint8_t *r = j->w + (size_t)n * rb;
        if (!in_row) lean_tile_prefetch(r, tile, tile_pf, cx->end);
        __m512 acc = _mm512_setzero_ps();
        __m256 am = _mm256_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
            const uint8_t *a0 = r + (size_t)p * pb;
            if (in_row) {
                size_t v = (size_t)p * pb + pd;
                size_t pfo = v < rb ? v : v - rb + tile;
                for (int i = 0; i < NRL; i++) _mm_prefetch((const char *)(r + i * rb + pfo), LEAN_PF_HINT);
            }
            const __m512i z = _mm512_setzero_si512();
            __m512i i0 = _mm512_dpbusd_epi32(z, q6_codes(a0), xq);
            __m512i i1 = _mm512_dpbusd_epi32(z, q6_codes(a0 + rb), xq);
            __m512i i2 = _mm512_dpbusd_epi32(z, q6_codes(a0 + 2 * rb), xq);
            __m512i i3 = _mm512_dpbusd_epi32(z, q6_codes(a0 + 3 * rb), xq);
            uint64_t h01 = (uint64_t)(rd32(a0) & 0xffff) | ((uint64_t)(rd32(a0 + MQ_Q6_BLOCK) & 0xffff) << 16)
                         | ((uint64_t)(rd32(a0 + rb) & 0xffff) << 32) | ((uint64_t)(rd32(a0 + rb + MQ_Q6_BLOCK) & 0xffff) << 48);
            uint64_t h23 = (uint64_t)(rd32(a0 + 2 * rb) & 0xffff) | ((uint64_t)(rd32(a0 + 2 * rb + MQ_Q6_BLOCK) & 0xffff) << 16)
                         | ((uint64_t)(rd32(a0 + 3 * rb) & 0xffff) << 32) | ((uint64_t)(rd32(a0 + 3 * rb + MQ_Q6_BLOCK) & 0xffff) << 48);
            __m256 d8 = _mm256_cvtph_ps(_mm_set_epi64x((long long)h23, (long long)h01));   /* d0A d0B d1A d1B ... */
            __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, _mm512_castps256_ps512(d8)), dxs[p]);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(i0, i1, i2, i3)), wv, acc);
            am = _mm256_fmadd_ps(d8, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(sp + 2 * p))), am);
        }
        float t[16], u[8];
        _mm512_storeu_ps(t, acc); _mm256_storeu_ps(u, am);
        for (int i = 0; i < NRL; i++) j->y[n + i] = ((t[i] + t[4 + i]) + (t[8 + i] + t[12 + i])) + (u[2 * i] + u[2 * i + 1]);
    }
    if (n < n1) mv_lean(cx, MQ_Q6, j, n, n1);
}

/* q4x decode (mq_format.h): a group of 16 rows is one contiguous stream; per chunk one 64-byte
 * header load (d, m of the 16 rows) and 4 code loads, each giving 4 code bytes of every row. The
 * low nibbles (v & 0x0f) meet the broadcast activations 4s..4s+3, the high nibbles, kept in place
 * (v & 0xf0: 16x the code), meet 16+4s..19+4s in a second int32 sum that is shifted right by 4 once
 * per chunk (exact: a multiple of 16). Lanes are rows: no shuffles, no horizontal sums, ~30
 * instructions per 512 weights (mv_q4c: ~70). The hardware prefetcher follows the one stream per
 * thread (a software prefetch measured slower, docs/kernels.md "Row-interleaved q4"). Rows
 * [n0, n1) are whole groups (mq_mm_rows). */
static void mv_q4x(const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const int nc = j->nc;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m4h = _mm512_set1_epi8((char)0xf0);
    const size_t pfd = mq_mv_xpf ? mq_q3x_prefetch() : 0;
    const uint8_t *end = j->w + (size_t)n1 * j->row_bytes;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++, b += MQ_Q4X_CHUNK) {
            l2_ahead(b, pfd, MQ_Q4X_CHUNK, end);
            const __m512i h = _mm512_loadu_si512((const void *)b);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            const uint32_t *xc = x32 + 8 * c;
            __m512i il = _mm512_setzero_si512(), ih = _mm512_setzero_si512();
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q4X_CODES + 64 * s));
                il = _mm512_dpbusd_epi32(il, _mm512_and_si512(v, m4), _mm512_set1_epi32((int)xc[s]));
                ih = _mm512_dpbusd_epi32(ih, _mm512_and_si512(v, m4h), _mm512_set1_epi32((int)xc[4 + s]));
            }
            const __m512i is = _mm512_add_epi32(il, _mm512_srai_epi32(ih, 4));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(dx[c])), acc);
            accm = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[c]), accm);
        }
        _mm512_storeu_ps(j->y + g0, _mm512_add_ps(acc, accm));
    }
}

/* q6x decode (mq_format.h): as mv_q4x for the low 4 bits (v & 0x0f: steps 0-3, v & 0xf0 = 16x the
 * bits of steps 4-7); the top 2 bits of step s are field f = s >> 1 of word y = s & 1, taken in place
 * (h & 3 << 2f = 4^f x the bits) into one int32 sum per f, scaled once per chunk; the level offset
 * (-32) goes into the float offset term, as for q6. */
static void mv_q6x(const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const int nc = j->nc;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m4h = _mm512_set1_epi8((char)0xf0);
    const __m512i mf[4] = {_mm512_set1_epi8(0x03), _mm512_set1_epi8(0x0c), _mm512_set1_epi8(0x30), _mm512_set1_epi8((char)0xc0)};
    const size_t pfd = mq_mv_xpf ? mq_q3x_prefetch() : 0;
    const uint8_t *end = j->w + (size_t)n1 * j->row_bytes;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++, b += MQ_Q6X_CHUNK) {
            l2_ahead(b, pfd, MQ_Q6X_CHUNK, end);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
            const uint32_t *xc = x32 + 8 * c;
            const __m512i z = _mm512_setzero_si512();
            __m512i il = z, ih = z, h0 = z, h1 = z, h2 = z, h3 = z;
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q6X_LO + 64 * s));
                il = _mm512_dpbusd_epi32(il, _mm512_and_si512(v, m4), _mm512_set1_epi32((int)xc[s]));
                ih = _mm512_dpbusd_epi32(ih, _mm512_and_si512(v, m4h), _mm512_set1_epi32((int)xc[4 + s]));
            }
            for (int y = 0; y < 2; y++) {
                const __m512i h = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI + 64 * y));
                h0 = _mm512_dpbusd_epi32(h0, _mm512_and_si512(h, mf[0]), _mm512_set1_epi32((int)xc[y]));
                h1 = _mm512_dpbusd_epi32(h1, _mm512_and_si512(h, mf[1]), _mm512_set1_epi32((int)xc[2 + y]));
                h2 = _mm512_dpbusd_epi32(h2, _mm512_and_si512(h, mf[2]), _mm512_set1_epi32((int)xc[4 + y]));
                h3 = _mm512_dpbusd_epi32(h3, _mm512_and_si512(h, mf[3]), _mm512_set1_epi32((int)xc[6 + y]));
            }
            /* sum (lo + 16 hi) x: lo parts exact / 16x; hi field f is 4^f x (multiples: exact shifts) */
            __m512i is = _mm512_add_epi32(il, _mm512_srai_epi32(ih, 4));
            is = _mm512_add_epi32(is, _mm512_add_epi32(_mm512_slli_epi32(h0, 4), _mm512_slli_epi32(h1, 2)));
            is = _mm512_add_epi32(is, _mm512_add_epi32(h2, _mm512_srai_epi32(h3, 2)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(dx[c])), acc);
            accm = _mm512_fmadd_ps(d, _mm512_set1_ps(-32.0f * sx[c]), accm);
        }
        _mm512_storeu_ps(j->y + g0, _mm512_add_ps(acc, accm));
    }
}


/* q3x decode: like mv_q4x, a group of 16 rows per step, lanes are rows. Per 64-weight block 16
 * steps of (2 shifts, 1 bit select, 1 vpermb, 1 vpdpbusd with the broadcast activations k..k+3);
 * steps 0-7 are the block's first activation chunk, 8-15 its second (two activation scales), then
 * the block's d and m as in q3p. */
static void mv_q3x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const int nb = j->nc / 2;
    const __m512i *t3 = cx->t3x;
    const size_t pfd = mq_q3x_prefetch();   /* software prefetch distance into L2 (MIXQRT_Q3X_PF) */
    const uint8_t *end = j->w + (size_t)n1 * j->row_bytes;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int bi = 0; bi < nb; bi++, b += MQ_Q3X_BLOCK) {
            l2_ahead(b, pfd, MQ_Q3X_BLOCK, end);
            const __m512i h = _mm512_loadu_si512((const void *)b);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            const uint32_t *xc = x32 + 16 * bi;
            const __m512i z = _mm512_setzero_si512();
            __m512i a0 = z, a1 = z, b0 = z, b1 = z, lv[16];
            q3x_steps(b, t3, lv);
            for (int i = 0; i < 4; i++) {
                a0 = _mm512_dpbusd_epi32(a0, lv[i], _mm512_set1_epi32((int)xc[i]));
                a1 = _mm512_dpbusd_epi32(a1, lv[4 + i], _mm512_set1_epi32((int)xc[4 + i]));
                b0 = _mm512_dpbusd_epi32(b0, lv[8 + i], _mm512_set1_epi32((int)xc[8 + i]));
                b1 = _mm512_dpbusd_epi32(b1, lv[12 + i], _mm512_set1_epi32((int)xc[12 + i]));
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), _mm512_mul_ps(d, _mm512_set1_ps(dx[2 * bi])), acc);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)), _mm512_mul_ps(d, _mm512_set1_ps(dx[2 * bi + 1])), acc);
            accm = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[2 * bi] + sx[2 * bi + 1]), accm);
        }
        _mm512_storeu_ps(j->y + g0, _mm512_add_ps(acc, accm));
    }
}

/* ------------------------------------------------------------------ few tokens (2 <= T <= MQ_FEW_T = 8) on the
 * interleaved formats: the decode kernels' unpack, each unpacked step feeding the T tokens' vpdpbusd,
 * and per chunk and token the decode kernel's float fold (mv_q4x / mv_q6x / mv_q3x: acc = fma(cvt(isum),
 * dw*dx, acc) and, in a second accumulator, accm = fma(m, s, accm); y = acc + accm), so each row is bit
 * for bit the T = 1 row (the int32 sums are exact in any order). The steps are fully unrolled so that
 * 8 tokens' sums, accumulators and offset sums stay in registers (left to the compiler, 5-8 tokens
 * spilled), and the group stream is prefetched into L2 as mv_q3x does (mq_q3x_prefetch): with up to 8
 * vpdpbusd per loaded line the hardware prefetcher alone left the products of 2-4 rows 1.3-1.5x those
 * of one (docs/lab/kernels-few-rows.md). The GEMM unpacked every group into a VNNI tile in memory for
 * the few tokens that read it: a batched decode step of 2-4 sequences cost about as much as that many
 * single steps. */

static inline __attribute__((always_inline)) void
few_store(const mq_mm_job *j, int g0, const __m512 *acc, const __m512 *accm, const int nt) {
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(j->y + (size_t)t * j->ldy + g0, _mm512_add_ps(acc[t], accm[t]));
}

/* q4x: the low nibbles of step s meet activations 4s..4s+3, the high ones (shifted down once for all
 * tokens) 16+4s..19+4s, into one int32 sum per token: mv_q4x's il + (ih >> 4) exactly */
static inline __attribute__((always_inline)) void mv_q4x_few(const mq_mm_job *j, int n0, int n1, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const size_t pfd = mq_q3x_prefetch();   /* as q3x: software prefetch into L2 */
    const uint8_t *end = j->w + (size_t)j->N * j->row_bytes;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc[MQ_FEW_T], accm[MQ_FEW_T];
        for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
        for (int c = 0; c < j->nc; c++, b += MQ_Q4X_CHUNK) {
            l2_ahead(b, pfd, MQ_Q4X_CHUNK, end);
            const __m512i h = _mm512_loadu_si512((const void *)b);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            __m512i is[MQ_FEW_T];
            for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q4X_CODES + 64 * s));
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int t = 0; t < nt; t++) {
                    const uint32_t *xc = x32 + t * kq + 8 * c;
                    is[t] = _mm512_dpbusd_epi32(is[t], lo, _mm512_set1_epi32((int)xc[s]));
                    is[t] = _mm512_dpbusd_epi32(is[t], hi, _mm512_set1_epi32((int)xc[4 + s]));
                }
            }
            for (int t = 0; t < nt; t++) {
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_mul_ps(d, _mm512_set1_ps(a->d[t * ncp + c])), acc[t]);
                accm[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s[t * ncp + c]), accm[t]);
            }
        }
        few_store(j, g0, acc, accm, nt);
    }
}

static inline __attribute__((always_inline)) void mv_q6x_few(const mq_mm_job *j, int n0, int n1, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const size_t pfd = mq_q3x_prefetch();   /* as q3x: software prefetch into L2 */
    const uint8_t *end = j->w + (size_t)j->N * j->row_bytes;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc[MQ_FEW_T], accm[MQ_FEW_T];
        for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
        for (int c = 0; c < j->nc; c++, b += MQ_Q6X_CHUNK) {
            l2_ahead(b, pfd, MQ_Q6X_CHUNK, end);
            __m512i is[MQ_FEW_T];
            for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {   /* the levels U = lo4 | hi2 << 4 of step s, as the GEMM tile */
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q6X_LO + 64 * (s & 3)));
                const __m512i lo = s < 4 ? _mm512_and_si512(v, m4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                const __m512i h = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI + 64 * (s & 1)));
                const int f = s >> 1;
                const __m512i hs = f == 0 ? _mm512_slli_epi16(h, 4) : f == 1 ? _mm512_slli_epi16(h, 2) : f == 2 ? h : _mm512_srli_epi16(h, 2);
                const __m512i u = _mm512_ternarylogic_epi32(lo, hs, m30, 0xF8);
                for (int t = 0; t < nt; t++)
                    is[t] = _mm512_dpbusd_epi32(is[t], u, _mm512_set1_epi32((int)x32[t * kq + 8 * c + s]));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
            for (int t = 0; t < nt; t++) {   /* mv_q6x: the offset term d * (-32 s) in its own sum */
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_mul_ps(d, _mm512_set1_ps(a->d[t * ncp + c])), acc[t]);
                accm[t] = _mm512_fmadd_ps(d, _mm512_set1_ps(-32.0f * a->s[t * ncp + c]), accm[t]);
            }
        }
        few_store(j, g0, acc, accm, nt);
    }
}

/* q3x: each step's levels are made right before the tokens use them (q3x_steps one step at a time,
 * the planes and level tables read from L1), so that 8 tokens' int32 sums, accumulators and offset
 * sums stay in registers (all 16 level vectors of a block live beside them spilled from 7 tokens on) */
static inline __attribute__((always_inline)) __m512i q3x_step(const uint8_t *b, const __m512i *t3, const int s) {
    const __m512i *pl = (const __m512i *)(b + MQ_Q3X_CODES);
    if (s < 12) return _mm512_permutexvar_epi8(_mm512_loadu_si512(pl + (s >> 1)), t3[(s & 1) ? Q3X_HI : Q3X_LO]);
    const int w = s - 12;
    const __m512i hb = _mm512_srli_epi16(_mm512_loadu_si512(pl + (w < 2 ? 4 : 5)), 4);
    const __m512i lo = _mm512_srli_epi16(_mm512_loadu_si512(pl + w), 6);
    return _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(lo, hb, _mm512_set1_epi8(0x03), 0xE4), t3[(w & 1) ? Q3X_T013 : Q3X_LO]);
}

static inline __attribute__((always_inline)) void
q3x_few_group(const ctx_t *cx, const mq_mm_job *j, int g0, int t0, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q + t0 * kq;
    const float *dx = a->d + t0 * ncp, *sx = a->s + t0 * ncp;
    const int nb = j->nc / 2;
    const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
    const size_t pfd = mq_q3x_prefetch();   /* mv_q3x's software prefetch into L2 (MIXQRT_Q3X_PF) */
    const uint8_t *end = j->w + (size_t)j->N * j->row_bytes;
    __m512 acc[MQ_FEW_T], accm[MQ_FEW_T];
    for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int bi = 0; bi < nb; bi++, b += MQ_Q3X_BLOCK) {
        l2_ahead(b, pfd, MQ_Q3X_BLOCK, end);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {   /* chunk 2 bi + half: q3x steps 8 half .. 8 half + 7 */
            __m512i is[MQ_FEW_T];
            for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                const __m512i lv = q3x_step(b, cx->t3x, 8 * half + s);
                for (int t = 0; t < nt; t++)
                    is[t] = _mm512_dpbusd_epi32(is[t], lv, _mm512_set1_epi32((int)x32[t * kq + 16 * bi + 8 * half + s]));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
            for (int t = 0; t < nt; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_mul_ps(d, _mm512_set1_ps(dx[t * ncp + 2 * bi + half])), acc[t]);
        }
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        for (int t = 0; t < nt; t++)   /* mv_q3x: m against the block's two activation sums at once */
            accm[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t * ncp + 2 * bi] + sx[t * ncp + 2 * bi + 1]), accm[t]);
    }
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(j->y + (size_t)(t0 + t) * j->ldy + g0, _mm512_add_ps(acc[t], accm[t]));
}

#ifndef Q3X_FEW_BLK
#define Q3X_FEW_BLK 8
#endif
static inline __attribute__((always_inline)) void q3x_few_tokens(const ctx_t *cx, const mq_mm_job *j, int g0, int t0, int n) {
    switch (n) {
    case 1: q3x_few_group(cx, j, g0, t0, 1); break;
    case 2: q3x_few_group(cx, j, g0, t0, 2); break;
    case 3: q3x_few_group(cx, j, g0, t0, 3); break;
#if Q3X_FEW_BLK > 4
    case 5: q3x_few_group(cx, j, g0, t0, 5); break;
    case 6: q3x_few_group(cx, j, g0, t0, 6); break;
    case 7: q3x_few_group(cx, j, g0, t0, 7); break;
    case 8: q3x_few_group(cx, j, g0, t0, 8); break;
#endif
    default: q3x_few_group(cx, j, g0, t0, 4); break;
    }
}

static void mv_q3x_few(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const int T = j->T, ta = T <= Q3X_FEW_BLK ? T : (T + 1) / 2;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        q3x_few_tokens(cx, j, g0, 0, ta);
        if (ta < T) q3x_few_tokens(cx, j, g0, ta, T - ta);
    }
}

/* ------------------------------------------------------------------ the entries of the traits table
 * (kern_avx512.c: MQ_AVX512_TRAITS), one per format and kernel family; the format a constant in each, so
 * every entry is the kernel instantiated for it, as the switch on the format that stood here made it. */
#define MV_ENTRY(name, F) \
    void mq_avx512_mv_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_fmt(cx, F, j, n0, n1); }
MQ_FOR_ROW_FORMATS(MV_ENTRY)
#undef MV_ENTRY

/* the lean decode kernels (each its own fold; kern_avx512.c picks one where it fits) */
void mq_avx512_lean_q3c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_q3c(cx, j, n0, n1); }
void mq_avx512_lean_q4c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_q4c(cx, j, n0, n1); }
void mq_avx512_lean_q2c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_q2c(cx, j, n0, n1); }
void mq_avx512_lean_q6f(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_q6f(cx, j, n0, n1); }
void mq_avx512_lean_q3u(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_lean(cx, MQ_Q3U, j, n0, n1); }
void mq_avx512_lean_q6(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_lean(cx, MQ_Q6, j, n0, n1); }

/* the interleaved formats: decode (whole groups only, mq_mm_rows) and 2 <= T <= MQ_FEW_T */
void mq_avx512_mv_q4x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { (void)cx; mv_q4x(j, n0, n1); }
void mq_avx512_mv_q6x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { (void)cx; mv_q6x(j, n0, n1); }
void mq_avx512_mv_q3x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_q3x(cx, j, n0, n1); }

#define FEW_BY_T(CALL) do { \
        switch (j->T) { \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        default: CALL(8); break; \
        } } while (0)
void mq_avx512_few_q4x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    (void)cx;
#define C(T_) mv_q4x_few(j, n0, n1, T_)
    FEW_BY_T(C);
#undef C
}
void mq_avx512_few_q6x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    (void)cx;
#define C(T_) mv_q6x_few(j, n0, n1, T_)
    FEW_BY_T(C);
#undef C
}
void mq_avx512_few_q3x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    /* one instantiation per token count already inside (q3x_few_tokens); the same for every T, as the
     * switch on T that called it gave */
    mv_q3x_few(cx, j, n0, n1);
}
#undef FEW_BY_T
