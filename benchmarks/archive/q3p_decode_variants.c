/* q3p decode variants, single thread, CPU time (docs/kernels.md, "q3p pack3c"): the numbers of the
 * q3p layout decision. Random bytes of the exact size (speed does not depend on the values).
 *
 *   gcc -O3 -mavx2 -mfma -mf16c -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni \
 *       -mavx512vbmi -o /tmp/q3pv benchmarks/archive/q3p_decode_variants.c && /tmp/q3pv N K REPS
 *
 * A  planar layout (2-bit plane + 1-bit plane), per-row float work: the lean path before pack3c
 * B  pack3c (vpermb spread, vpmultishiftqb, vpermb levels), per-row float work
 * C  B with the float work of 4 rows folded into one vector (unpacklo/hi + add): the kernel (mv_q3c)
 * D  A with C's 4-row float work
 * E  pack3c with a row's (d, m) stored apart from its codes (a second layout change)
 * F  C with each tile's scales gathered into a transposed float scratch first
 * H  C with the dx lane vectors from scratch: mv_q3c as built (rows up to 160 pairs) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
#define NRL 4
#define BLK 28
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}

static inline __m512i q3_codes(const uint8_t *blk, __m512i tab) {
    const __m512i sh2 = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6);
    __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x((long long)rd64(blk + 4))),
                                    _mm256_set1_epi64x((long long)rd64(blk + 16)), 1);
    lo = _mm512_and_si512(_mm512_srlv_epi64(lo, sh2), _mm512_set1_epi8(3));
    __mmask64 k = _cvtu64_mask64((uint64_t)rd32(blk + 12) | ((uint64_t)rd32(blk + 24) << 32));
    lo = _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(4));
    return _mm512_shuffle_epi8(tab, lo);
}
/* A: current lean */
static void mvA(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab, float *y) {
    const __m512i didx = _mm512_setr_epi32(0,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1);
    for (int n = 0; n + NRL <= N; n += NRL) {
        const uint8_t *r = w + (size_t)n * rb;
        __m512 acc[NRL]; __m128 am[NRL];
        for (int i = 0; i < NRL; i++) { acc[i] = _mm512_setzero_ps(); am[i] = _mm_setzero_ps(); }
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512(q + 64 * p);
            __m128 dx2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
            __m512 dxv = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dx2));
            __m128 sv = _mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)));
            for (int i = 0; i < NRL; i++) {
                const uint8_t *blk = r + i * rb + (size_t)p * BLK;
                __m512i l = q3_codes(blk, tab);
                __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(blk)));
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xq)), dxv);
                acc[i] = _mm512_fmadd_ps(f, _mm512_broadcastss_ps(dm), acc[i]);
                am[i] = _mm_fmadd_ps(dm, sv, am[i]);
            }
        }
        for (int i = 0; i < NRL; i++) { __m128 t = _mm_add_ss(am[i], _mm_movehdup_ps(am[i])); y[n + i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(t); }
    }
}
/* new layout: 64 3-bit codes contiguous (LE bits) after the 4-byte header */
static const uint8_t SPREAD[64] = {4,5,6,7,7,7,7,7, 7,8,9,10,10,10,10,10, 10,11,12,13,13,13,13,13, 13,14,15,16,16,16,16,16,
   16,17,18,19,19,19,19,19, 19,20,21,22,22,22,22,22, 22,23,24,25,25,25,25,25, 25,26,27,28,28,28,28,28};
