/* AVX-512 tier (F/BW/VL/DQ + VNNI + VBMI): every packed format is unpacked two chunks (64 codes)
 * at a time into one zmm of u8 levels with a broadcast, a per-qword shift and a mask (+ vpshufb for
 * table levels), then multiplied with the int8 activations by vpdpbusd. Decode (T == 1) runs fused
 * from the packed bytes; 1 < T < mq_gemm_min_t unpacks a 4-row tile once and reuses it for every token;
 * T >= mq_gemm_min_t (default 8) runs the VNNI-interleaved GEMM (gemm_fmt, see docs/kernels.md) in
 * token groups of 2, 4 or 8, which serves batched decode as well as prefill. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mq_ops.h"

/* byte offsets inside a block that the shuffle tables below (PERM_Q3U, PERM_Q6, pw16) hard-wire */
#define Q3_C0 MQ_Q3_HEADER                                  /* q3 chunk 0 */
#define Q3_C1 (MQ_Q3_HEADER + MQ_CHUNK_BYTES(MQ_Q3_BITS))   /* q3 chunk 1 */
#define Q6_HI (MQ_Q6_HEADER + MQ_PACK6_HI)                  /* q6 2-bit plane */
_Static_assert(Q3_C0 == 4 && Q3_C1 == 16 && MQ_PACK3_HI == 8, "PERM_Q3U indexes q3 block bytes 4-27");
_Static_assert(Q6_HI == 18 && MQ_Q6_BLOCK == 26, "PERM_Q6 / pw16 index two q6 blocks of 26 bytes");

void *mq_scratch(size_t n);

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float h2f(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return _cvtsh_ss(v); }

/* ------------------------------------------------------------------ activations */
void mq_quantize_act_avx512(const float *x, int K, int kp, int8_t *q, float *d, float *s) {
    const __m512 sgn = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int c = 0; c < kp / 32; c++) {
        int k0 = c * 32, n = K - k0;
        if (n <= 0) { memset(q + k0, 0, 32); d[c] = 0.0f; s[c] = 0.0f; continue; }
        __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        __mmask16 m1 = n >= 32 ? 0xffff : (n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1));
        __m512 a = _mm512_maskz_loadu_ps(m0, x + k0), b = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sgn), _mm512_and_ps(b, sgn)));
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid)), ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
        _mm_storeu_si128((__m128i *)(q + k0), _mm512_cvtsepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q + k0 + 16), _mm512_cvtsepi32_epi8(ib));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
        d[c] = dd; s[c] = dd * (float)sum;
    }
}

/* ------------------------------------------------------------------ unpack two chunks */
typedef struct {
    int fmt, nc;
    __m512i tab;     /* q3p levels in every 128-bit lane */
    __m512i tab64;   /* q3p levels at every index i (level of i & 7): a vpermb table */
    const __m512i *t3x; /* q3x: the level tables of q3x_steps (Q3X_LO, Q3X_HI, Q3X_T013) */
    __m512i p3lo, p3hi, p6lo, p6hi, pw16, bitsel;
    const uint8_t *end;  /* one past the last byte of the tensor's rows */
    float q5_lo, q5_step;
} ctx_t;

/* chunks 2p and 2p+1 of a row -> u8 levels (zmm bytes 0-31 chunk 2p, 32-63 chunk 2p+1), and the
 * scale vectors dv (dw of chunk A in lanes 0-7, of chunk B in lanes 8-15) and mv (mm = m - off*dw,
 * same lanes). A missing second chunk (odd nc) gets dw = mm = 0; its activations are zero padding. */
static inline __m256i h16x2(const uint8_t *a, const uint8_t *b) {
    uint16_t x, y;
    memcpy(&x, a, 2); memcpy(&y, b, 2);
    return _mm256_mask_set1_epi16(_mm256_set1_epi16((short)x), 0xff00, (short)y);
}

static const uint8_t PERM_Q3U[2][64] = {
    { 4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,
     16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23},
    {12,12,12,12,12,12,12,12, 13,13,13,13,13,13,13,13, 14,14,14,14,14,14,14,14, 15,15,15,15,15,15,15,15,
     24,24,24,24,24,24,24,24, 25,25,25,25,25,25,25,25, 26,26,26,26,26,26,26,26, 27,27,27,27,27,27,27,27}};
static const uint8_t PERM_Q6[2][64] = {
    { 2, 3, 4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,  2, 3, 4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,
     28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43, 28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43},
    {18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25,
     44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51}};
static const uint8_t BITSEL[64] = {
    1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128,
    1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128};

/* q3p (pack3c): a block's 64 codes are 24 contiguous bytes (code i at bits 3i..3i+2); vpermb gives
 * qword j the 3 bytes of codes 8j..8j+7, vpmultishiftqb puts code 8j+b in the low bits of byte b
 * (the bits above it are the next codes) and a vpermb on the 64-entry table (level of i & 7 at
 * every i) reads the levels. v: bytes 0-27 of the block (header first) in the low 256 bits. */
static const uint8_t SPREAD_Q3C[64] = {
     4, 5, 6, 7, 7, 7, 7, 7,  7, 8, 9,10,10,10,10,10, 10,11,12,13,13,13,13,13, 13,14,15,16,16,16,16,16,
    16,17,18,19,19,19,19,19, 19,20,21,22,22,22,22,22, 22,23,24,25,25,25,25,25, 25,26,27,27,27,27,27,27};
