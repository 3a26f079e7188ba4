/* The AVX2 tier's entries (kern_avx2.c), for the dispatcher. */
#ifndef MIXQRT_KERN_AVX2_H
#define MIXQRT_KERN_AVX2_H
#include "mq_kern.h"

void mq_quantize_act_avx2(const float *x, int K, int kp, int8_t *q, float *d, float *s);
void mq_mm_rows_avx2(const mq_mm_job *j, int n0, int n1);
#endif
