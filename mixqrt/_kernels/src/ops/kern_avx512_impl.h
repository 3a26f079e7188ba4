/* Internals of the AVX-512 tier, shared by its files (include from *_avx512.c only):
 *   kern_avx512.c        the tier's entry: its traits table (MQ_AVX512_TRAITS, each format's kernels)
 *                        and the routing by the shape of the product (decode, few tokens, exact rows,
 *                        GEMM or float), the tier's tuning switches
 *   kern_base_avx512.c   activation quantization, the q3x level tables, the per-call context
 *   kern_mv_avx512.c     decode (T == 1) kernels and the few-token (2 <= T <= 8) interleaved products
 *   kern_gemm_avx512.c   T >= 2: unpacked row tiles, the VNNI GEMM, its cached tiles and shared activations
 *   kern_float_avx512.c  f32 / f16 / bf16 weights
 * Calls go one way: kern_avx512.c -> the kernel files -> kern_base_avx512.c; no kernel file calls a
 * sibling (tests/test_kernel_sources.py).
 * Here: the unpack of two chunks into one zmm of u8 levels (unpack_pair) and the per-call context
 * (ctx_t, ctx_init) that every kernel family reads. */
#ifndef MIXQRT_KERN_AVX512_IMPL_H
#define MIXQRT_KERN_AVX512_IMPL_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mq_kern.h"
#include "kern_avx512.h"

/* byte offsets inside a block that the shuffle tables below (PERM_Q3U, PERM_Q6, pw16) hard-wire */
#define Q3_C0 MQ_Q3_HEADER                                  /* q3 chunk 0 */
#define Q3_C1 (MQ_Q3_HEADER + MQ_CHUNK_BYTES(MQ_Q3_BITS))   /* q3 chunk 1 */
#define Q6_HI (MQ_Q6_HEADER + MQ_PACK6_HI)                  /* q6 2-bit plane */
_Static_assert(Q3_C0 == 4 && Q3_C1 == 16 && MQ_PACK3_HI == 8, "PERM_Q3U indexes q3 block bytes 4-27");
_Static_assert(Q6_HI == 18 && MQ_Q6_BLOCK == 26, "PERM_Q6 / pw16 index two q6 blocks of 26 bytes");

static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float h2f(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return _cvtsh_ss(v); }

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

static const uint8_t __attribute__((unused)) PERM_Q3U[2][64] = {
    { 4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,  4, 5, 6, 7, 8, 9,10,11,
     16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23, 16,17,18,19,20,21,22,23},
    {12,12,12,12,12,12,12,12, 13,13,13,13,13,13,13,13, 14,14,14,14,14,14,14,14, 15,15,15,15,15,15,15,15,
     24,24,24,24,24,24,24,24, 25,25,25,25,25,25,25,25, 26,26,26,26,26,26,26,26, 27,27,27,27,27,27,27,27}};
static const uint8_t __attribute__((unused)) PERM_Q6[2][64] = {
    { 2, 3, 4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,  2, 3, 4, 5, 6, 7, 8, 9,10,11,12,13,14,15,16,17,
     28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43, 28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43},
    {18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25, 18,19,20,21,22,23,24,25,
     44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51, 44,45,46,47,48,49,50,51}};
static const uint8_t __attribute__((unused)) BITSEL[64] = {
    1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128,
    1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128, 1,2,4,8,16,32,64,128};

/* q3p (pack3c): a block's 64 codes are 24 contiguous bytes (code i at bits 3i..3i+2); vpermb gives
 * qword j the 3 bytes of codes 8j..8j+7, vpmultishiftqb puts code 8j+b in the low bits of byte b
 * (the bits above it are the next codes) and a vpermb on the 64-entry table (level of i & 7 at
 * every i) reads the levels. v: bytes 0-27 of the block (header first) in the low 256 bits. */
static const uint8_t __attribute__((unused)) SPREAD_Q3C[64] = {
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
    case MQ_Q2C: {
        const uint8_t *blk = row + (size_t)(p >> 1) * MQ_Q2C_BLOCK, *c = blk + MQ_Q2C_HEADER + 2 * MQ_CHUNK_BYTES(MQ_Q2C_BITS) * (p & 1);
        *dv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) & 0xffff)));
        *mv = _mm512_cvtph_ps(_mm256_set1_epi16((short)(rd32(blk) >> 16)));
        __m512i h = _mm512_mask_set1_epi64(_mm512_set1_epi64((long long)rd64(c)), 0xf0, (long long)rd64(c + 8));
        h = _mm512_and_si512(_mm512_srlv_epi64(h, sh2), m3);
        return _mm512_shuffle_epi8(_mm512_set1_epi32((int)rd32(blk + MQ_Q2C_LUT)), h);
    }
    /* a new row format: its case above (docs/architecture.md, "Adding a format") */
    default:   /* a listed format without its unpack: NaN products, loud, never silent */
        *dv = *mv = _mm512_set1_ps(__builtin_nanf(""));
        return _mm512_setzero_si512();
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

/* q3x steps of a block (mq_format.h, .mxq version 5): step i holds the levels of codes k = 4i .. 4i + 3
 * of the 16 rows. Steps 2w and 2w + 1 (w < 6) are code plane w as loaded, looked up in a table of
 * the level of index bits 0-2 (Q3X_LO) and of bits 3-5 (Q3X_HI): vpermb reads bits 0-5 and ignores
 * 6-7, so no shift and no merge. Steps 12 + w take their low 2 bits from bits 6-7 of plane w (one
 * 16-bit shift right by 6 puts them at bits 0-1 of each byte) and bit 2 from bit 6 or 7 of plane 4
 * or 5 (one shift right by 4, shared by two steps, puts it at bit 2 or 3); one bit select merges
 * them and the table of bits 0, 1, 2 (Q3X_LO) or 0, 1, 3 (Q3X_T013) gives the level. Per block: 6
 * shifts, 4 selects, 16 vpermb (version 4's planes needed 7 shifts, 16 selects, 16 vpermb). */