_Static_assert(MQ_Q3_HEADER == 4 && MQ_Q3_BLOCK == 28, "SPREAD_Q3C indexes q3 block bytes 4-27");
static inline __attribute__((always_inline)) __m512i q3c_levels(__m256i v, __m512i tab64) {
    __m512i x = _mm512_permutexvar_epi8(_mm512_loadu_si512(SPREAD_Q3C), _mm512_castsi256_si512(v));
    x = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x15120f0c09060300LL), x);
    return _mm512_permutexvar_epi8(x, tab64);
}

static inline __attribute__((always_inline)) __m512i
unpack_pair(const ctx_t *cx, const int fmt, const uint8_t *row, int p, __m512 *dv, __m512 *mv) {
    const __m512i m3 = _mm512_set1_epi8(3), m15 = _mm512_set1_epi8(15);
    const __m512i sh2 = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i sh4 = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    int two = 2 * p + 1 < cx->nc;
    switch (fmt) {
    case MQ_Q8: {
        const uint8_t *A = row + (size_t)(2 * p) * MQ_Q8_BLOCK, *B = two ? A + MQ_Q8_BLOCK : A;
        __m512 d = _mm512_cvtph_ps(h16x2(A, B));
        if (!two) d = _mm512_maskz_mov_ps(0x00ff, d);
        *dv = d; *mv = _mm512_setzero_ps();   /* the consumers subtract 128 * sum(q) in integers (q8_fix) */
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(A + MQ_Q8_HEADER))),
                                       _mm256_loadu_si256((const __m256i *)(B + MQ_Q8_HEADER)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    case MQ_Q6: {
        const uint8_t *A = row + (size_t)(2 * p) * MQ_Q6_BLOCK;
        /* plain loads where 64 bytes stay inside the tensor: masked loads that miss the cache are
         * slow on AMD (10x measured on 151936 x 896) */
        __m512i v = A + 64 <= cx->end ? _mm512_loadu_si512((const void *)A)
                                      : _mm512_maskz_loadu_epi8(two ? 0x000fffffffffffffull : 0x3ffffffull, A);
        __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(cx->pw16, v)));
        if (!two) d = _mm512_maskz_mov_ps(0x00ff, d);
        *dv = d; *mv = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));
        __m512i lo = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi8(cx->p6lo, v), sh4), m15);
        __m512i hi = _mm512_rolv_epi64(_mm512_permutexvar_epi8(cx->p6hi, v), _mm512_setr_epi64(4, 2, 0, 62, 4, 2, 0, 62));
        return _mm512_ternarylogic_epi64(lo, hi, _mm512_set1_epi8(0x30), 0xF8); /* lo | (hi & 0x30) */
    }
    case MQ_Q4: {
        const uint8_t *A = row + (size_t)(2 * p) * MQ_Q4_BLOCK, *B = two ? A + MQ_Q4_BLOCK : A;
        __m512 d = _mm512_cvtph_ps(h16x2(A, B)), m = _mm512_cvtph_ps(h16x2(A + MQ_HDR_M, B + MQ_HDR_M));
        if (!two) { d = _mm512_maskz_mov_ps(0x00ff, d); m = _mm512_maskz_mov_ps(0x00ff, m); }
        *dv = d; *mv = m;
        __m512i lo = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(A + MQ_Q4_HEADER))),
                                                 0xff00, _mm_loadu_si128((const __m128i *)(B + MQ_Q4_HEADER)));
        return _mm512_and_si512(_mm512_srlv_epi64(lo, sh4), m15);
    }
    case MQ_Q5G: {
        const uint8_t *A = row + (size_t)(2 * p) * MQ_Q5G_BLOCK, *B = two ? A + MQ_Q5G_BLOCK : A;
        *dv = two ? _mm512_set1_ps(cx->q5_step) : _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(cx->q5_step));
        *mv = two ? _mm512_set1_ps(cx->q5_lo) : _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(cx->q5_lo));
        __m512i lo = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)A)),
                                                 0xff00, _mm_loadu_si128((const __m128i *)B));
        lo = _mm512_and_si512(_mm512_srlv_epi64(lo, sh4), m15);
        __mmask64 k = (__mmask64)rd32(A + MQ_PACK5_HI) | ((__mmask64)rd32(B + MQ_PACK5_HI) << 32);
        return _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(16));
    }
    case MQ_Q3U:
    case MQ_Q3P: {
        const uint8_t *blk = row + (size_t)p * MQ_Q3_BLOCK;
        __m512i v = _mm512_castsi256_si512(blk + 32 <= cx->end ? _mm256_loadu_si256((const __m256i *)blk)
                                                                : _mm256_maskz_loadu_epi8(0x0fffffff, blk));
        *dv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) & 0xffff)));
        *mv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) >> 16)));
        if (fmt == MQ_Q3P) return q3c_levels(_mm512_castsi512_si256(v), cx->tab64);
        __m512i h = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi8(cx->p3lo, v), sh2), m3);
        __mmask64 k = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(cx->p3hi, v), cx->bitsel);
        return _mm512_mask_add_epi8(h, k, h, _mm512_set1_epi8(4));
    }
    default: { /* MQ_Q2C */
        const uint8_t *blk = row + (size_t)(p >> 1) * MQ_Q2C_BLOCK, *c = blk + MQ_Q2C_HEADER + 2 * MQ_CHUNK_BYTES(MQ_Q2C_BITS) * (p & 1);
        *dv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) & 0xffff)));
        *mv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) >> 16)));
        __m512i h = _mm512_mask_set1_epi64(_mm512_set1_epi64((long long)rd64(c)), 0xf0, (long long)rd64(c + 8));
        h = _mm512_and_si512(_mm512_srlv_epi64(h, sh2), m3);
        return _mm512_shuffle_epi8(_mm512_set1_epi32((int)rd32(blk + MQ_Q2C_LUT)), h);
    }
    }
}

