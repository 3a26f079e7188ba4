/* Portable C tier: format table, activation quantization, unpack and the integer-dot product.
 * The numpy emulation in tests/test_ops_matmul.py follows this file line by line. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "mq_ops.h"

static const mq_fmtinfo FMT[7] = {
    /* group header chunk_bytes bits off */
    {32, 2, 32, 8, 128},   /* q8  */
    {32, 2, 24, 6, 32},    /* q6  */
    {32, 4, 16, 4, 0},     /* q4  */
    {64, 4, 12, 3, 0},     /* q3u */
    {64, 4, 12, 3, 0},     /* q3p */
    {128, 8, 8, 2, 0},     /* q2c */
    {32, 0, 20, 5, 0},     /* q5g */
};

const mq_fmtinfo *mq_fmt_info(int fmt) {
    return (fmt >= 0 && fmt <= MQ_Q5G) ? &FMT[fmt] : NULL;
}

float mq_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } v; v.u = u; return v.f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

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
static void codes32(int bits, const uint8_t *p, uint8_t *c) {
    switch (bits) {
    case 8: memcpy(c, p, 32); break;
    case 2: for (int i = 0; i < 8; i++) for (int j = 0; j < 4; j++) c[i + 8 * j] = (p[i] >> (2 * j)) & 3; break;
    case 3: {
        uint32_t hb = rd32(p + 8);
        for (int i = 0; i < 8; i++) for (int j = 0; j < 4; j++) c[i + 8 * j] = (p[i] >> (2 * j)) & 3;
        for (int i = 0; i < 32; i++) c[i] |= ((hb >> i) & 1) << 2;
        break;
    }
    case 4: for (int i = 0; i < 16; i++) { c[i] = p[i] & 15; c[i + 16] = p[i] >> 4; } break;
    case 5: {
        uint32_t hb = rd32(p + 16);
        for (int i = 0; i < 16; i++) { c[i] = p[i] & 15; c[i + 16] = p[i] >> 4; }
        for (int i = 0; i < 32; i++) c[i] |= ((hb >> i) & 1) << 4;
        break;
    }
    case 6:
        for (int i = 0; i < 16; i++) { c[i] = p[i] & 15; c[i + 16] = p[i] >> 4; }
        for (int i = 0; i < 8; i++) for (int j = 0; j < 4; j++) c[i + 8 * j] |= ((p[16 + i] >> (2 * j)) & 3) << 4;
        break;
    }
}

void mq_unpack_row_generic(const mq_mm_job *j, const uint8_t *row, uint8_t *lv, float *dw, float *mm) {
    const mq_fmtinfo *f = &FMT[j->fmt];
    int nb = j->nc / (f->group / 32), cpb = f->group / 32;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * (f->header + cpb * f->chunk_bytes);
        float d, m = 0.0f;
        if (j->fmt == MQ_Q5G) { d = j->q5_step; m = j->q5_lo; }
        else { d = mq_h2f(rd16(blk)); if (f->header >= 4) m = mq_h2f(rd16(blk + 2)); }
        for (int c = 0; c < cpb; c++) {
            int ci = b * cpb + c;
            uint8_t *o = lv + (size_t)ci * 32;
            codes32(f->bits, blk + f->header + c * f->chunk_bytes, o);
            if (j->fmt == MQ_Q8) for (int i = 0; i < 32; i++) o[i] ^= 0x80;
            else if (j->fmt == MQ_Q3P) for (int i = 0; i < 32; i++) o[i] = j->q3p_levels[o[i]];
            else if (j->fmt == MQ_Q2C) for (int i = 0; i < 32; i++) o[i] = blk[4 + o[i]];
            dw[ci] = d;
            mm[ci] = m - (float)f->off * d;
        }
    }
}

void mq_dequant_row(const mq_mm_job *j, int n, float *out) {
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    if (j->fmt == MQ_F32) { memcpy(out, row, (size_t)j->K * 4); return; }
    if (j->fmt == MQ_F16) { for (int k = 0; k < j->K; k++) out[k] = mq_h2f(rd16(row + 2 * k)); return; }
    if (j->fmt == MQ_BF16) { for (int k = 0; k < j->K; k++) out[k] = mq_bf2f(rd16(row + 2 * k)); return; }
    const mq_fmtinfo *f = &FMT[j->fmt];
    int nb = j->nc / (f->group / 32), cpb = f->group / 32;
    uint8_t c[32];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * (f->header + cpb * f->chunk_bytes);
        float d = 0.0f, m = 0.0f;
        if (j->fmt != MQ_Q5G) { d = mq_h2f(rd16(blk)); if (f->header >= 4) m = mq_h2f(rd16(blk + 2)); }
        for (int ch = 0; ch < cpb; ch++) {
            codes32(f->bits, blk + f->header + ch * f->chunk_bytes, c);
            for (int i = 0; i < 32; i++) {
                int k = (b * cpb + ch) * 32 + i;
                if (k >= j->K) return;
                float w;
                switch (j->fmt) {
                case MQ_Q8: w = d * (float)(int8_t)c[i]; break;
                case MQ_Q6: w = d * (float)((int)c[i] - 32); break;
                case MQ_Q3P: w = d * (float)j->q3p_levels[c[i]] + m; break;
                case MQ_Q2C: w = d * (float)blk[4 + c[i]] + m; break;
                case MQ_Q5G: w = j->q5_lo + (float)c[i] * j->q5_step; break;
                default: w = d * (float)c[i] + m; break;
                }
                out[k] = w;
            }
        }
    }
}

/* ------------------------------------------------------------------ products */
static __thread uint8_t *tl_buf = NULL;
static __thread size_t tl_cap = 0;

void *mq_scratch(size_t n) {      /* per-thread scratch, 64 B aligned, grows, never freed */
    if (n > tl_cap) {
        free(tl_buf);
        size_t cap = (n + 4095) & ~(size_t)4095;
        if (posix_memalign((void **)&tl_buf, 64, cap)) { tl_buf = NULL; tl_cap = 0; return NULL; }
        tl_cap = cap;
    }
    return tl_buf;
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
            else { mq_dequant_row(j, n, wf); wr = wf; }
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
                acc += (dw[c] * xd[c]) * (float)is;
                acc += mm[c] * xs[c];
            }
            j->y[(size_t)t * j->ldy + n] = acc;
        }
    }
}

void mq_mm_rows(const mq_mm_job *j, int n0, int n1) {
#if defined(__x86_64__)
    int isa = mq_isa_get();
    if (isa >= MQ_ISA_AVX512) { mq_mm_rows_avx512(j, n0, n1); return; }
    if (isa >= MQ_ISA_AVX2) { mq_mm_rows_avx2(j, n0, n1); return; }
#endif
    mq_mm_rows_generic(j, n0, n1);
}

#if !defined(__x86_64__)
/* the tier files compile to nothing off x86: their tuning knobs still exist (and do nothing) */
void mq_set_gemm_min_t(int t) { (void)t; }
int mq_set_lean_mv(int on) { (void)on; return 0; }
int mq_set_float_mv(int on) { (void)on; return 0; }
#endif
