/* AVX-512 tier, T >= 2: unpacked row tiles (mm_fmt, for kern_avx512.c's rows_exact), the VNNI-interleaved GEMM
 * (prefill and batched decode), its cached tiles (mq_gemm_tiles_build) and the activation layout
 * that _ops shares between the threads of one product. Internals: kern_avx512_impl.h. */
#include "kern_avx512_impl.h"

/* ------------------------------------------------------------------ unpacked row tiles (2 <= T <= MQ_EXACT_T)
 * A tile of TR rows is unpacked once (unpack_pair: levels, dw and mm pairs) and reused for every
 * token; each token's row is folded exactly as mv_fmt folds it (acc = fma(cvt(isum), dw*dx, acc),
 * am = fma(mm, s, am) lane-wise on the pair vectors, y = reduce(acc + am)), so where the T = 1
 * product of a format runs mv_fmt (the plain mq_avx512_mv_* entry) each row is bit for bit the T = 1 row. */
#define TR 4
static inline __attribute__((always_inline)) void
mm_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const mq_act *a = j->a;
    int np = (j->nc + 1) / 2;
    /* per row of the tile: np zmm of levels, np zmm of dw pairs, np zmm of mm pairs */
    uint8_t *buf = (uint8_t *)mq_scratch((size_t)TR * np * 192);
    __m512i *lv = (__m512i *)buf;
    __m512 *dwv = (__m512 *)(buf + (size_t)TR * np * 64);
    __m512 *mmv = (__m512 *)(buf + (size_t)TR * np * 128);
    for (int nt = n0; nt < n1; nt += TR) {
        int nr = n1 - nt < TR ? n1 - nt : TR;
        for (int r = 0; r < nr; r++) {
            const uint8_t *row = j->w + (size_t)(nt + r) * j->row_bytes;
            for (int p = 0; p < np; p++)
                lv[r * np + p] = unpack_pair(cx, fmt, row, p, &dwv[r * np + p], &mmv[r * np + p]);
        }
        for (int t = 0; t < j->T; t++) {
            const int8_t *q = a->q + (size_t)t * a->kp;
            const float *xd = a->d + (size_t)t * a->ncp, *xs = a->s + (size_t)t * a->ncp;
            float *y = j->y + (size_t)t * j->ldy + nt;
            if (nr == TR) {
                __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, m0 = c0, m1 = c0, m2 = c0, m3 = c0;
                const __m512i *l0 = lv, *l1 = lv + np, *l2 = lv + 2 * np, *l3 = lv + 3 * np;
                const __m512 *w0 = dwv, *w1 = dwv + np, *w2 = dwv + 2 * np, *w3 = dwv + 3 * np;
                const __m512 *v0 = mmv, *v1 = mmv + np, *v2 = mmv + 2 * np, *v3 = mmv + 3 * np;
                for (int p = 0; p < np; p++) {
                    __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p)), corr = q8_corr(fmt, xq);
                    __m512 dx = pairvec(xd[2 * p], xd[2 * p + 1]), sx = _mm512_maskz_mov_ps(0x0101, pairvec(xs[2 * p], xs[2 * p + 1]));
                    const __m512i z = _mm512_setzero_si512();
                    c0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l0[p], xq), corr)), _mm512_mul_ps(w0[p], dx), c0);
                    c1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l1[p], xq), corr)), _mm512_mul_ps(w1[p], dx), c1);
                    c2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l2[p], xq), corr)), _mm512_mul_ps(w2[p], dx), c2);
                    c3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l3[p], xq), corr)), _mm512_mul_ps(w3[p], dx), c3);
                    m0 = _mm512_fmadd_ps(v0[p], sx, m0);
                    m1 = _mm512_fmadd_ps(v1[p], sx, m1);
                    m2 = _mm512_fmadd_ps(v2[p], sx, m2);
                    m3 = _mm512_fmadd_ps(v3[p], sx, m3);
                }
                y[0] = _mm512_reduce_add_ps(_mm512_add_ps(c0, m0));
                y[1] = _mm512_reduce_add_ps(_mm512_add_ps(c1, m1));
                y[2] = _mm512_reduce_add_ps(_mm512_add_ps(c2, m2));
                y[3] = _mm512_reduce_add_ps(_mm512_add_ps(c3, m3));
            } else {
                for (int r = 0; r < nr; r++) {
                    __m512 c0 = _mm512_setzero_ps(), m0 = c0;
                    for (int p = 0; p < np; p++) {
                        __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
                        __m512 dx = pairvec(xd[2 * p], xd[2 * p + 1]), sx = _mm512_maskz_mov_ps(0x0101, pairvec(xs[2 * p], xs[2 * p + 1]));
                        c0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[r * np + p], xq), q8_corr(fmt, xq))),
                                             _mm512_mul_ps(dwv[r * np + p], dx), c0);
                        m0 = _mm512_fmadd_ps(mmv[r * np + p], sx, m0);
                    }
                    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(c0, m0));
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ GEMM (T >= mq_gemm_min_t): prefill and batched decode
 * For a tile of GR = 16 weight rows and a K slice of GKS chunks, the levels are unpacked once into
 * a VNNI-interleaved tile: for every k4 step (4 consecutive k) one zmm holds 16 rows x 4 bytes.
 * The activations of a group of gt tokens (2 for T <= 2, 4 for T <= 4, else GTT) are interleaved the
 * same way (per k4 step, gt u32), so the micro-kernel is, per k4 step, one weight load and gt
 * vpdpbusd with an embedded {1to16} broadcast of the token's 4 activation bytes; per chunk the int32
 * sums of the 16 rows are folded into float accumulators: acc = fma(cvt(isum), dw*dx, acc);
 * acc = fma(mm, s, acc) (the generic tier's order). Tokens are padded to a multiple of gt with zero
 * activations (no stores). */
#define GR 16
#define GKS 16
#define CB 160   /* one chunk of a tile, in u32: levels [8 k4 steps][16 rows], dw[16], mm[16] (640 B) */

/* xf: the float fold. 0 (row formats): acc = fma(cvt(isum), dw*dx, acc); acc = fma(mm, s, acc) (the
 * generic tier's order). 1 (q4x, q6x): the decode kernels' (mv_q4x, mv_q6x): the offset term in a
 * second accumulator, accm = fma(mm, s, accm) (q6x: mm = -32 dw and mm * s = dw * (-32 s) exactly, both
 * scalings by a power of two), y = acc + accm. 2 (q3x, mv_q3x): as 1, but the offset term once per
 * block (the even chunk; both chunks of a block carry its m) against s_c + s_c+1. With 1 and 2 every
 * row is bit for bit the T = 1 row. accb: the gt accumulators, then (xf) the gt offset sums. */
/* xf: the float fold. 0 (row formats): acc = fma(cvt(isum), dw*dx, acc); acc = fma(mm, s, acc) (the
 * generic tier's order). 1 (q4x, q6x): the decode kernels' (mv_q4x, mv_q6x): the offset term in a
 * second accumulator, accm = fma(mm, s, accm) (q6x: mm = -32 dw and mm * s = dw * (-32 s) exactly, both
 * scalings by a power of two), y = acc + accm. 2 (q3x, mv_q3x): as 1, but the offset term once per
 * block, on its even chunk, against s_c + s_c+1 (gemm_interleave stores that sum there). With 1 and 2
 * every row is bit for bit the T = 1 row. accb: the gt accumulators, then (xf) the gt offset sums. */
static inline __attribute__((always_inline)) void
gemm_chunk(const uint32_t *tb, int c, int pf, const uint32_t *qb, const float *db, const float *sb, const int32_t *qsb,
           __m512 *acc, __m512 *accm, const int gt, const int xf, const int with_m) {
    const uint32_t *cb = tb + (size_t)c * CB;
    if (pf) {   /* cached tiles stream from memory (the unpacked scratch tile is in L1 already) */
        _mm_prefetch((const char *)(cb + 4 * CB), _MM_HINT_T0);
        _mm_prefetch((const char *)(cb + 4 * CB) + 320, _MM_HINT_T0);
    }
    const __m512i *w = (const __m512i *)cb;
    const uint32_t *qc = qb + (size_t)c * 8 * gt;
    __m512i is[GTT];
    __m512i w0 = _mm512_load_si512(w);
    for (int i = 0; i < gt; i++) is[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_set1_epi32((int)qc[i]));
    for (int s = 1; s < 8; s++) {
        __m512i ws = _mm512_load_si512(w + s);
        for (int i = 0; i < gt; i++) is[i] = _mm512_dpbusd_epi32(is[i], ws, _mm512_set1_epi32((int)qc[s * gt + i]));
    }
    __m512 dw = _mm512_load_ps((const float *)cb + 128), mm = _mm512_load_ps((const float *)cb + 144);
    if (qsb)   /* q8: 128 * sum(q) of the chunk, see q8_fix */
        for (int i = 0; i < gt; i++) is[i] = _mm512_sub_epi32(is[i], _mm512_set1_epi32(qsb[c * gt + i]));
    for (int i = 0; i < gt; i++) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i]), _mm512_mul_ps(dw, _mm512_set1_ps(db[c * gt + i])), acc[i]);
        if (xf == 0) acc[i] = _mm512_fmadd_ps(mm, _mm512_set1_ps(sb[c * gt + i]), acc[i]);
        else if (with_m) accm[i] = _mm512_fmadd_ps(mm, _mm512_set1_ps(sb[c * gt + i]), accm[i]);
    }
}

