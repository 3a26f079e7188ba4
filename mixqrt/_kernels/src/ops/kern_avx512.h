/* The AVX-512 tier's entries (kern_avx512.c, kern_mv_avx512.c, kern_gemm_avx512.c,
 * kern_float_avx512.c), for the dispatcher; the meaning of each: mq_ops.h. */
#ifndef MIXQRT_KERN_AVX512_H
#define MIXQRT_KERN_AVX512_H
#include "mq_kern.h"

void mq_quantize_act_avx512(const float *x, int K, int kp, int8_t *q, float *d, float *s);
void mq_mm_rows_avx512(const mq_mm_job *j, int n0, int n1);
int mq_gemm_shared_gt_avx512(const mq_mm_job *j);
size_t mq_gemm_act_bytes_avx512(const mq_act *a, int gt);
void mq_gemm_interleave_avx512(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out);
int mq_gemm_tiles_build_avx512(const mq_mm_job *j, uint8_t *out, int n0, int n1);
/* tuning switches (mq_ops.h: mq_set_*) */
void mq_avx512_set_gemm_min_t(int t);
int mq_avx512_set_lean_mv(int on);
int mq_avx512_set_few_max_t(int t);
int mq_avx512_set_q6_fold(int on);
int mq_avx512_set_q2c_mv(int on);
int mq_avx512_set_mv_xpf(int on);
int mq_avx512_set_float_mv(int on);
void mq_avx512_set_float_pf(size_t nbytes);
#endif
