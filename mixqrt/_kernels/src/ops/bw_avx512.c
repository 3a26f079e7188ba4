/* AVX-512 read patterns of the bandwidth probe (bw.c): 64-byte loads in one stream, or S
 * independent streams with software prefetch `pf` bytes ahead, or S streams of non-temporal loads
 * (vmovntdqa). */
#include <immintrin.h>

#include "bw.h"

static uint64_t hsum(__m512i s) { return (uint64_t)_mm512_reduce_add_epi64(s); }

uint64_t mq_bw_sweep_avx512_1s(const uint8_t *b, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(b + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(b + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(b + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(b + i + 192));
    }
    return hsum(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}

/* S streams over consecutive parts of [b, b + n); each step reads 128 bytes per stream */
#define SWEEPS(S, LOAD, PF)                                                                    \
    size_t part = n / (S) / 128 * 128;                                                         \
    const uint8_t *p[S];                                                                       \
    __m512i acc[S];                                                                            \
    for (int s = 0; s < (S); s++) { p[s] = b + s * part; acc[s] = _mm512_setzero_si512(); }    \
    for (size_t i = 0; i < part; i += 128) {                                                   \
        for (int s = 0; s < (S); s++) {                                                        \
            if (PF) {                                                                          \
                _mm_prefetch((const char *)p[s] + i + (PF), _MM_HINT_T0);                      \
                _mm_prefetch((const char *)p[s] + i + (PF) + 64, _MM_HINT_T0);                 \
            }                                                                                  \
            acc[s] = _mm512_add_epi64(acc[s], _mm512_add_epi64(LOAD(p[s] + i), LOAD(p[s] + i + 64))); \
        }                                                                                      \
    }                                                                                          \
    __m512i t = acc[0];                                                                        \
    for (int s = 1; s < (S); s++) t = _mm512_add_epi64(t, acc[s]);                             \
    return hsum(t);

#define LD(q) _mm512_load_si512(q)
#define LDNT(q) _mm512_stream_load_si512((void *)(q))

uint64_t mq_bw_sweep_avx512_2s(const uint8_t *b, size_t n) { SWEEPS(2, LD, 0) }
uint64_t mq_bw_sweep_avx512_4s(const uint8_t *b, size_t n) { SWEEPS(4, LD, 0) }
uint64_t mq_bw_sweep_avx512_2s_pf(const uint8_t *b, size_t n) { SWEEPS(2, LD, 2048) }
uint64_t mq_bw_sweep_avx512_4s_pf(const uint8_t *b, size_t n) { SWEEPS(4, LD, 1024) }
uint64_t mq_bw_sweep_avx512_8s_pf(const uint8_t *b, size_t n) { SWEEPS(8, LD, 512) }
uint64_t mq_bw_sweep_avx512_1s_pf(const uint8_t *b, size_t n) { SWEEPS(1, LD, 4096) }
uint64_t mq_bw_sweep_avx512_4s_nt(const uint8_t *b, size_t n) { SWEEPS(4, LDNT, 0) }
