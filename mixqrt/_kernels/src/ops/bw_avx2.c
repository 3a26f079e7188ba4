/* AVX2 read patterns of the bandwidth probe (bw.c): 32-byte loads, 4 streams, software prefetch. */
#include <immintrin.h>

#include "bw.h"

uint64_t mq_bw_sweep_avx2(const uint8_t *b, size_t n) {
    size_t part = n / 4 / 64 * 64;
    const uint8_t *p0 = b, *p1 = b + part, *p2 = b + 2 * part, *p3 = b + 3 * part;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < part; i += 64) {
        _mm_prefetch((const char *)p0 + i + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)p1 + i + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)p2 + i + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)p3 + i + 1024, _MM_HINT_T0);
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_load_si256((const __m256i *)(p0 + i)), _mm256_load_si256((const __m256i *)(p0 + i + 32))));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_load_si256((const __m256i *)(p1 + i)), _mm256_load_si256((const __m256i *)(p1 + i + 32))));
        a2 = _mm256_add_epi64(a2, _mm256_add_epi64(_mm256_load_si256((const __m256i *)(p2 + i)), _mm256_load_si256((const __m256i *)(p2 + i + 32))));
        a3 = _mm256_add_epi64(a3, _mm256_add_epi64(_mm256_load_si256((const __m256i *)(p3 + i)), _mm256_load_si256((const __m256i *)(p3 + i + 32))));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (uint64_t)_mm_cvtsi128_si64(h) + (uint64_t)_mm_extract_epi64(h, 1);
}