/* q8 levels are the signed codes + 128 (vpdpbusd multiplies u8 by s8): the lanes of
 * dpbusd(U, xq) - dpbusd(0x80, xq) are the exact signed sums, where carrying -128 * d in the float
 * offset term lost bits once partial sums passed 2^24 (a K = 4864 row did) */
static inline __attribute__((always_inline)) __m512i q8_fix(const int fmt, __m512i isum, __m512i corr) {
    return fmt == MQ_Q8 ? _mm512_sub_epi32(isum, corr) : isum;
}
static inline __attribute__((always_inline)) __m512i q8_corr(const int fmt, __m512i xq) {
    return fmt == MQ_Q8 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), xq) : _mm512_setzero_si512();
}

static inline __m512 pairvec(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

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
#define NRL 4
#ifndef LEAN_PF
#define LEAN_PF 1536
#endif
#ifndef LEAN_TILE_PF
#define LEAN_TILE_PF 16384
#endif
#ifndef LEAN_SHORT_TILE
#define LEAN_SHORT_TILE 4096
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
static void mv_q3c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
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

static void mv_q4c(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
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

/* q6 with an even chunk count: mv_q3c's 4-row fold of the float work (lanes 4j + r, j < 2 chunk A
 * of the pair, else chunk B) on mv_lean's q6 unpack; the 4 rows' 8 fp16 scales (d of both blocks)
 * are gathered by scalar loads into one xmm, the offset term (-32 d s) accumulates in one ymm.
 * For the short rows (K = 896: the 0.5B model's attention and lm_head). On by default since the
 * decode prefetch went to L2 (1.02-1.10x end to end on the 0.5B 2356 decode, docs/kernels.md
 * "Prefetch level"); with the old L1 prefetch it lost (0.85-0.9x). MIXQRT_Q6_FOLD=0 or
 * _ops.set_q6_fold(False) selects the unpack path. */
static void mv_q6f(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
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
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++, b += MQ_Q4X_CHUNK) {
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
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++, b += MQ_Q6X_CHUNK) {
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

/* q3x steps of a block (mq_format.h, .mxq version 5): step i holds the levels of codes k = 4i .. 4i + 3
 * of the 16 rows. Steps 2w and 2w + 1 (w < 6) are code plane w as loaded, looked up in a table of
 * the level of index bits 0-2 (Q3X_LO) and of bits 3-5 (Q3X_HI): vpermb reads bits 0-5 and ignores
 * 6-7, so no shift and no merge. Steps 12 + w take their low 2 bits from bits 6-7 of plane w (one
 * 16-bit shift right by 6 puts them at bits 0-1 of each byte) and bit 2 from bit 6 or 7 of plane 4
 * or 5 (one shift right by 4, shared by two steps, puts it at bit 2 or 3); one bit select merges
 * them and the table of bits 0, 1, 2 (Q3X_LO) or 0, 1, 3 (Q3X_T013) gives the level. Per block: 6
 * shifts, 4 selects, 16 vpermb (version 4's planes needed 7 shifts, 16 selects, 16 vpermb). */
enum { Q3X_LO, Q3X_HI, Q3X_T013, Q3X_NT };

/* the tables of a level table: kept per thread for the last level table seen (a product asks once
 * per chunk and thread); the pointer is valid on this thread until its next call */
static const __m512i *q3x_tables(const uint8_t *levels) {
    static __thread int have;
    static __thread uint64_t key;
    static __thread __m512i last[Q3X_NT];
    uint64_t k;
    memcpy(&k, levels, 8);
    if (!have || k != key) {
        uint8_t b[Q3X_NT][64];
        for (int e = 0; e < 64; e++) {
            b[Q3X_LO][e] = levels[e & 7];
            b[Q3X_HI][e] = levels[(e >> 3) & 7];
            b[Q3X_T013][e] = levels[(e & 3) | (((e >> 3) & 1) << 2)];
        }
        for (int n = 0; n < Q3X_NT; n++) last[n] = _mm512_loadu_si512(b[n]);
        key = k;
        have = 1;
    }
    return last;
}

static inline __attribute__((always_inline)) void q3x_steps(const uint8_t *b, const __m512i *t, __m512i lv[16]) {
    __m512i p[6];
    for (int w = 0; w < 6; w++) {
        p[w] = _mm512_loadu_si512((const void *)(b + MQ_Q3X_CODES + 64 * w));
        lv[2 * w] = _mm512_permutexvar_epi8(p[w], t[Q3X_LO]);
        lv[2 * w + 1] = _mm512_permutexvar_epi8(p[w], t[Q3X_HI]);
    }
    /* bits 6, 7 of planes 4, 5 -> bits 2, 3 (16-bit shifts: each byte's bits that matter stay in it) */
    const __m512i h4 = _mm512_srli_epi16(p[4], 4), h5 = _mm512_srli_epi16(p[5], 4), c0 = _mm512_set1_epi8(0x03);
    /* C ? low field : high bit, per bit, then the placement's table */
#define Q3X_SEL(lo, hi, T) _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(lo, hi, c0, 0xE4), t[T])
    lv[12] = Q3X_SEL(_mm512_srli_epi16(p[0], 6), h4, Q3X_LO);
    lv[13] = Q3X_SEL(_mm512_srli_epi16(p[1], 6), h4, Q3X_T013);
    lv[14] = Q3X_SEL(_mm512_srli_epi16(p[2], 6), h5, Q3X_LO);
    lv[15] = Q3X_SEL(_mm512_srli_epi16(p[3], 6), h5, Q3X_T013);
#undef Q3X_SEL
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
            if (pfd && b + pfd + MQ_Q3X_BLOCK <= end)
                for (int o = 0; o < MQ_Q3X_BLOCK; o += 64) _mm_prefetch((const char *)b + pfd + o, _MM_HINT_T1);
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

/* ------------------------------------------------------------------ few tokens (2 <= T <= 4) on the
 * interleaved formats: the decode kernels' unpack, each unpacked step feeding the T tokens' vpdpbusd,
 * and per chunk and token the GEMM's float fold (acc = fma(cvt(isum), dw*dx, acc); acc = fma(mm, s,
 * acc)), so the rows are bit for bit the GEMM's for any T >= 2 (its isum is an exact int32 sum in any
 * order). The GEMM unpacked every group into a VNNI tile in memory for the few tokens that read it:
 * a batched decode step of 2-4 sequences cost about as much as that many single steps. */
#define MQ_FEW_T 8
static int mq_few_t = -1;   /* -1: not read yet; MIXQRT_FEW_T=0 starts it off (T = 2..4 through the GEMM) */
static int few_t_on(void) {
    if (mq_few_t < 0) { const char *e = getenv("MIXQRT_FEW_T"); mq_few_t = !(e && e[0] == '0'); }
    return mq_few_t;
}
int mq_set_few_t(int on) { int old = few_t_on(); if (on >= 0) mq_few_t = on != 0; return old; }

static inline __attribute__((always_inline)) void
few_fold(__m512 *acc, const __m512i *is, const __m512 dw, const __m512 mm, const float *dx, const float *sx,
         size_t ncp, int c, const int nt) {
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * ncp + c])), acc[t]);
        acc[t] = _mm512_fmadd_ps(mm, _mm512_set1_ps(sx[t * ncp + c]), acc[t]);
    }
}