static inline __attribute__((always_inline)) void
gemm_kernel(const uint32_t *tb, int nch, int pf,
            const uint32_t *qb, const float *db, const float *sb, const int32_t *qsb, float *accb, int first, const int gt,
            const int xf) {
    __m512 acc[GTT], accm[GTT];
    for (int i = 0; i < gt; i++) {
        acc[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(accb + 16 * i);
        accm[i] = first || !xf ? _mm512_setzero_ps() : _mm512_load_ps(accb + 16 * (gt + i));
    }
    if (xf == 2)   /* q3x: nch is even (K slices start on whole blocks) */
        for (int c = 0; c < nch; c += 2) {
            gemm_chunk(tb, c, pf, qb, db, sb, qsb, acc, accm, gt, xf, 1);
            gemm_chunk(tb, c + 1, pf, qb, db, sb, qsb, acc, accm, gt, xf, 0);
        }
    else
        for (int c = 0; c < nch; c++) gemm_chunk(tb, c, pf, qb, db, sb, qsb, acc, accm, gt, xf, 1);
    for (int i = 0; i < gt; i++) {
        _mm512_store_ps(accb + 16 * i, acc[i]);
        if (xf) _mm512_store_ps(accb + 16 * (gt + i), accm[i]);
    }
}

/* 16x16 transpose of 32-bit elements: v[r] lane j -> v[j] lane r */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);       /* r0 r1 pairs of dwords 0,1 (per 128-bit lane) */
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);   /* dwords 2,3 */
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);       /* rows i..i+3, dword 0 of each lane */
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);   /* dword 1 */
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); /* dword 2 */
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]); /* dword 3 */
    }
    /* now v[4g + d] holds, in 128-bit lane L, rows 4g..4g+3 at dword 4L + d; move the lanes */
    for (int d = 0; d < 4; d++) {
        __m512i a = v[d], b = v[4 + d], c = v[8 + d], e = v[12 + d];
        __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x44), ab_hi = _mm512_shuffle_i32x4(a, b, 0xEE);
        __m512i ce_lo = _mm512_shuffle_i32x4(c, e, 0x44), ce_hi = _mm512_shuffle_i32x4(c, e, 0xEE);
        t[d] = _mm512_shuffle_i32x4(ab_lo, ce_lo, 0x88);        /* lane 0 of a, b, c, e: dword d */
        t[4 + d] = _mm512_shuffle_i32x4(ab_lo, ce_lo, 0xDD);    /* lane 1: dword 4 + d */
        t[8 + d] = _mm512_shuffle_i32x4(ab_hi, ce_hi, 0x88);    /* lane 2: dword 8 + d */
        t[12 + d] = _mm512_shuffle_i32x4(ab_hi, ce_hi, 0xDD);   /* lane 3: dword 12 + d */
    }
    for (int i = 0; i < 16; i++) v[i] = t[i];
}

