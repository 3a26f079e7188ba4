/* Portable C tier: activation quantization, unpack and the integer-dot product.
 * The numpy emulation in tests/test_ops_matmul.py follows this file line by line. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "mq_ops.h"


/* ------------------------------------------------------------------ activations */
void mq_quantize_act_generic(const float *x, int K, int kp, int8_t *q, float *d, float *s) {
    for (int c = 0; c < kp / 32; c++) {
        int k0 = c * 32, n = K - k0;
        if (n > 32) n = 32;
        if (n <= 0) {
            memset(q + k0, 0, 32); d[c] = 0.0f; s[c] = 0.0f;
            continue;
        }
        float amax = 0.0f;
        for (int i = 0; i < n; i++) { float a = fabsf(x[k0 + i]); if (a > amax) amax = a; }
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = i < n ? (int)nearbyintf(x[k0 + i] * id) : 0;
            q[k0 + i] = (int8_t)v; sum += v;
        }
        d[c] = dd; s[c] = dd * (float)sum;
    }
}

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

/* ------------------------------------------------------------------ unpack */
void mq_unpack_row_generic(const mq_mm_job *j, const uint8_t *row, uint8_t *lv, float *dw, float *mm) {
    const mq_fmt_spec *f = &MQ_FORMATS[j->fmt];
    const int cpb = f->group / MQ_CHUNK, nb = j->nc / cpb, cb = MQ_CHUNK_BYTES(f->bits);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * f->block_bytes;
        float d, m = 0.0f;
        if (j->fmt == MQ_Q5G) { d = j->q5_step; m = j->q5_lo; }
        else {
            d = mq_f16_to_f32(mq_get16(blk + MQ_HDR_D));
            if (f->header > MQ_HDR_M) m = mq_f16_to_f32(mq_get16(blk + MQ_HDR_M));
        }
        for (int c = 0; c < cpb; c++) {
            int ci = b * cpb + c;
            uint8_t *o = lv + (size_t)ci * MQ_CHUNK;
            mq_unpack_chunk(blk + f->header + c * cb, f->pack, o);
            if (j->fmt == MQ_Q8) for (int i = 0; i < 32; i++) o[i] ^= 0x80;
            else if (j->fmt == MQ_Q3P) for (int i = 0; i < 32; i++) o[i] = j->q3p_levels[o[i]];
            else if (j->fmt == MQ_Q2C) for (int i = 0; i < 32; i++) o[i] = blk[MQ_Q2C_LUT + o[i]];
            dw[ci] = d;
            /* q8: the product subtracts off * sum(q) in integers (exact signed sums), as every tier does */
            mm[ci] = j->fmt == MQ_Q8 ? m : m - (float)f->off * d;
        }
    }
}

/* ------------------------------------------------------------------ products */
static __thread uint8_t *tl_buf = NULL;
static __thread size_t tl_cap = 0;

/* a per-thread buffer of at least n bytes, 64 B aligned: grown (contents not kept), never shrunk */
static void *grow(uint8_t **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        free(*buf);
        size_t c = (n + 4095) & ~(size_t)4095;
        if (posix_memalign((void **)buf, 64, c)) { *buf = NULL; *cap = 0; return NULL; }
        *cap = c;
    }
    return *buf;
}

void *mq_scratch(size_t n) {      /* per-thread scratch of the kernels, never freed */
    return grow(&tl_buf, &tl_cap, n);
}

/* ops.matmul's activation buffer (quantized rows, and the GEMM's interleaved copy of them): a second
 * per-thread buffer, since the kernels take mq_scratch inside the same call. Kept between calls up to
 * MQ_CALL_BUF_KEEP bytes (a 512-token prefill chunk of K = 4864 needs ~3.1 MB, ~6.5 MB with the
 * shared interleaved copy); a malloc per call made glibc give the pages back and fault them in
 * again, 54k page faults per rotated 128-token prefill. Larger requests get their own block, which
 * mq_call_buf_release frees. */
#define MQ_CALL_BUF_KEEP ((size_t)64 << 20)
static __thread uint8_t *tl_call = NULL;
static __thread size_t tl_call_cap = 0;

void *mq_call_buf(size_t n) {
    if (n > MQ_CALL_BUF_KEEP) {
        void *p = NULL;
        return posix_memalign(&p, 64, n) ? NULL : p;
    }
    return grow(&tl_call, &tl_call_cap, n);
}

