/* AVX-512 tier, float weights (f32 / f16 / bf16): one row at a time, or (opt-in) a 4-row decode
 * that shares the x loads. Internals: kern_avx512_impl.h. */
#include "kern_avx512_impl.h"

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

static int mq_float_mv = 0;   /* 1: the 4-row path (MIXQRT_FLOAT_MV=1) */
int mq_avx512_set_float_mv(int on) {
    int old = mq_float_mv;
    if (on >= 0) mq_float_mv = on ? 1 : 0;
    return old;
}
void mq_avx512_set_float_pf(size_t nbytes) { float_pf = nbytes; }

void mq_avx512_float(const mq_mm_job *j, int n0, int n1) {
    if (j->T == 1 && mq_float_mv) {
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