/* Pair p (chunks c, c+1 of the K slice) of nr <= GR rows starting at w (stride rb) into the
 * VNNI-interleaved tile tb (CB u32 per chunk): tb[c*CB + s*GR + r] = the 4 levels of row r at k4 step s,
 * then the chunk's dw[r] and mm[r] (as float); rows nr..GR-1 get zeros. Each row's 64 levels are unpacked in one zmm and the 16 rows
 * transposed as 16x16 dwords: ~6x fewer instructions than storing the tile element by element,
 * which made the unpack cost more than the products for 2-16 tokens (docs/kernels.md). */
static inline __attribute__((always_inline)) void
gemm_unpack_pair(const ctx_t *cx, const int fmt, const uint8_t *w, size_t rb, int nr, int p, int c,
                 uint32_t *tb) {
    __m512i v[16];
    __m512 dA = _mm512_setzero_ps(), dB = dA, mA = dA, mB = dA;
    /* q3p/q3u/q6 (the formats with most of the bytes): the 16 rows' fp16 scales by one gather per
     * chunk instead of 4 lane moves per row */
    const int gs = (fmt == MQ_Q3P || fmt == MQ_Q3U || fmt == MQ_Q6) && rb <= (size_t)(INT32_MAX / GR);
    for (int r = 0; r < GR; r++) {
        if (r >= nr) { v[r] = _mm512_setzero_si512(); continue; }
        __m512 dv, mv;
        v[r] = unpack_pair(cx, fmt, w + (size_t)r * rb, p, &dv, &mv);
        if (gs) continue;
        const __mmask16 k = (__mmask16)(1u << r);
        dA = _mm512_mask_broadcastss_ps(dA, k, _mm512_castps512_ps128(dv));
        dB = _mm512_mask_broadcastss_ps(dB, k, _mm512_extractf32x4_ps(dv, 2));
        mA = _mm512_mask_broadcastss_ps(mA, k, _mm512_castps512_ps128(mv));
        mB = _mm512_mask_broadcastss_ps(mB, k, _mm512_extractf32x4_ps(mv, 2));
    }
    if (gs) {
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)rb));
        const __mmask16 km = (__mmask16)((1u << nr) - 1);
        const __m512i z = _mm512_setzero_si512();
        if (fmt == MQ_Q6) {
            const uint8_t *A = w + (size_t)(2 * p) * MQ_Q6_BLOCK;
            dA = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(z, km, idx, A, 1)));
            mA = _mm512_mul_ps(dA, _mm512_set1_ps(-32.0f));
            if (2 * p + 1 < cx->nc) {
                dB = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(z, km, idx, A + MQ_Q6_BLOCK, 1)));
                mB = _mm512_mul_ps(dB, _mm512_set1_ps(-32.0f));
            }
        } else {   /* one (d, m) per 64-weight block: the same for both chunks */
            __m512i g = _mm512_mask_i32gather_epi32(z, km, idx, w + (size_t)p * MQ_Q3_BLOCK, 1);
            dA = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            mA = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
            if (2 * p + 1 < cx->nc) { dB = dA; mB = mA; }
        }
    }
    transpose16_epi32(v);
    uint32_t *a = tb + (size_t)c * CB, *b = a + CB;
    for (int s = 0; s < 8; s++) _mm512_store_si512((__m512i *)(a + s * GR), v[s]);
    for (int s = 0; s < 8; s++) _mm512_store_si512((__m512i *)(b + s * GR), v[8 + s]);
    _mm512_store_ps((float *)a + 128, dA); _mm512_store_ps((float *)a + 144, mA);
    _mm512_store_ps((float *)b + 128, dB); _mm512_store_ps((float *)b + 144, mB);
}