static inline __attribute__((always_inline)) void few_store(const mq_mm_job *j, int g0, const __m512 *acc, const int nt) {
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(j->y + (size_t)t * j->ldy + g0, acc[t]);
}

static inline __attribute__((always_inline)) void mv_q4x_few(const mq_mm_job *j, int n0, int n1, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m4h = _mm512_set1_epi8((char)0xf0);
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc[MQ_FEW_T];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
        for (int c = 0; c < j->nc; c++, b += MQ_Q4X_CHUNK) {
            const __m512i h = _mm512_loadu_si512((const void *)b);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            __m512i il[MQ_FEW_T], ih[MQ_FEW_T];
            for (int t = 0; t < nt; t++) il[t] = ih[t] = _mm512_setzero_si512();
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q4X_CODES + 64 * s));
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(v, m4h);
                for (int t = 0; t < nt; t++) {
                    const uint32_t *xc = x32 + t * kq + 8 * c;
                    il[t] = _mm512_dpbusd_epi32(il[t], lo, _mm512_set1_epi32((int)xc[s]));
                    ih[t] = _mm512_dpbusd_epi32(ih[t], hi, _mm512_set1_epi32((int)xc[4 + s]));
                }
            }
            for (int t = 0; t < nt; t++) il[t] = _mm512_add_epi32(il[t], _mm512_srai_epi32(ih[t], 4));
            few_fold(acc, il, d, m, a->d, a->s, ncp, c, nt);
        }
        few_store(j, g0, acc, nt);
    }
}

static inline __attribute__((always_inline)) void mv_q6x_few(const mq_mm_job *j, int n0, int n1, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc[MQ_FEW_T];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
        for (int c = 0; c < j->nc; c++, b += MQ_Q6X_CHUNK) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
            const __m512i h0 = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI)), h1 = _mm512_loadu_si512((const void *)(b + MQ_Q6X_HI + 64));
            __m512i is[MQ_FEW_T];
            for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
            for (int s = 0; s < 8; s++) {   /* the levels U = lo4 | hi2 << 4 of step s, as the GEMM tile */
                const __m512i v = _mm512_loadu_si512((const void *)(b + MQ_Q6X_LO + 64 * (s & 3)));
                const __m512i lo = s < 4 ? _mm512_and_si512(v, m4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                const __m512i h = (s & 1) ? h1 : h0;
                const int f = s >> 1;
                const __m512i hs = f == 0 ? _mm512_slli_epi16(h, 4) : f == 1 ? _mm512_slli_epi16(h, 2) : f == 2 ? h : _mm512_srli_epi16(h, 2);
                const __m512i u = _mm512_ternarylogic_epi32(lo, hs, m30, 0xF8);
                for (int t = 0; t < nt; t++)
                    is[t] = _mm512_dpbusd_epi32(is[t], u, _mm512_set1_epi32((int)x32[t * kq + 8 * c + s]));
            }
            few_fold(acc, is, d, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)), a->d, a->s, ncp, c, nt);
        }
        few_store(j, g0, acc, nt);
    }
}

