/* AVX-512 tier, the base every kernel file of the tier reads: activation quantization, the q3x level
 * tables and the per-call context (ctx_init). It calls no other file of the tier. Internals:
 * kern_avx512_impl.h. */
#include "kern_avx512_impl.h"

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

/* the tables of a level table: kept per thread for the last level table seen (a product asks once
 * per chunk and thread); the pointer is valid on this thread until its next call */
const __m512i *mq_avx512_q3x_tables(const uint8_t *levels) {
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

void ctx_init(ctx_t *cx, const mq_mm_job *j) {
    cx->fmt = j->fmt; cx->nc = j->nc; cx->end = j->w + (size_t)j->N * j->row_bytes; cx->q5_lo = j->q5_lo; cx->q5_step = j->q5_step;
    uint8_t t16[16] = {0}, t64[64];
    if (j->q3p_levels) memcpy(t16, j->q3p_levels, MQ_Q3P_NLEVELS);
    for (int i = 0; i < 64; i++) t64[i] = t16[i & 7];
    cx->tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t16));
    cx->tab64 = _mm512_loadu_si512(t64);
    cx->t3x = j->fmt == MQ_Q3X ? mq_avx512_q3x_tables(t16) : NULL;
    cx->p3lo = _mm512_loadu_si512(PERM_Q3U[0]); cx->p3hi = _mm512_loadu_si512(PERM_Q3U[1]);
    cx->p6lo = _mm512_loadu_si512(PERM_Q6[0]); cx->p6hi = _mm512_loadu_si512(PERM_Q6[1]);
    cx->bitsel = _mm512_loadu_si512(BITSEL);
    static const uint16_t pw16[32] = {0, 0, 0, 0, 0, 0, 0, 0, 13, 13, 13, 13, 13, 13, 13, 13};
    cx->pw16 = _mm512_loadu_si512(pw16);
}