static inline __m512i q3c_codes(__m256i v, __m512i spread, __m512i ms, __m512i tab64) {
    __m512i x = _mm512_permutexvar_epi8(spread, _mm512_castsi256_si512(v));
    x = _mm512_multishift_epi64_epi8(ms, x);
    return _mm512_permutexvar_epi8(x, tab64);
}
/* B: new layout, old float */
static void mvB(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab64, float *y) {
    const __m512i didx = _mm512_setr_epi32(0,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1);
    const __m512i spread = _mm512_loadu_si512(SPREAD);
    const __m512i ms = _mm512_set1_epi64(0x15120f0c09060300LL);
    for (int n = 0; n + NRL <= N; n += NRL) {
        const uint8_t *r = w + (size_t)n * rb;
        __m512 acc[NRL]; __m128 am[NRL];
        for (int i = 0; i < NRL; i++) { acc[i] = _mm512_setzero_ps(); am[i] = _mm_setzero_ps(); }
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512(q + 64 * p);
            __m128 dx2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
            __m512 dxv = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(dx2));
            __m128 sv = _mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)));
            for (int i = 0; i < NRL; i++) {
                const uint8_t *blk = r + i * rb + (size_t)p * BLK;
                __m256i v = _mm256_loadu_si256((const __m256i *)blk);
                __m512i l = q3c_codes(v, spread, ms, tab64);
                __m128 dm = _mm_cvtph_ps(_mm256_castsi256_si128(v));
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xq)), dxv);
                acc[i] = _mm512_fmadd_ps(f, _mm512_broadcastss_ps(dm), acc[i]);
                am[i] = _mm_fmadd_ps(dm, sv, am[i]);
            }
        }
        for (int i = 0; i < NRL; i++) { __m128 t = _mm_add_ss(am[i], _mm_movehdup_ps(am[i])); y[n + i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(t); }
    }
}
/* 4-row float reduction: i0..i3 -> lanes 4j+r */
static inline __m512i red4(__m512i i0, __m512i i1, __m512i i2, __m512i i3) {
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(i2, i3), _mm512_unpackhi_epi32(i2, i3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
/* C/D: 4-row reduce; NEW selects layout */
#define MVRED(NAME, NEW) \
static void NAME(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab, float *y) { \
    const __m512i spread = _mm512_loadu_si512(SPREAD); \
    const __m512i ms = _mm512_set1_epi64(0x15120f0c09060300LL); \
    const __m512i dsel = _mm512_setr_epi32(0,2,4,6, 0,2,4,6, 0,2,4,6, 0,2,4,6); \
    const __m512i xsel = _mm512_setr_epi32(0,0,0,0, 0,0,0,0, 1,1,1,1, 1,1,1,1); \
    const __m256i ssel = _mm256_setr_epi32(0,1,0,1,0,1,0,1); \
    for (int n = 0; n + 4 <= N; n += 4) { \
        const uint8_t *r = w + (size_t)n * rb; \
        __m512 acc = _mm512_setzero_ps(); __m256 am = _mm256_setzero_ps(); \
        for (int p = 0; p < np; p++) { \
            __m512i xq = _mm512_loadu_si512(q + 64 * p); \
            __m512 dxv = _mm512_permutexvar_ps(xsel, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p))))); \
            __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)))), ssel); \
            const uint8_t *b0 = r + (size_t)p * BLK, *b1 = b0 + rb, *b2 = b1 + rb, *b3 = b2 + rb; \
            __m512i i0, i1, i2, i3; __m128i h; \
            if (NEW) { \
                __m256i v0 = _mm256_loadu_si256((const __m256i *)b0), v1 = _mm256_loadu_si256((const __m256i *)b1); \
                __m256i v2 = _mm256_loadu_si256((const __m256i *)b2), v3 = _mm256_loadu_si256((const __m256i *)b3); \
                i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v0, spread, ms, tab), xq); \
                i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v1, spread, ms, tab), xq); \
                i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v2, spread, ms, tab), xq); \
                i3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v3, spread, ms, tab), xq); \
                h = _mm_unpacklo_epi64(_mm_unpacklo_epi32(_mm256_castsi256_si128(v0), _mm256_castsi256_si128(v1)), \
                                       _mm_unpacklo_epi32(_mm256_castsi256_si128(v2), _mm256_castsi256_si128(v3))); \
            } else { \
                i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b0, tab), xq); \
                i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b1, tab), xq); \
                i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b2, tab), xq); \
                i3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b3, tab), xq); \
                h = _mm_setr_epi32((int)rd32(b0), (int)rd32(b1), (int)rd32(b2), (int)rd32(b3)); \
            } \
            __m256 dm = _mm256_cvtph_ps(h); \
            __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, _mm512_castps256_ps512(dm)), dxv); \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(i0, i1, i2, i3)), wv, acc); \
            am = _mm256_fmadd_ps(dm, sv, am); \
        } \
        float t[16], u[8]; _mm512_storeu_ps(t, acc); _mm256_storeu_ps(u, am); \
        for (int i = 0; i < 4; i++) y[n + i] = (t[i] + t[4 + i]) + (t[8 + i] + t[12 + i]) + (u[2 * i] + u[2 * i + 1]); \
    } \
}
#define MVREDH(NAME, NEW) \
static void NAME(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab, float *y) { \
    const __m512i spread = _mm512_loadu_si512(SPREAD); \
    const __m512i ms = _mm512_set1_epi64(0x15120f0c09060300LL); \
    const __m512i dsel = _mm512_setr_epi32(0,2,4,6, 0,2,4,6, 0,2,4,6, 0,2,4,6); \
    const __m512i xsel = _mm512_setr_epi32(0,0,0,0, 0,0,0,0, 1,1,1,1, 1,1,1,1); \
    const __m256i ssel = _mm256_setr_epi32(0,1,0,1,0,1,0,1); \
    static __m512 dxs[1024]; static __m256 svs[1024]; \
    for (int p = 0; p < np; p++) { dxs[p] = _mm512_permutexvar_ps(xsel, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p))))); svs[p] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)(sp + 2 * p)))), ssel); } \
    for (int n = 0; n + 4 <= N; n += 4) { \
        const uint8_t *r = w + (size_t)n * rb; \
        __m512 acc = _mm512_setzero_ps(); __m256 am = _mm256_setzero_ps(); \
        for (int p = 0; p < np; p++) { \
            __m512i xq = _mm512_loadu_si512(q + 64 * p); \
            __m512 dxv = dxs[p]; \
            __m256 sv = svs[p]; \
            const uint8_t *b0 = r + (size_t)p * BLK, *b1 = b0 + rb, *b2 = b1 + rb, *b3 = b2 + rb; \
            __m512i i0, i1, i2, i3; __m128i h; \
            if (NEW) { \
                __m256i v0 = _mm256_loadu_si256((const __m256i *)b0), v1 = _mm256_loadu_si256((const __m256i *)b1); \
                __m256i v2 = _mm256_loadu_si256((const __m256i *)b2), v3 = _mm256_loadu_si256((const __m256i *)b3); \
                i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v0, spread, ms, tab), xq); \
                i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v1, spread, ms, tab), xq); \
                i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v2, spread, ms, tab), xq); \
                i3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3c_codes(v3, spread, ms, tab), xq); \
                h = _mm_unpacklo_epi64(_mm_unpacklo_epi32(_mm256_castsi256_si128(v0), _mm256_castsi256_si128(v1)), \
                                       _mm_unpacklo_epi32(_mm256_castsi256_si128(v2), _mm256_castsi256_si128(v3))); \
            } else { \
                i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b0, tab), xq); \
                i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b1, tab), xq); \
                i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b2, tab), xq); \
                i3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q3_codes(b3, tab), xq); \
                h = _mm_setr_epi32((int)rd32(b0), (int)rd32(b1), (int)rd32(b2), (int)rd32(b3)); \
            } \
            __m256 dm = _mm256_cvtph_ps(h); \
            __m512 wv = _mm512_mul_ps(_mm512_permutexvar_ps(dsel, _mm512_castps256_ps512(dm)), dxv); \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(i0, i1, i2, i3)), wv, acc); \
            am = _mm256_fmadd_ps(dm, sv, am); \
        } \
        float t[16], u[8]; _mm512_storeu_ps(t, acc); _mm256_storeu_ps(u, am); \
        for (int i = 0; i < 4; i++) y[n + i] = (t[i] + t[4 + i]) + (t[8 + i] + t[12 + i]) + (u[2 * i] + u[2 * i + 1]); \
    } \
}
MVREDH(mvH, 1)
MVRED(mvC, 1)
MVRED(mvD, 0)