/* Chunk c of a q4x group (grp: the group's first byte) into the tile chunk tb (CB u32): its code
 * words already are the tile's k4 steps (low nibbles: steps 0-3, high nibbles: steps 4-7) */
static inline __attribute__((always_inline)) void gemm_unpack_q4x(const uint8_t *grp, int c, uint32_t *tb) {
    const uint8_t *b = grp + (size_t)c * MQ_Q4X_CHUNK;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int s = 0; s < 4; s++) {
        const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q4X_CODES + 64 * s));
        _mm512_store_si512((__m512i *)(tb + s * GR), _mm512_and_si512(v, m4));
        _mm512_store_si512((__m512i *)(tb + (4 + s) * GR), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
    const __m512i h = _mm512_loadu_si512((const void *)b);
    _mm512_store_ps((float *)tb + 128, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    _mm512_store_ps((float *)tb + 144, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
}

/* Chunk c of a q6x group into the tile chunk tb: levels U = lo4 | hi2 << 4 per step */
static inline __attribute__((always_inline)) void gemm_unpack_q6x(const uint8_t *grp, int c, uint32_t *tb) {
    const uint8_t *b = grp + (size_t)c * MQ_Q6X_CHUNK;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i h0 = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI)), h1 = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI + 64));
    for (int s = 0; s < 8; s++) {
        const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q6X_LO + 64 * (s & 3)));
        const __m512i lo = s < 4 ? _mm512_and_si512(v, m4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        const __m512i h = (s & 1) ? h1 : h0;
        const int f = s >> 1;   /* field f at bits 2f..2f+1 -> bits 4-5 */
        const __m512i hs = f == 0 ? _mm512_slli_epi16(h, 4) : f == 1 ? _mm512_slli_epi16(h, 2) : f == 2 ? h : _mm512_srli_epi16(h, 2);
        _mm512_store_si512((__m512i *)(tb + s * GR), _mm512_ternarylogic_epi32(lo, hs, m30, 0xF8));   /* lo | (hs & 0x30) */
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    _mm512_store_ps((float *)tb + 128, d);
    _mm512_store_ps((float *)tb + 144, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)));
}