void mq_call_buf_release(void *p) {
    if (p != NULL && p != (void *)tl_call) free(p);
}

static float dot_f32(const float *w, const float *x, int K) {
    float a[8] = {0};
    int k = 0;
    for (; k + 8 <= K; k += 8) for (int i = 0; i < 8; i++) a[i] += w[k + i] * x[k + i];
    for (; k < K; k++) a[k & 7] += w[k] * x[k];
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

void mq_mm_rows_generic(const mq_mm_job *j, int n0, int n1) {
    if (j->fmt >= MQ_F32) {
        float *wf = (float *)mq_scratch((size_t)j->K * 4);
        for (int n = n0; n < n1; n++) {
            const float *wr;
            if (j->fmt == MQ_F32) wr = (const float *)(j->w + (size_t)n * j->row_bytes);
            else { mq_dequant_row(j->fmt, j->w + (size_t)n * j->row_bytes, j->K, wf, NULL, 0.0f, 0.0f); wr = wf; }
            for (int t = 0; t < j->T; t++) j->y[(size_t)t * j->ldy + n] = dot_f32(wr, j->x + (size_t)t * j->ldx, j->K);
        }
        return;
    }
    int nc = j->nc;
    uint8_t *lv = (uint8_t *)mq_scratch((size_t)nc * 40);
    float *dw = (float *)(lv + (size_t)nc * 32), *mm = dw + nc;
    const mq_act *a = j->a;
    for (int n = n0; n < n1; n++) {
        mq_unpack_row_generic(j, j->w + (size_t)n * j->row_bytes, lv, dw, mm);
        for (int t = 0; t < j->T; t++) {
            const int8_t *q = a->q + (size_t)t * a->kp;
            const float *xd = a->d + (size_t)t * a->ncp, *xs = a->s + (size_t)t * a->ncp;
            float acc = 0.0f;
            for (int c = 0; c < nc; c++) {
                int32_t is = 0;
                for (int i = 0; i < 32; i++) is += (int32_t)lv[c * 32 + i] * q[c * 32 + i];
                if (j->fmt == MQ_Q8)
                    for (int i = 0; i < 32; i++) is -= MQ_Q8_OFF * q[c * 32 + i];
                acc += (dw[c] * xd[c]) * (float)is;
                acc += mm[c] * xs[c];
            }
            j->y[(size_t)t * j->ldy + n] = acc;
        }
    }
}

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
    uint8_t *buf = (uint8_t *)grow(&tl_x, &tl_x_cap, (size_t)R * rb);
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

int mq_gemm_shared_gt_avx512(const mq_mm_job *j);
size_t mq_gemm_act_bytes_avx512(const mq_act *a, int gt);
void mq_gemm_interleave_avx512(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out);

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

size_t mq_q3x_prefetch(void) {
    static _Atomic long pf = -1;   /* threads that race here all store the same value */
    long v = atomic_load_explicit(&pf, memory_order_relaxed);
    if (v < 0) {
        const char *e = getenv("MIXQRT_Q3X_PF");
        v = e ? atol(e) : 16384;
        if (v < 0) v = 0;
        atomic_store_explicit(&pf, v, memory_order_relaxed);
    }
    return (size_t)v;
}

size_t mq_gemm_tile_stride(int nc) {
    size_t nc2 = ((size_t)nc + 1) & ~(size_t)1;
    return nc2 * (8 * 16 * 4 + 2 * 16 * 4);
}

int mq_gemm_tiles_build(const mq_mm_job *j, uint8_t *out, int n0, int n1) {
#if defined(__x86_64__)
    if (mq_isa_get() >= MQ_ISA_AVX512) return mq_gemm_tiles_build_avx512(j, out, n0, n1);
#endif
    (void)j; (void)out; (void)n0; (void)n1;
    return -1;
}

#if !defined(__x86_64__)
/* the tier files compile to nothing off x86: their tuning knobs still exist (and do nothing) */
void mq_set_gemm_min_t(int t) { (void)t; }
int mq_set_lean_mv(int on) { (void)on; return 0; }
int mq_set_few_t(int on) { (void)on; return 0; }
int mq_set_float_mv(int on) { (void)on; return 0; }
int mq_set_q6_fold(int on) { (void)on; return 0; }
#endif