/* E: row = [d x G fp16][m x G fp16][codes 24 B x G]; scales to float per 4-row tile */
static void mvE(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab64, float *y) {
    const __m512i didx = _mm512_setr_epi32(0,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1);
    const __m512i spread = _mm512_loadu_si512(SPREAD);
    const __m512i ms = _mm512_set1_epi64(0x15120f0c09060300LL);
    float ds[4][512] __attribute__((aligned(64)));
    for (int n = 0; n + NRL <= N; n += NRL) {
        const uint8_t *r = w + (size_t)n * rb;
        __m512 acc[NRL]; float mt[NRL];
        for (int i = 0; i < NRL; i++) {
            const uint8_t *row = r + i * rb;
            __m512 a = _mm512_setzero_ps();
            int p = 0;
            for (; p + 16 <= np; p += 16) {
                _mm512_store_ps(ds[i] + p, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * p))));
                a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * np + 2 * p))), _mm512_loadu_ps(sp + p), a);
            }
            if (p < np) {
                __mmask16 k = (__mmask16)((1u << (np - p)) - 1);
                _mm512_store_ps(ds[i] + p, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, row + 2 * p)));
                a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, row + 2 * np + 2 * p)), _mm512_maskz_loadu_ps(k, sp + p), a);
            }
            mt[i] = _mm512_reduce_add_ps(a);
            acc[i] = _mm512_setzero_ps();
        }
        const uint8_t *c0 = r + 4 * np;
        for (int p = 0; p < np; p++) {
            __m512i xq = _mm512_loadu_si512(q + 64 * p);
            __m512 dxv = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)))));
            for (int i = 0; i < NRL; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(c0 + i * rb + 24 * p));
                __m512i l = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(ms, _mm512_permutexvar_epi8(spread, _mm512_castsi256_si512(v))), tab64);
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xq)), dxv);
                acc[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(ds[i][p]), acc[i]);
            }
        }
        for (int i = 0; i < NRL; i++) y[n + i] = _mm512_reduce_add_ps(acc[i]) + mt[i];
    }
}