enum { Q3X_LO, Q3X_HI, Q3X_T013, Q3X_NT };

/* the tables of a level table (kern_avx512.c): kept per thread for the last level table seen (a product
 * asks once per chunk and thread); the pointer is valid on this thread until its next call */
const __m512i *mq_avx512_q3x_tables(const uint8_t *levels);

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

/* few-token products (kern_mv_avx512.c) take T <= MQ_FEW_T on the interleaved formats */
#define MQ_FEW_T 8
/* the row formats' products of 2 <= T <= MQ_EXACT_T rows give every row bit for bit as the T = 1
 * product (kern_avx512.c: rows_exact): up to 16 drafted tokens + 1 of a speculative verify */
#define MQ_EXACT_T 17

static __attribute__((unused)) float dot_ps(const float *w, const float *x, int K) {
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

/* the per-call context of job j (kern_base_avx512.c; out of line, as it was when the tier was one
 * file: the kernels then read cx from memory, and their machine code stays what it was) */
void ctx_init(ctx_t *cx, const mq_mm_job *j);

/* the lean decode kernels (kern_mv_avx512.c) run NRL rows at once; a tile of NRL rows of at most
 * LEAN_SHORT_TILE bytes is "short" (mq_avx512_lean.rows) */
#define NRL 4
#ifndef LEAN_SHORT_TILE
#define LEAN_SHORT_TILE 4096
#endif

/* the GEMM's largest token group (kern_gemm_avx512.c; the router shares activations in groups of it) */
#define GTT 8

/* ------------------------------------------------------------------ the traits of a format
 * One row per format of MQ_AVX512_TRAITS (kern_avx512.c), the kernels of this tier that serve it (its
 * lean decode kernels: LEAN_KERNELS there). Every kernel takes the job's context and a row range [n0, n1). */
typedef void (*mq_avx512_kern)(const ctx_t *cx, const mq_mm_job *j, int n0, int n1);
typedef void (*mq_avx512_tiles_fn)(const ctx_t *cx, const mq_mm_job *j, uint8_t *out, int n0, int n1);
enum { LEAN_ANY, LEAN_SHORT, LEAN_LONG };   /* the rows a lean kernel takes: any, short (a 4-row tile <= 4 KiB), long */
typedef struct {
    mq_avx512_kern kern;    /* a decode kernel with its own fold, instead of the plain one */
    int nc_mult;            /* where the row's chunk count is a multiple of this */
    int rows;               /* LEAN_* */
    const int *on;          /* and this switch is on (NULL: always) */
} mq_avx512_lean;
typedef struct {
    mq_avx512_kern mv;          /* T == 1: the plain decode kernel (mv_fmt's fold; NULL: no packed format) */
    mq_avx512_kern few;         /* 2 <= T <= MQ_FEW_T, each row the T = 1 row (interleaved formats) */
    mq_avx512_kern mm;          /* row formats, T >= 2: unpacked row tiles with mv's fold */
    mq_avx512_kern gemm[3];     /* the VNNI GEMM in token groups of 2, 4 and GTT */
    mq_avx512_tiles_fn tiles;   /* the GEMM's cached tiles */
    int groups;                 /* rows come in groups of MQ_XROWS (q4x / q6x / q3x) */
} mq_avx512_traits;

/* the kernel files' entries the table names: mv (kern_mv), lean (kern_mv), few (kern_mv), mm / gemm /
 * tiles (kern_gemm) */
#define MQ_AVX512_DECLARE_ROW(name, F) \
    void mq_avx512_mv_##name(const ctx_t *, const mq_mm_job *, int, int); \
    void mq_avx512_mm_##name(const ctx_t *, const mq_mm_job *, int, int); \
    MQ_AVX512_DECLARE_GEMM(name)
#define MQ_AVX512_DECLARE_GEMM(name) \
    void mq_avx512_gemm2_##name(const ctx_t *, const mq_mm_job *, int, int); \
    void mq_avx512_gemm4_##name(const ctx_t *, const mq_mm_job *, int, int); \
    void mq_avx512_gemm8_##name(const ctx_t *, const mq_mm_job *, int, int); \
    void mq_avx512_tiles_##name(const ctx_t *, const mq_mm_job *, uint8_t *, int, int);
#define MQ_AVX512_DECLARE_X(name, F) \
    void mq_avx512_mv_##name(const ctx_t *, const mq_mm_job *, int, int); \
    void mq_avx512_few_##name(const ctx_t *, const mq_mm_job *, int, int); \
    MQ_AVX512_DECLARE_GEMM(name)
MQ_FOR_ROW_FORMATS(MQ_AVX512_DECLARE_ROW)
MQ_FOR_X_FORMATS(MQ_AVX512_DECLARE_X)
void mq_avx512_lean_q3c(const ctx_t *, const mq_mm_job *, int, int);
void mq_avx512_lean_q4c(const ctx_t *, const mq_mm_job *, int, int);
void mq_avx512_lean_q2c(const ctx_t *, const mq_mm_job *, int, int);
void mq_avx512_lean_q6f(const ctx_t *, const mq_mm_job *, int, int);
void mq_avx512_lean_q3u(const ctx_t *, const mq_mm_job *, int, int);
void mq_avx512_lean_q6(const ctx_t *, const mq_mm_job *, int, int);

void mq_avx512_float(const mq_mm_job *j, int n0, int n1);   /* f32 / f16 / bf16 (kern_float_avx512.c) */
#endif
