/* AVX2 tier (AVX2 + FMA + F16C + BMI2). */
#include <immintrin.h>
#include <string.h>

#include "mq_ops.h"

void mq_quantize_act_avx2(const float *x, int K, int kp, int8_t *q, float *d, float *s) {
    mq_quantize_act_generic(x, K, kp, q, d, s);
}

void mq_mm_rows_avx2(const mq_mm_job *j, int n0, int n1) { mq_mm_rows_generic(j, n0, n1); }