/* F/G: C with per-tile precomputed d (transposed) and m dot; G uses vpexpandb loads */
#define MVF(NAME) \
static void NAME(const uint8_t *w, size_t rb, int N, int np, const int8_t *q, const float *dx, const float *sp, __m512i tab, float *y) { \
    const __m512i spread = _mm512_loadu_si512(SPREAD); \
    const __m512i ms = _mm512_set1_epi64(0x15120f0c09060300LL); \
    const __m512i xsel = _mm512_setr_epi32(0,0,0,0, 0,0,0,0, 1,1,1,1, 1,1,1,1); \
    static __m512 dxv[1024]; static float dT[4096] __attribute__((aligned(64))); static uint16_t dH[4096], mH[4][1024]; static float spp[1024]; \
    for (int p = 0; p < np; p++) { dxv[p] = _mm512_permutexvar_ps(xsel, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p))))); spp[p] = sp[2*p+1]; } \
    for (int n = 0; n + 4 <= N; n += 4) { \
        const uint8_t *r = w + (size_t)n * rb; \
        for (int p = 0; p < np; p++) for (int i = 0; i < 4; i++) { uint32_t h = rd32(r + i * rb + (size_t)p * BLK); dH[4 * p + i] = (uint16_t)h; mH[i][p] = (uint16_t)(h >> 16); } \
        float mt[4]; \
        for (int i = 0; i < 4; i++) { __m512 a = _mm512_setzero_ps(); int p = 0; \
            for (; p + 16 <= np; p += 16) a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mH[i] + p))), _mm512_loadu_ps(spp + p), a); \
            float t = _mm512_reduce_add_ps(a); for (; p < np; p++) t += _cvtsh_ss(mH[i][p]) * spp[p]; mt[i] = t; } \
        int p4 = 0; for (; p4 + 16 <= 4 * np; p4 += 16) _mm512_store_ps(dT + p4, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dH + p4)))); \
        for (; p4 < 4 * np; p4++) dT[p4] = _cvtsh_ss(dH[p4]); \
        __m512 acc = _mm512_setzero_ps(); \
        for (int p = 0; p < np; p++) { \
            __m512i xq = _mm512_loadu_si512(q + 64 * p); \
            const uint8_t *b0 = r + (size_t)p * BLK; \
            __m512i l[4]; \
            for (int i = 0; i < 4; i++) { \
                __m512i x = _mm512_permutexvar_epi8(spread, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + i * rb)))); \
                l[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(ms, x), tab), xq); \
            } \
            __m512 wv = _mm512_mul_ps(_mm512_broadcast_f32x4(_mm_load_ps(dT + 4 * p)), dxv[p]); \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red4(l[0], l[1], l[2], l[3])), wv, acc); \
        } \
        float t[16]; _mm512_storeu_ps(t, acc); \
        for (int i = 0; i < 4; i++) y[n + i] = (t[i] + t[4 + i]) + (t[8 + i] + t[12 + i]) + mt[i]; \
    } \
}
MVF(mvF)