/* Block bi of a q3x group into tile chunks 2 bi and 2 bi + 1 (tb: the first; CB u32 each): step s of
 * the first chunk is q3x step s, of the second q3x step 8 + s; both chunks take the block's d and m */
static inline __attribute__((always_inline)) void gemm_unpack_q3x(const ctx_t *cx, const uint8_t *grp, int bi, uint32_t *tb) {
    const uint8_t *b = grp + (size_t)bi * MQ_Q3X_BLOCK;
    __m512i lv[16];
    q3x_steps(b, cx->t3x, lv);
    for (int s = 0; s < 8; s++) {
        _mm512_store_si512((__m512i *)(tb + s * GR), lv[s]);
        _mm512_store_si512((__m512i *)(tb + CB + s * GR), lv[8 + s]);
    }
    const __m512i h = _mm512_loadu_si512((const void *)b);
    const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    _mm512_store_ps((float *)tb + 128, d); _mm512_store_ps((float *)tb + 144, m);
    _mm512_store_ps((float *)(tb + CB) + 128, d); _mm512_store_ps((float *)(tb + CB) + 144, m);
}

/* The GEMM's activation layout for token groups of gt: the int8 codes as u32 [group][k4][token],
 * then dx, the activation sums and (q8) 128 x the chunk sums, each [group][chunk][token] and rounded
 * to 64 B (the tile after them takes aligned stores). Returns the bytes of the four parts. */
static size_t gemm_act_layout(const mq_act *a, int gt, size_t *qbytes, size_t *dbytes) {
    const size_t ng = (size_t)(a->T + gt - 1) / gt;
    *qbytes = ng * (size_t)(a->kp / 4) * gt * 4;
    *dbytes = (ng * (size_t)a->ncp * gt * 4 + 63) & ~(size_t)63;
    return *qbytes + 3 * *dbytes;
}

/* groups [g0, g1) of that layout into out (zero tokens pad the last group) */
static void gemm_interleave(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out) {
    size_t qbytes, dbytes;
    gemm_act_layout(a, gt, &qbytes, &dbytes);
    const int T = a->T, k4 = a->kp / 4, ncp = a->ncp;
    uint32_t *qp = (uint32_t *)out;
    float *dxp = (float *)(out + qbytes), *sxp = (float *)(out + qbytes + dbytes);
    int32_t *qsp = (int32_t *)(out + qbytes + 2 * dbytes);
    for (int g = g0; g < g1; g++) {
        uint32_t *o = qp + (size_t)g * k4 * gt;
        float *od = dxp + (size_t)g * ncp * gt, *os = sxp + (size_t)g * ncp * gt;
        for (int i = 0; i < gt; i++) {
            int t = g * gt + i;
            if (t < T) {
                const uint32_t *q = (const uint32_t *)(a->q + (size_t)t * a->kp);
                const float *xd = a->d + (size_t)t * ncp, *xs = a->s + (size_t)t * ncp;
                for (int kk = 0; kk < k4; kk++) o[(size_t)kk * gt + i] = q[kk];
                for (int c = 0; c < ncp; c++) { od[c * gt + i] = xd[c]; os[c * gt + i] = xs[c]; }
                if (fmt == MQ_Q3X)   /* gemm_kernel's q3x fold: a block's two sums on its even chunk */
                    for (int c = 0; c + 1 < ncp; c += 2) os[c * gt + i] = xs[c] + xs[c + 1];
                if (fmt == MQ_Q8)
                    for (int c = 0; c < ncp; c++) {
                        const int8_t *qc = a->q + (size_t)t * a->kp + 32 * c;
                        int32_t sum = 0;
                        for (int e = 0; e < 32; e++) sum += qc[e];
                        qsp[((size_t)g * ncp + c) * gt + i] = 128 * sum;
                    }
            } else {
                for (int kk = 0; kk < k4; kk++) o[(size_t)kk * gt + i] = 0;
                for (int c = 0; c < ncp; c++) { od[c * gt + i] = 0.0f; os[c * gt + i] = 0.0f; qsp[((size_t)g * ncp + c) * gt + i] = 0; }
            }
        }
    }
}