static inline __attribute__((always_inline)) void mv_q3x_few(const ctx_t *cx, const mq_mm_job *j, int n0, int n1, const int nt) {
    const mq_act *a = j->a;
    const size_t kq = (size_t)a->kp / 4, ncp = (size_t)a->ncp;
    const uint32_t *x32 = (const uint32_t *)a->q;
    const int nb = j->nc / 2;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m512 acc[MQ_FEW_T];
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
        for (int bi = 0; bi < nb; bi++, b += MQ_Q3X_BLOCK) {
            const __m512i h = _mm512_loadu_si512((const void *)b);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            __m512i lv[16];
            q3x_steps(b, cx->t3x, lv);
            for (int half = 0; half < 2; half++) {   /* chunk 2 bi + half: q3x steps 8 half .. 8 half + 7 */
                __m512i is[MQ_FEW_T];
                for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
                for (int s = 0; s < 8; s++) {
                    for (int t = 0; t < nt; t++)
                        is[t] = _mm512_dpbusd_epi32(is[t], lv[8 * half + s], _mm512_set1_epi32((int)x32[t * kq + 16 * bi + 8 * half + s]));
                }
                few_fold(acc, is, d, m, a->d, a->s, ncp, 2 * bi + half, nt);
            }
        }
        few_store(j, g0, acc, nt);
    }
}

static void mm_few(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
#define MQ_FEW(T_) do { \
        if (j->fmt == MQ_Q4X) mv_q4x_few(j, n0, n1, T_); \
        else if (j->fmt == MQ_Q6X) mv_q6x_few(j, n0, n1, T_); \
        else mv_q3x_few(cx, j, n0, n1, T_); } while (0)
    switch (j->T) {
    case 2: MQ_FEW(2); break;
    case 3: MQ_FEW(3); break;
    case 4: MQ_FEW(4); break;
    case 5: MQ_FEW(5); break;
    case 6: MQ_FEW(6); break;
    case 7: MQ_FEW(7); break;
    default: MQ_FEW(8); break;
    }
#undef MQ_FEW
}

static float dot_ps(const float *w, const float *x, int K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    }
    for (; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* ------------------------------------------------------------------ prefill: unpacked row tiles */
#define TR 4
static inline __attribute__((always_inline)) void
mm_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const mq_act *a = j->a;
    int np = (j->nc + 1) / 2;
    /* per row of the tile: np zmm of levels, np zmm of dw pairs, np floats x2 of mm */
    uint8_t *buf = (uint8_t *)mq_scratch((size_t)TR * np * (64 + 64 + 8));
    __m512i *lv = (__m512i *)buf;
    __m512 *dwv = (__m512 *)(buf + (size_t)TR * np * 64);
    float *mmv = (float *)(buf + (size_t)TR * np * 128);
    for (int nt = n0; nt < n1; nt += TR) {
        int nr = n1 - nt < TR ? n1 - nt : TR;
        for (int r = 0; r < nr; r++) {
            const uint8_t *row = j->w + (size_t)(nt + r) * j->row_bytes;
            for (int p = 0; p < np; p++) {
                __m512 mv;
                float tmp[16];
                lv[r * np + p] = unpack_pair(cx, fmt, row, p, &dwv[r * np + p], &mv);
                _mm512_storeu_ps(tmp, mv);
                mmv[(size_t)(r * np + p) * 2] = tmp[0];
                mmv[(size_t)(r * np + p) * 2 + 1] = tmp[8];
            }
        }
        for (int t = 0; t < j->T; t++) {
            const int8_t *q = a->q + (size_t)t * a->kp;
            const float *xd = a->d + (size_t)t * a->ncp, *xs = a->s + (size_t)t * a->ncp;
            float *y = j->y + (size_t)t * j->ldy + nt;
            if (nr == TR) {
                __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
                const __m512i *l0 = lv, *l1 = lv + np, *l2 = lv + 2 * np, *l3 = lv + 3 * np;
                const __m512 *w0 = dwv, *w1 = dwv + np, *w2 = dwv + 2 * np, *w3 = dwv + 3 * np;
                for (int p = 0; p < np; p++) {
                    __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p)), corr = q8_corr(fmt, xq);
                    __m512 dx = pairvec(xd[2 * p], xd[2 * p + 1]);
                    const __m512i z = _mm512_setzero_si512();
                    c0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l0[p], xq), corr)), _mm512_mul_ps(w0[p], dx), c0);
                    c1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l1[p], xq), corr)), _mm512_mul_ps(w1[p], dx), c1);
                    c2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l2[p], xq), corr)), _mm512_mul_ps(w2[p], dx), c2);
                    c3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(z, l3[p], xq), corr)), _mm512_mul_ps(w3[p], dx), c3);
                }
                __m512 cs[4] = {c0, c1, c2, c3};
                for (int r = 0; r < TR; r++) y[r] = _mm512_reduce_add_ps(cs[r]) + dot_ps(mmv + (size_t)r * np * 2, xs, 2 * np);
            } else {
                for (int r = 0; r < nr; r++) {
                    __m512 c0 = _mm512_setzero_ps();
                    for (int p = 0; p < np; p++) {
                        __m512i xq = _mm512_loadu_si512((const void *)(q + 64 * p));
                        __m512 dx = pairvec(xd[2 * p], xd[2 * p + 1]);
                        c0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_fix(fmt, _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[r * np + p], xq), q8_corr(fmt, xq))),
                                             _mm512_mul_ps(dwv[r * np + p], dx), c0);
                    }
                    y[r] = _mm512_reduce_add_ps(c0) + dot_ps(mmv + (size_t)r * np * 2, xs, 2 * np);
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
#define GTT 8
#define CB 160   /* one chunk of a tile, in u32: levels [8 k4 steps][16 rows], dw[16], mm[16] (640 B) */
int mq_gemm_min_t = 8;
static int mq_lean_mv = -1;   /* -1: not decided yet; MIXQRT_LEAN_MV=0 starts it off (default on) */
static int mq_q6_fold = 1;   /* q6 short rows through mv_q6f; MIXQRT_Q6_FOLD=0 starts it off */
static int lean_mv_on(void) {
    if (mq_lean_mv < 0) {
        const char *e = getenv("MIXQRT_LEAN_MV"), *f = getenv("MIXQRT_Q6_FOLD");
        mq_lean_mv = !(e && e[0] == '0');
        mq_q6_fold = !(f && f[0] == '0');
    }
    return mq_lean_mv;
}
int mq_set_lean_mv(int on) { int old = lean_mv_on(); if (on >= 0) mq_lean_mv = on != 0; return old; }
int mq_set_q6_fold(int on) { lean_mv_on(); int old = mq_q6_fold; if (on >= 0) mq_q6_fold = on != 0; return old; }
void mq_set_gemm_min_t(int t) { mq_gemm_min_t = t; }