int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 4864, K = argc > 2 ? atoi(argv[2]) : 896, reps = argc > 3 ? atoi(argv[3]) : 50;
    int np = K / 64; size_t rb = (size_t)np * BLK;
    uint8_t *w = aligned_alloc(64, rb * N + 64);
    for (size_t i = 0; i < rb * N + 64; i++) w[i] = rand();
    for (int n = 0; n < N; n++) for (int p = 0; p < np; p++) { uint8_t *b = w + n * rb + p * BLK; b[0] = 0; b[1] = 0x3c; b[2] = 0; b[3] = 0xb8; }
    int8_t *q = aligned_alloc(64, K); for (int i = 0; i < K; i++) q[i] = rand();
    float *dx = malloc(K / 32 * 4 + 128), *sp = malloc(K / 32 * 4 + 128), *y = malloc(N * 4);
    for (int i = 0; i < K / 32; i++) { dx[i] = 0.01f; sp[i] = (i & 1) ? 1.0f : 0.0f; }
    uint8_t t16[16] = {1, 9, 20, 40, 60, 80, 100, 120}, t64[64];
    for (int i = 0; i < 64; i++) t64[i] = t16[i & 7];
    __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t16)), tab64 = _mm512_loadu_si512(t64);
    double best[7] = {1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9}; const char *nm[7] = {"A planar", "B pack3c", "C B+4row", "D A+4row", "E split", "F C+gather", "H C+dxs"};
    for (int round = 0; round < 5; round++) for (int v = 0; v < 7; v++) {
        double t0 = now();
        for (int r = 0; r < reps; r++) {
            if (v == 0) mvA(w, rb, N, np, q, dx, sp, tab, y);
            else if (v == 1) mvB(w, rb, N, np, q, dx, sp, tab64, y);
            else if (v == 2) mvC(w, rb, N, np, q, dx, sp, tab64, y);
            else if (v == 3) mvD(w, rb, N, np, q, dx, sp, tab, y);
            else if (v == 4) mvE(w, rb, N, np, q, dx, sp, tab64, y);
            else if (v == 5) mvF(w, rb, N, np, q, dx, sp, tab64, y);
            else mvH(w, rb, N, np, q, dx, sp, tab64, y);
        }
        double t = (now() - t0) / reps; if (t < best[v]) best[v] = t;
    }
    for (int v = 0; v < 7; v++) printf("%-10s %8.1f us  %6.1f GB/s\n", nm[v], best[v] * 1e6, rb * N / best[v] / 1e9);
}
