/* What every product tier shares (kern_generic.c, kern_avx2.c, the kern_*_avx512.c files) and the
 * dispatcher (dispatch.c) passes them: the activation and job structs, per-thread scratch buffers and
 * the tuning values several tiers read. Depends on nothing tier-specific (shared.c). The math of a
 * product: mq_ops.h. */
#ifndef MIXQRT_MQ_KERN_H
#define MIXQRT_MQ_KERN_H
#include <stddef.h>
#include <stdint.h>

#include "mq_format.h"   /* format ids, block layouts, fp16, the dequantizer */

/* Quantized activations of T rows. Row t: q + t*kp (int8, kp a multiple of 128, zero padded),
 * d + t*ncp and s + t*ncp (ncp = kp / 32). */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int T, K, kp, ncp;
    /* the AVX-512 GEMM's interleaved copy of these activations for token groups of il_gt, made once
     * per product on the pool (mq_gemm_interleave); NULL: each GEMM call interleaves its own */
    const uint8_t *il;
    int il_gt;
} mq_act;

/* One product y[t, n] = sum_k W[n, k] x[t, k] over rows [n0, n1) of W. */
typedef struct {
    int fmt;
    const uint8_t *w;       /* packed bytes (or plain f32/f16/bf16 values) */
    size_t row_bytes;
    int N, K, nc;           /* nc: chunks per row including block padding */
    const mq_act *a;        /* packed formats */
    const float *x;         /* float formats: [T, K] row-major, row stride ldx */
    int T;
    size_t ldx;
    float *y;               /* [T, N] row stride ldy */
    size_t ldy;
    const uint8_t *q3p_levels; /* 8 bytes */
    float q5_lo, q5_step;      /* q5g trailer, decoded */
    const uint8_t *tiles;      /* NULL, or the tensor's cached GEMM tiles (mq_gemm_tiles_build; AVX-512 only) */
} mq_mm_job;

/* per-thread scratch of the kernels, 64 B aligned, grows, never freed */
void *mq_scratch(size_t n);
/* ops.matmul's per-thread activation buffer: a second one, since the kernels take mq_scratch inside
 * the same call; mq_call_buf_release frees a block too large to keep */
void *mq_call_buf(size_t n);
void mq_call_buf_release(void *p);
/* *buf grown to at least n bytes, 64 B aligned (contents not kept), never shrunk; NULL when out of memory */
void *mq_tl_grow(uint8_t **buf, size_t *cap, size_t n);

/* bytes of one 16-row block of cached GEMM tiles for rows of nc chunks (layout: mq_ops.h) */
size_t mq_gemm_tile_stride(int nc);
/* q3x decode's software prefetch distance into L2, bytes (default 16384; 0: none), shared by the
 * AVX-512 and AVX2 mv_q3x and the AVX-512 few-row kernels (q4x / q6x / q3x); set from MIXQRT_Q3X_PF
 * by mixqrt.platform.tuning */
size_t mq_q3x_prefetch(void);
void mq_set_q3x_prefetch(size_t nbytes);
#endif
