/* q2c: deterministic 1-D k-means (4 levels) per group of 128; the spec is mixqrt/formats/kmeans.py and
 * every floating-point step here follows it in the same order (prefix sums left to right, float64). */
#include <string.h>

#include "kmeans.h"
#include "round.h"

#define MAX_ITERS 16
static const double U[3] = {0.5, 0.25, 0.75};

/* bottom-up merge sort: 128 values in 7 passes, no recursion, no libc comparator calls */
static void sortf(float *a, int n) {
    float tmp[128], *src = a, *dst = tmp;
    for (int w = 1; w < n; w *= 2) {
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n, i = lo, j = mid, o = lo;
            while (i < mid && j < hi) dst[o++] = src[j] < src[i] ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        float *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(float));
}

static void sort4(double *c) {
    for (int i = 1; i < 4; i++) { double v = c[i]; int j = i - 1; while (j >= 0 && c[j] > v) { c[j + 1] = c[j]; j--; } c[j + 1] = v; }
}

static int upper_bound(const float *s, int n, double t) {       /* how many s[i] <= t */
    int lo = 0, hi = n;
    while (lo < hi) { int mid = (lo + hi) >> 1; if ((double)s[mid] <= t) lo = mid + 1; else hi = mid; }
    return lo;
}

static void kmeans4(const float *s, int nv, double C[4]) {
    double P[129], d2[128];
    P[0] = 0.0;
    for (int i = 0; i < nv; i++) P[i + 1] = P[i] + (double)s[i];
    C[0] = (double)s[(nv - 1) / 2];
    for (int j = 1; j < 4; j++) {
        double total = 0.0;
        for (int i = 0; i < nv; i++) {
            double diff = (double)s[i] - C[j - 1], dj = diff * diff;
            d2[i] = (j == 1 || dj < d2[i]) ? dj : d2[i];
            total += d2[i];
        }
        double thr = U[j - 1] * total, cum = 0.0;
        int idx = nv - 1;
        for (int i = 0; i < nv; i++) { cum += d2[i]; if (cum > thr) { idx = i; break; } }
        C[j] = (double)s[idx];
    }
    sort4(C);
    int prev[3] = {0, 0, 0};
    for (int it = 0; it < MAX_ITERS; it++) {
        int b[5];
        b[0] = 0; b[4] = nv;
        for (int k = 0; k < 3; k++) b[k + 1] = upper_bound(s, nv, (C[k] + C[k + 1]) * 0.5);
        if (it > 0 && b[1] == prev[0] && b[2] == prev[1] && b[3] == prev[2]) break;
        for (int k = 0; k < 4; k++) {
            int cnt = b[k + 1] - b[k];
            if (cnt > 0) C[k] = (P[b[k + 1]] - P[b[k]]) / (double)cnt;
        }
        sort4(C);
        prev[0] = b[1]; prev[1] = b[2]; prev[2] = b[3];
    }
}

static inline float rnd255(float t) {
    t = t < 0.0f ? 0.0f : (t > 255.0f ? 255.0f : t);
    return (t + 12582912.0f) - 12582912.0f;
}

/* nearest reconstructed level (ties to the lower code); returns the float64 SSE in element order */
static double assign(const float *x, int nv, uint16_t dh, uint16_t mh, const uint8_t lut[4], uint8_t *codes) {
    float d = mq_f16_to_f32(dh), m = mq_f16_to_f32(mh), r[4];
    for (int j = 0; j < 4; j++) r[j] = d * (float)lut[j] + m;
    double sse = 0.0;
    for (int i = 0; i < nv; i++) {
        int best = 0;
        float bd = x[i] - r[0];
        bd = bd < 0 ? -bd : bd;
        for (int j = 1; j < 4; j++) { float e = x[i] - r[j]; e = e < 0 ? -e : e; if (e < bd) { bd = e; best = j; } }
        codes[i] = (uint8_t)best;
        double e = (double)x[i] - (double)r[best];
        sse += e * e;
    }
    return sse;
}

static uint16_t scale255(float lo_m, float hi, float *m_out) {
    float raw = (hi - lo_m) / 255.0f;
    if (!(raw > 0.0f)) raw = 0.0f;
    (void)m_out;
    return mq_snap(mq_f32_to_f16_rtz(raw), lo_m, 255.0f, hi);
}

void mq_q2c_block(const float *x, int nv, uint8_t *dst) {
    float s[128];
    double C[4];
    for (int i = 0; i < nv; i++) s[i] = x[i] + 0.0f;       /* -0.0 -> +0.0, as the reference does */
    sortf(s, nv);
    kmeans4(s, nv, C);
    float c[4];
    for (int j = 0; j < 4; j++) c[j] = (float)C[j];
    uint16_t mk = mq_f32_to_f16(c[0]);
    float m = mq_f16_to_f32(mk);
    uint16_t dk = scale255(m, c[3], 0);
    float d = mq_f16_to_f32(dk);
    uint8_t lutk[4], lutu[4] = {0, 85, 170, 255}, ck[128], cu[128];
    for (int j = 0; j < 4; j++) lutk[j] = d > 0 ? (uint8_t)rnd255((c[j] - m) / d) : 0;
    double sk = assign(x, nv, dk, mk, lutk, ck);
    uint16_t mu = mq_f32_to_f16(s[0]);
    uint16_t du = scale255(mq_f16_to_f32(mu), s[nv - 1], 0);
    if (!(mq_f16_to_f32(du) > 0)) memset(lutu, 0, 4);
    double su = assign(x, nv, du, mu, lutu, cu);
    int use_k = sk <= su;
    uint8_t codes[128];
    memset(codes, 0, sizeof codes);
    memcpy(codes, use_k ? ck : cu, (size_t)nv);
    mq_put16(dst + MQ_HDR_D, use_k ? dk : du);
    mq_put16(dst + MQ_HDR_M, use_k ? mk : mu);
    memcpy(dst + MQ_Q2C_LUT, use_k ? lutk : lutu, 4);
    for (int ch = 0; ch < MQ_Q2C_GROUP / MQ_CHUNK; ch++)
        mq_pack_chunk(codes + MQ_CHUNK * ch, MQ_Q2C_BITS, dst + MQ_Q2C_HEADER + MQ_CHUNK_BYTES(MQ_Q2C_BITS) * ch);
}