static inline __attribute__((always_inline)) void
gemm_kernel(const uint32_t *tb, int nch, int pf,
            const uint32_t *qb, const float *db, const float *sb, const int32_t *qsb, float *accb, int first, const int gt) {
    __m512 acc[GTT];
    for (int i = 0; i < gt; i++) acc[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(accb + 16 * i);
    for (int c = 0; c < nch; c++) {
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
            acc[i] = _mm512_fmadd_ps(mm, _mm512_set1_ps(sb[c * gt + i]), acc[i]);
        }
    }
    for (int i = 0; i < gt; i++) _mm512_store_ps(accb + 16 * i, acc[i]);
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
    size_t qbytes, dbytes, abytes = (size_t)ng * gt * 64, tile = (size_t)GKS * CB * 4;
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
                float *ab = accb + (size_t)g * gt * 16;
                gemm_kernel(tl, nch, cached && g == 0, qp + ((size_t)g * k4 + (size_t)c0 * 8) * gt,
                            dxp + ((size_t)g * ncp + c0) * gt, sxp + ((size_t)g * ncp + c0) * gt,
                            fmt == MQ_Q8 ? qsp + ((size_t)g * ncp + c0) * gt : NULL, ab, first, gt);
                if (last)
                    for (int i = 0; i < gt && g * gt + i < T; i++)
                        _mm512_mask_storeu_ps(j->y + (size_t)(g * gt + i) * j->ldy + nt, smask, _mm512_load_ps(ab + 16 * i));
            }
        }
    }
}

/* ------------------------------------------------------------------ float weights */
static void load_row_f32(const mq_mm_job *j, int n, float *out) {
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    int k = 0;
    if (j->fmt == MQ_F16) {
        for (; k + 16 <= j->K; k += 16) _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k))));
        for (; k < j->K; k++) out[k] = h2f(row + 2 * k);
    } else {
        for (; k + 16 <= j->K; k += 16)
            _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * k))), 16)));
        for (; k < j->K; k++) { uint16_t v; memcpy(&v, row + 2 * k, 2); out[k] = mq_bf16_to_f32(v); }
    }
}

/* 16 weights of a float row at element k, as float32 */
static inline __attribute__((always_inline)) __m512 wload(const int fmt, const uint8_t *row, int k) {
    if (fmt == MQ_F32) return _mm512_loadu_ps((const float *)row + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k));
    if (fmt == MQ_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#ifndef FLOAT_PF_HINT
#define FLOAT_PF_HINT _MM_HINT_T1
#endif
static size_t float_pf = 2048;   /* in-row prefetch distance of the float decode streams, bytes */

/* Float decode (T == 1), opt-in (MIXQRT_FLOAT_MV=1 or _ops.set_float_mv): 4 rows per step share
 * each x load, two accumulators per row; each row stream is prefetched MIXQRT_FLOAT_PF bytes ahead
 * (default 2048, 0 = none), past its end into the same row of the next 4-row tile (the rule of
 * mv_lean). Measured 0.4-0.6x of the one-row loop on the 151936 x 896 f32/f16 lm_head at 1 and 2
 * threads, with and without the software prefetch (docs/kernels.md): on this machine one sequential
 * stream per thread reads faster than several interleaved ones, as the bandwidth probe shows too.
 * With the prefetch into L2 (FLOAT_PF_HINT, 2026-12-03) the whole f32 0.5B model decodes at the
 * one-row loop's speed (13.4-14.1 vs 13.7-14.7 tok/s, 2 threads, alternated), no faster: still
 * opt-in. */
static inline __attribute__((always_inline)) void
mv_float_fmt(const int fmt, const mq_mm_job *j, int n0, int n1) {
    const int K = j->K, esz = fmt == MQ_F32 ? 4 : 2;
    const size_t rb = j->row_bytes;
    const float *x = j->x;
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        const uint8_t *r = j->w + (size_t)n * rb;
        __m512 a0[4], a1[4];
        for (int i = 0; i < 4; i++) { a0[i] = _mm512_setzero_ps(); a1[i] = _mm512_setzero_ps(); }
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            const size_t off = (size_t)k * esz + float_pf;
            if (float_pf) for (int i = 0; i < 4; i++) {
                const uint8_t *pf = off < rb ? r + i * rb + off : r + (4 + i) * rb + (off - rb);
                _mm_prefetch((const char *)pf, FLOAT_PF_HINT);
                if (esz == 4) _mm_prefetch((const char *)pf + 64, FLOAT_PF_HINT);
            }
            const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
            for (int i = 0; i < 4; i++) {
                a0[i] = _mm512_fmadd_ps(wload(fmt, r + i * rb, k), x0, a0[i]);
                a1[i] = _mm512_fmadd_ps(wload(fmt, r + i * rb, k + 16), x1, a1[i]);
            }
        }
        float y[4];
        for (int i = 0; i < 4; i++) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
        for (; k < K; k++) {      /* K % 32 tail: scalar, in order (rare: hidden sizes are multiples of 32) */
            for (int i = 0; i < 4; i++) {
                const uint8_t *e = r + i * rb + (size_t)k * esz;
                float w;
                if (fmt == MQ_F32) memcpy(&w, e, 4);
                else if (fmt == MQ_F16) w = h2f(e);
                else { uint16_t v; memcpy(&v, e, 2); w = mq_bf16_to_f32(v); }
                y[i] += w * x[k];
            }
        }
        for (int i = 0; i < 4; i++) j->y[n + i] = y[i];
    }
    if (n < n1) {
        float *wf = (float *)mq_scratch((size_t)K * 4 + 64);
        for (; n < n1; n++) {
            const float *wr;
            if (fmt == MQ_F32) wr = (const float *)(j->w + (size_t)n * rb);
            else { load_row_f32(j, n, wf); wr = wf; }
            j->y[n] = dot_ps(wr, x, K);
        }
    }
}

