/* AVX2 tier (F16C): the plain f16 format's conversions. vcvtps2ph with imm 0 rounds to nearest even
 * and converts subnormals exactly (it ignores MXCSR.DAZ/FTZ), so it matches mq_f32_to_f16 bit for bit. */
#include <immintrin.h>
#include "mq_format.h"

void mq_f32_to_f16_avx2(const float *x, uint8_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) mq_put16(out + 2 * i, mq_f32_to_f16(x[i]));
}

void mq_f16_to_f32_avx2(const uint8_t *h, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * i))));
    for (; i < n; i++) out[i] = mq_f16_to_f32(mq_get16(h + 2 * i));
}
