/* The products' dispatcher: the one file that sees every tier (kern_generic.h, kern_avx2.h,
 * kern_avx512.h). It picks the tier mq_isa_get() names per call, routes the interleaved formats
 * (q4x / q6x / q3x) where a tier or a row range has no native path, and forwards the AVX-512 tier's
 * tuning switches. No tier calls back into this file. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"
#include "mq_ops.h"
#include "kern_generic.h"
#include "kern_avx2.h"
#include "kern_avx512.h"

/* ------------------------------------------------------------------ activations */
void mq_quantize_act_rows(const float *x, size_t ldx, mq_act *a, int t0, int t1) {
    int isa = mq_isa_get();
    for (int t = t0; t < t1; t++) {
        const float *xr = x + (size_t)t * ldx;
        int8_t *q = a->q + (size_t)t * a->kp;
        float *d = a->d + (size_t)t * a->ncp, *s = a->s + (size_t)t * a->ncp;
#if defined(__x86_64__)
        if (isa >= MQ_ISA_AVX512) { mq_quantize_act_avx512(xr, a->K, a->kp, q, d, s); continue; }
        if (isa >= MQ_ISA_AVX2) { mq_quantize_act_avx2(xr, a->K, a->kp, q, d, s); continue; }
#endif
        mq_quantize_act_generic(xr, a->K, a->kp, q, d, s);
    }
}

/* ------------------------------------------------------------------ products */
/* q4x / q6x / q3x where a tier has no native path (AVX2, portable, or a row range that cuts a group):
 * the groups are gathered into q4 / q6 / q3p rows in a per-thread buffer of their own (the kernels
 * take mq_scratch), some at a time, and the tier's kernel of the base format runs on them. A block is ~32 KB for decode (stays in L1/L2)
 * and ~1 MB, at least 64 rows, for T > 1 (a prefill re-lays out its activations per call). */
static __thread uint8_t *tl_x = NULL;
static __thread size_t tl_x_cap = 0;

static void mm_rows_x_via_rows(const mq_mm_job *j, int n0, int n1, void (*tier)(const mq_mm_job *, int, int)) {
    const size_t rb = j->row_bytes;
    const size_t want = j->T == 1 ? (size_t)32 << 10 : (size_t)1 << 20;
    int R = (int)(want / rb) / MQ_XROWS * MQ_XROWS;
    if (R < (j->T == 1 ? MQ_XROWS : 64)) R = j->T == 1 ? MQ_XROWS : 64;
    uint8_t *buf = (uint8_t *)mq_tl_grow(&tl_x, &tl_x_cap, (size_t)R * rb);
    if (buf == NULL) {   /* out of memory: NaN, never a silent wrong product */
        for (int t = 0; t < j->T; t++) for (int n = n0; n < n1; n++) j->y[(size_t)t * j->ldy + n] = NAN;
        return;
    }
    mq_mm_job q = *j;
    q.fmt = mq_x_base(j->fmt); q.tiles = NULL; q.w = buf;
    for (int g0 = n0 / MQ_XROWS * MQ_XROWS; g0 < n1; g0 += R) {
        int ng = n1 - g0 < R ? (n1 - g0 + MQ_XROWS - 1) / MQ_XROWS * MQ_XROWS : R;
        for (int g = 0; g < ng; g += MQ_XROWS)
            mq_x_group_to_rows(j->fmt, j->w + (size_t)(g0 + g) * rb, j->fmt == MQ_Q3X ? j->nc / 2 : j->nc, buf + (size_t)g * rb);
        q.N = ng; q.y = j->y + g0;
        int a = n0 > g0 ? n0 - g0 : 0, b = n1 - g0 < ng ? n1 - g0 : ng;
        tier(&q, a, b);
    }
}

void mq_mm_rows(const mq_mm_job *j, int n0, int n1) {
    void (*tier)(const mq_mm_job *, int, int) = mq_mm_rows_generic;
#if defined(__x86_64__)
    int isa = mq_isa_get();
    if (isa >= MQ_ISA_AVX512) tier = mq_mm_rows_avx512;
    else if (isa >= MQ_ISA_AVX2) tier = mq_mm_rows_avx2;
    /* q4x / q6x / q3x on whole groups: native on AVX-512 (decode kernels, GEMM tiles straight from the
     * groups) and AVX2 (decode kernels, and their unpack shared by up to 4 tokens for T >= 2) */
    if (mq_x_base(j->fmt) >= 0 && n0 % MQ_XROWS == 0 && n1 % MQ_XROWS == 0 && isa >= MQ_ISA_AVX2) { tier(j, n0, n1); return; }
#endif
    if (mq_x_base(j->fmt) >= 0) { mm_rows_x_via_rows(j, n0, n1, tier); return; }
    tier(j, n0, n1);
}

int mq_gemm_shared_gt(const mq_mm_job *j) {
#if defined(__x86_64__)
    if (mq_isa_get() >= MQ_ISA_AVX512) return mq_gemm_shared_gt_avx512(j);
#endif
    (void)j;
    return 0;
}

size_t mq_gemm_act_bytes(const mq_act *a, int gt) {
#if defined(__x86_64__)
    if (mq_isa_get() >= MQ_ISA_AVX512) return mq_gemm_act_bytes_avx512(a, gt);
#endif
    (void)a; (void)gt;
    return 0;
}

void mq_gemm_interleave(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out) {
#if defined(__x86_64__)
    if (mq_isa_get() >= MQ_ISA_AVX512) mq_gemm_interleave_avx512(a, fmt, gt, g0, g1, out);
#endif
    (void)a; (void)fmt; (void)gt; (void)g0; (void)g1; (void)out;
}

int mq_gemm_tiles_build(const mq_mm_job *j, uint8_t *out, int n0, int n1) {
#if defined(__x86_64__)
    if (mq_isa_get() >= MQ_ISA_AVX512) return mq_gemm_tiles_build_avx512(j, out, n0, n1);
#endif
    (void)j; (void)out; (void)n0; (void)n1;
    return -1;
}

/* ------------------------------------------------------------------ tuning switches (AVX-512 tier) */
#if defined(__x86_64__)
void mq_set_gemm_min_t(int t) { mq_avx512_set_gemm_min_t(t); }
int mq_set_lean_mv(int on) { return mq_avx512_set_lean_mv(on); }
int mq_set_few_max_t(int t) { return mq_avx512_set_few_max_t(t); }
int mq_set_float_mv(int on) { return mq_avx512_set_float_mv(on); }
int mq_set_q6_fold(int on) { return mq_avx512_set_q6_fold(on); }
int mq_set_q2c_mv(int on) { return mq_avx512_set_q2c_mv(on); }
int mq_set_mv_xpf(int on) { return mq_avx512_set_mv_xpf(on); }
void mq_set_float_pf(size_t nbytes) { mq_avx512_set_float_pf(nbytes); }
#else
/* the tier files compile to nothing off x86: their tuning knobs still exist (and do nothing) */
void mq_set_gemm_min_t(int t) { (void)t; }
int mq_set_lean_mv(int on) { (void)on; return 0; }
int mq_set_few_max_t(int t) { (void)t; return 0; }
int mq_set_float_mv(int on) { (void)on; return 0; }
int mq_set_q6_fold(int on) { (void)on; return 0; }
int mq_set_q2c_mv(int on) { (void)on; return 0; }
int mq_set_mv_xpf(int on) { (void)on; return 0; }
void mq_set_float_pf(size_t nbytes) { (void)nbytes; }
#endif
