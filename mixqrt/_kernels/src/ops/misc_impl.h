/* Float ops of a layer, written so that gcc vectorizes them without reassociating: the same source
 * is compiled per tier (misc.c, misc_avx2.c, misc_avx512.c) and gives bit-identical results in all
 * tiers. Include with MQ_SFX defined (function-name suffix). */
#include <math.h>
#include <string.h>

#include "mq_ops.h"

#define MQ_CAT2(a, b) a##b
#define MQ_CAT(a, b) MQ_CAT2(a, b)
#define MQ_FN(name) MQ_CAT(name, MQ_SFX)

#define MQ_EXP_LO (-87.0f)
#define MQ_EXP_HI (88.0f)

/* exp on [MQ_EXP_LO, MQ_EXP_HI]: Cody-Waite reduction by ln2 + degree-6 polynomial (cephes expf),
 * scale 2^n built in the exponent bits. Max relative error ~2 ulp; out of range -> libm expf. */
static inline float MQ_FN(fexp_)(float x) {
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

static inline float MQ_FN(hexp_)(float x) {   /* hybrid: fast in range, exact outside */
    return (x >= MQ_EXP_LO && x <= MQ_EXP_HI) ? MQ_FN(fexp_)(x) : expf(x);
}

float MQ_FN(mq_expf_fast_)(float x) { return MQ_FN(hexp_)(x); }

void MQ_FN(mq_rmsnorm_)(const float *x, const float *w, float *y, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *yr = y + (size_t)t * D;
        double a[8] = {0};
        int i = 0;
        for (; i + 8 <= D; i += 8) for (int l = 0; l < 8; l++) a[l] += (double)xr[i + l] * xr[i + l];
        for (; i < D; i++) a[0] += (double)xr[i] * xr[i];
        double ss = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        float r = (float)(1.0 / sqrt(ss / D + (double)eps));
        for (i = 0; i < D; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

void MQ_FN(mq_silu_mul_)(const float *g, const float *u, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float e = MQ_FN(hexp_)(-g[i]);
        y[i] = g[i] / (1.0f + e) * u[i];
    }
}

/* one row in place; returns nothing. fast=0 uses libm expf everywhere (the "exact" variant). */
static void MQ_FN(softmax_row_)(float *x, int n, int fast) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    if (mx == -INFINITY) { for (int i = 0; i < n; i++) x[i] = 0.0f; return; }
    float sum[16] = {0};
    int i = 0;
    if (fast) {
        for (i = 0; i < n; i++) x[i] = MQ_FN(hexp_)(x[i] - mx);
    } else {
        for (i = 0; i < n; i++) x[i] = expf(x[i] - mx);
    }
    for (i = 0; i + 16 <= n; i += 16) for (int l = 0; l < 16; l++) sum[l] += x[i + l];
    for (; i < n; i++) sum[0] += x[i];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += sum[l];
    float inv = 1.0f / s;
    for (i = 0; i < n; i++) x[i] *= inv;
}

void MQ_FN(mq_softmax_rows_)(float *x, int rows, int n, int fast) {
    for (int r = 0; r < rows; r++) MQ_FN(softmax_row_)(x + (size_t)r * n, n, fast);
}

static inline float MQ_FN(dotf_)(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) acc[i & 15] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* Heads [h0, h1) of causal GQA attention. q [T,Hq,Dh]; k, v [Hkv,S,Dh] (f32, or f16 if kv_f16);
 * out [T,Hq,Dh]; scratch: S + 2*Dh floats. */
void MQ_FN(mq_attention_)(const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                          int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch) {
    int g = Hq / Hkv;
    float scale = (float)(1.0 / sqrt((double)Dh));
    float *sc = scratch, *kr = scratch + S, *o = kr + Dh;
    for (int h = h0; h < h1; h++) {
        int kh = h / g;
        for (int t = 0; t < T; t++) {
            const float *qr = q + ((size_t)t * Hq + h) * Dh;
            int n = pos0 + t + 1;
            if (n > S) n = S;
            for (int i = 0; i < n; i++) {
                size_t off = ((size_t)kh * S + i) * Dh;
                const float *krow;
                if (kv_f16) {
                    const uint16_t *kp = (const uint16_t *)k + off;
                    for (int d = 0; d < Dh; d++) kr[d] = mq_h2f(kp[d]);
                    krow = kr;
                } else {
                    krow = (const float *)k + off;
                }
                sc[i] = MQ_FN(dotf_)(qr, krow, Dh) * scale;
            }
            MQ_FN(softmax_row_)(sc, n, 1);
            for (int d = 0; d < Dh; d++) o[d] = 0.0f;
            for (int i = 0; i < n; i++) {
                size_t off = ((size_t)kh * S + i) * Dh;
                float p = sc[i];
                if (kv_f16) {
                    const uint16_t *vp = (const uint16_t *)v + off;
                    for (int d = 0; d < Dh; d++) o[d] += p * mq_h2f(vp[d]);
                } else {
                    const float *vr = (const float *)v + off;
                    for (int d = 0; d < Dh; d++) o[d] += p * vr[d];
                }
            }
            memcpy(out + ((size_t)t * Hq + h) * Dh, o, (size_t)Dh * 4);
        }
    }
}