static int mq_float_mv = -1;   /* -1: not decided; MIXQRT_FLOAT_MV=1 selects the 4-row path */
int mq_set_float_mv(int on) {
    if (mq_float_mv < 0) {
        const char *e = getenv("MIXQRT_FLOAT_MV"), *pf = getenv("MIXQRT_FLOAT_PF");
        mq_float_mv = e && e[0] == '1';
        if (pf) float_pf = (size_t)atol(pf);
    }
    int old = mq_float_mv;
    if (on >= 0) mq_float_mv = on ? 1 : 0;
    return old;
}

static void mm_float(const mq_mm_job *j, int n0, int n1) {
    if (j->T == 1 && (mq_float_mv >= 0 ? mq_float_mv : mq_set_float_mv(-1))) {
        if (j->fmt == MQ_F32) mv_float_fmt(MQ_F32, j, n0, n1);
        else if (j->fmt == MQ_F16) mv_float_fmt(MQ_F16, j, n0, n1);
        else mv_float_fmt(MQ_BF16, j, n0, n1);
        return;
    }
    float *wf = (float *)mq_scratch((size_t)j->K * 4 + 64);
    for (int n = n0; n < n1; n++) {
        const float *wr;
        if (j->fmt == MQ_F32) wr = (const float *)(j->w + (size_t)n * j->row_bytes);
        else { load_row_f32(j, n, wf); wr = wf; }
        for (int t = 0; t < j->T; t++) j->y[(size_t)t * j->ldy + n] = dot_ps(wr, j->x + (size_t)t * j->ldx, j->K);
    }
}

#define FMT_CASE(F) case F: \
    if (j->T == 1 && mq_lean_mv && F == MQ_Q3P) mv_q3c(&cx, j, n0, n1); \
    else if (j->T == 1 && mq_lean_mv && F == MQ_Q4 && j->nc % 2 == 0) mv_q4c(&cx, j, n0, n1); \
    else if (j->T == 1 && mq_lean_mv && F == MQ_Q6 && j->nc % 2 == 0 && (size_t)NRL * j->row_bytes <= LEAN_SHORT_TILE \
             && mq_q6_fold) mv_q6f(&cx, j, n0, n1); \
    else if (j->T == 1 && mq_lean_mv && (F == MQ_Q3U || (F == MQ_Q6 && j->nc % 2 == 0 \
            && (size_t)NRL * j->row_bytes > LEAN_SHORT_TILE))) mv_lean(&cx, F, j, n0, n1); \
    else if (j->T == 1) mv_fmt(&cx, F, j, n0, n1); \
    else if ((mq_gemm_min_t > 0 && j->T >= mq_gemm_min_t) || (j->tiles && j->T >= 2)) {   /* gt a constant per call: a runtime gt left acc[]/is[] in memory (1.7x slower at T = 128) */ \
        if (j->T <= 2) gemm_fmt(&cx, F, j, n0, n1, 2); \
        else if (j->T <= 4) gemm_fmt(&cx, F, j, n0, n1, 4); \
        else gemm_fmt(&cx, F, j, n0, n1, GTT); } \
    else mm_fmt(&cx, F, j, n0, n1); \
    break;

static void ctx_init(ctx_t *cx, const mq_mm_job *j) {
    cx->fmt = j->fmt; cx->nc = j->nc; cx->end = j->w + (size_t)j->N * j->row_bytes; cx->q5_lo = j->q5_lo; cx->q5_step = j->q5_step;
    uint8_t t16[16] = {0}, t64[64];
    if (j->q3p_levels) memcpy(t16, j->q3p_levels, MQ_Q3P_NLEVELS);
    for (int i = 0; i < 64; i++) t64[i] = t16[i & 7];
    cx->tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t16));
    cx->tab64 = _mm512_loadu_si512(t64);
    cx->t3x = j->fmt == MQ_Q3X ? q3x_tables(t16) : NULL;
    cx->p3lo = _mm512_loadu_si512(PERM_Q3U[0]); cx->p3hi = _mm512_loadu_si512(PERM_Q3U[1]);
    cx->p6lo = _mm512_loadu_si512(PERM_Q6[0]); cx->p6hi = _mm512_loadu_si512(PERM_Q6[1]);
    cx->bitsel = _mm512_loadu_si512(BITSEL);
    static const uint16_t pw16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 13, 13, 13, 13, 13, 13, 13, 13};
    cx->pw16 = _mm512_loadu_si512(pw16);
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