static inline __attribute__((always_inline)) void
gemm_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1, const int gt) {
    const mq_act *a = j->a;
    const int nc = j->nc, T = j->T, ng = (T + gt - 1) / gt, k4 = a->kp / 4, ncp = a->ncp;
    const int shared = a->il != NULL && a->il_gt == gt;   /* interleaved once for every thread */
    size_t qbytes, dbytes, abytes = (size_t)ng * gt * 128, tile = (size_t)GKS * CB * 4;
    const size_t ilbytes = gemm_act_layout(a, gt, &qbytes, &dbytes);
    uint8_t *buf = (uint8_t *)mq_scratch((shared ? 0 : ilbytes) + tile + abytes + 256);
    const uint8_t *il = shared ? a->il : buf;
    const uint32_t *qp = (const uint32_t *)il;
    const float *dxp = (const float *)(il + qbytes), *sxp = (const float *)(il + qbytes + dbytes);
    const int32_t *qsp = (const int32_t *)(il + qbytes + 2 * dbytes);
    uint32_t *tileb = (uint32_t *)(shared ? buf : buf + ilbytes);
    float *accb = (float *)(((uintptr_t)((uint8_t *)tileb + tile) + 63) & ~(uintptr_t)63);
    if (!shared) gemm_interleave(a, fmt, gt, 0, ng, buf);
    const int cached = j->tiles != NULL && n0 % GR == 0;
    const int xf = fmt == MQ_Q4X || fmt == MQ_Q6X ? 1 : fmt == MQ_Q3X ? 2 : 0;   /* gemm_kernel's fold */
    const size_t tstride = mq_gemm_tile_stride(nc);
    for (int nt = n0; nt < n1; nt += GR) {
        int nr = n1 - nt < GR ? n1 - nt : GR;
        __mmask16 smask = (__mmask16)((1u << nr) - 1);
        const uint8_t *tb = cached ? j->tiles + (size_t)(nt / GR) * tstride : NULL;
        for (int c0 = 0; c0 < nc; c0 += GKS) {
            int nch = nc - c0 < GKS ? nc - c0 : GKS;
            const uint32_t *tl = tileb;
            if (cached)     /* the tensor's cached tiles: no unpack (the same bytes as below) */
                tl = (const uint32_t *)tb + (size_t)c0 * CB;
            else if (fmt == MQ_Q4X)
                for (int c = c0; c < c0 + nch; c++) gemm_unpack_q4x(j->w + (size_t)nt * j->row_bytes, c, tileb + (size_t)(c - c0) * CB);
            else if (fmt == MQ_Q6X)
                for (int c = c0; c < c0 + nch; c++) gemm_unpack_q6x(j->w + (size_t)nt * j->row_bytes, c, tileb + (size_t)(c - c0) * CB);
            else if (fmt == MQ_Q3X)   /* GKS is even: K slices start on whole blocks */
                for (int c = c0; c < c0 + nch; c += 2) gemm_unpack_q3x(cx, j->w + (size_t)nt * j->row_bytes, c / 2, tileb + (size_t)(c - c0) * CB);
            else
                for (int p = c0 / 2; 2 * p < c0 + nch; p++)
                    gemm_unpack_pair(cx, fmt, j->w + (size_t)nt * j->row_bytes, j->row_bytes, nr, p, 2 * p - c0, tileb);
            int first = c0 == 0, last = c0 + nch >= nc;
            for (int g = 0; g < ng; g++) {
                float *ab = accb + (size_t)g * gt * 32;
                gemm_kernel(tl, nch, cached && g == 0, qp + ((size_t)g * k4 + (size_t)c0 * 8) * gt,
                            dxp + ((size_t)g * ncp + c0) * gt, sxp + ((size_t)g * ncp + c0) * gt,
                            fmt == MQ_Q8 ? qsp + ((size_t)g * ncp + c0) * gt : NULL, ab, first, gt, xf);
                if (last)
                    for (int i = 0; i < gt && g * gt + i < T; i++) {
                        __m512 r = _mm512_load_ps(ab + 16 * i);
                        if (xf) r = _mm512_add_ps(r, _mm512_load_ps(ab + 16 * (gt + i)));
                        _mm512_mask_storeu_ps(j->y + (size_t)(g * gt + i) * j->ldy + nt, smask, r);
                    }
            }
        }
    }
}

static inline __attribute__((always_inline)) void
tiles_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, uint8_t *out, int n0, int n1) {
    const size_t stride = mq_gemm_tile_stride(j->nc);
    _Static_assert(CB * 4 == 8 * 16 * 4 + 2 * 16 * 4, "mq_gemm_tile_stride's chunk size");
    for (int nt = n0; nt < n1; nt += GR) {
        uint32_t *tb = (uint32_t *)(out + (size_t)(nt / GR) * stride);
        int nr = n1 - nt < GR ? n1 - nt : GR;
        if (fmt == MQ_Q4X) {   /* whole groups; an odd chunk count's last tile chunk stays as for q4: zeros */
            for (int c = 0; c < j->nc; c++) gemm_unpack_q4x(j->w + (size_t)nt * j->row_bytes, c, tb + (size_t)c * CB);
            if (j->nc & 1) memset(tb + (size_t)j->nc * CB, 0, CB * 4);
            continue;
        }
        if (fmt == MQ_Q3X) {
            for (int c = 0; c < j->nc; c += 2) gemm_unpack_q3x(cx, j->w + (size_t)nt * j->row_bytes, c / 2, tb + (size_t)c * CB);
            continue;
        }
        if (fmt == MQ_Q6X) {
            for (int c = 0; c < j->nc; c++) gemm_unpack_q6x(j->w + (size_t)nt * j->row_bytes, c, tb + (size_t)c * CB);
            if (j->nc & 1) memset(tb + (size_t)j->nc * CB, 0, CB * 4);
            continue;
        }
        for (int p = 0; 2 * p < j->nc; p++)
            gemm_unpack_pair(cx, fmt, j->w + (size_t)nt * j->row_bytes, j->row_bytes, nr, p, 2 * p, tb);
    }
}

size_t mq_gemm_act_bytes_avx512(const mq_act *a, int gt) {
    size_t q, d;
    return gemm_act_layout(a, gt, &q, &d);
}

void mq_gemm_interleave_avx512(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out) {
    gemm_interleave(a, fmt, gt, g0, g1, out);
}

/* ------------------------------------------------------------------ the entries of the traits table
 * (kern_avx512.c: MQ_AVX512_TRAITS), one per format and kernel family, the format a constant in each;
 * gt too: a runtime gt left acc[]/is[] in memory (1.7x slower at T = 128) */
#define GEMM_ENTRIES(name, F) \
    void mq_avx512_gemm2_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { gemm_fmt(cx, F, j, n0, n1, 2); } \
    void mq_avx512_gemm4_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { gemm_fmt(cx, F, j, n0, n1, 4); } \
    void mq_avx512_gemm8_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { gemm_fmt(cx, F, j, n0, n1, GTT); } \
    void mq_avx512_tiles_##name(const ctx_t *cx, const mq_mm_job *j, uint8_t *out, int n0, int n1) { \
        tiles_fmt(cx, F, j, out, n0, n1); }
/* a row format: also its unpacked row tiles (mv_fmt's fold, for kern_avx512.c's rows_exact) */
#define ROW_ENTRIES(name, F) GEMM_ENTRIES(name, F) \
    void mq_avx512_mm_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mm_fmt(cx, F, j, n0, n1); }
_Static_assert(GTT == 8, "mq_avx512_gemm8_*: the GEMM's largest token group");
MQ_FOR_ROW_FORMATS(ROW_ENTRIES)
MQ_FOR_X_FORMATS(GEMM_ENTRIES)
#undef ROW_ENTRIES
#undef GEMM_ENTRIES