int mq_gemm_tiles_build_avx512(const mq_mm_job *j, uint8_t *out, int n0, int n1) {
    if (j->fmt >= MQ_F32 || n0 % GR || ((uintptr_t)out & 63)) return -1;
    ctx_t cx;
    ctx_init(&cx, j);
    switch (j->fmt) {
    case MQ_Q8: tiles_fmt(&cx, MQ_Q8, j, out, n0, n1); break;
    case MQ_Q6: tiles_fmt(&cx, MQ_Q6, j, out, n0, n1); break;
    case MQ_Q4: tiles_fmt(&cx, MQ_Q4, j, out, n0, n1); break;
    case MQ_Q3U: tiles_fmt(&cx, MQ_Q3U, j, out, n0, n1); break;
    case MQ_Q3P: tiles_fmt(&cx, MQ_Q3P, j, out, n0, n1); break;
    case MQ_Q2C: tiles_fmt(&cx, MQ_Q2C, j, out, n0, n1); break;
    case MQ_Q5G: tiles_fmt(&cx, MQ_Q5G, j, out, n0, n1); break;
    case MQ_Q4X: if (n1 % MQ_XROWS) return -1; tiles_fmt(&cx, MQ_Q4X, j, out, n0, n1); break;
    case MQ_Q3X: if (n1 % MQ_XROWS) return -1; tiles_fmt(&cx, MQ_Q3X, j, out, n0, n1); break;
    case MQ_Q6X: if (n1 % MQ_XROWS) return -1; tiles_fmt(&cx, MQ_Q6X, j, out, n0, n1); break;
    default: return -1;
    }
    return 0;
}

/* The token group size of the GEMM the dispatch below (FMT_CASE, the q4x / q6x / q3x cases) gives a
 * whole product j when it is GTT, else 0: then _mm_run interleaves the activations once for every
 * thread (mq_gemm_interleave on the pool) instead of once per thread and call. */
int mq_gemm_shared_gt_avx512(const mq_mm_job *j) {
    if (j->fmt >= MQ_F32 || j->T <= 4) return 0;
    if (j->fmt == MQ_Q4X || j->fmt == MQ_Q6X || j->fmt == MQ_Q3X)
        return j->N % MQ_XROWS == 0 && !(j->T <= MQ_FEW_T && few_t_on()) ? GTT : 0;
    return (mq_gemm_min_t > 0 && j->T >= mq_gemm_min_t) || j->tiles ? GTT : 0;
}

size_t mq_gemm_act_bytes_avx512(const mq_act *a, int gt) {
    size_t q, d;
    return gemm_act_layout(a, gt, &q, &d);
}

void mq_gemm_interleave_avx512(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out) {
    gemm_interleave(a, fmt, gt, g0, g1, out);
}

void mq_mm_rows_avx512(const mq_mm_job *j, int n0, int n1) {
    if (j->fmt >= MQ_F32) { mm_float(j, n0, n1); return; }
    lean_mv_on();
    ctx_t cx;
    ctx_init(&cx, j);
    switch (j->fmt) {
        FMT_CASE(MQ_Q8) FMT_CASE(MQ_Q6) FMT_CASE(MQ_Q4) FMT_CASE(MQ_Q3U) FMT_CASE(MQ_Q3P) FMT_CASE(MQ_Q2C)
        FMT_CASE(MQ_Q5G)
    case MQ_Q4X:   /* whole groups only (mq_mm_rows): decode kernel, else the GEMM (mm_fmt reads rows) */
        if (j->T == 1) mv_q4x(j, n0, n1);
        else if (j->T <= MQ_FEW_T && few_t_on()) mm_few(&cx, j, n0, n1);
        else if (j->T <= 2) gemm_fmt(&cx, MQ_Q4X, j, n0, n1, 2);
        else if (j->T <= 4) gemm_fmt(&cx, MQ_Q4X, j, n0, n1, 4);
        else gemm_fmt(&cx, MQ_Q4X, j, n0, n1, GTT);
        break;
    case MQ_Q6X:
        if (j->T == 1) mv_q6x(j, n0, n1);
        else if (j->T <= MQ_FEW_T && few_t_on()) mm_few(&cx, j, n0, n1);
        else if (j->T <= 2) gemm_fmt(&cx, MQ_Q6X, j, n0, n1, 2);
        else if (j->T <= 4) gemm_fmt(&cx, MQ_Q6X, j, n0, n1, 4);
        else gemm_fmt(&cx, MQ_Q6X, j, n0, n1, GTT);
        break;
    case MQ_Q3X:
        if (j->T == 1) mv_q3x(&cx, j, n0, n1);
        else if (j->T <= MQ_FEW_T && few_t_on()) mm_few(&cx, j, n0, n1);
        else if (j->T <= 2) gemm_fmt(&cx, MQ_Q3X, j, n0, n1, 2);
        else if (j->T <= 4) gemm_fmt(&cx, MQ_Q3X, j, n0, n1, 4);
        else gemm_fmt(&cx, MQ_Q3X, j, n0, n1, GTT);
        break;
    }
}
