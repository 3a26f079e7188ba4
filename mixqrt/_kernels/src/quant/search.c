/* Error-minimising quantization of q6 / q4 / q3u / q3p in their unchanged byte layouts: a per-block
 * search over (d, m) like llama.cpp's make_qkx2_quants / make_qx_quants, optionally weighted by a
 * per-column importance (imatrix). Bit-exact with formats._search_parts (the numpy spec):
 *
 *   0. the min/max header of the plain quantizer is candidate 0 (so the result is never worse);
 *   1. for each anchor (min, max) and scale factor f_j = 1 + (j - NNEG) * FSTEP: provisional codes
 *      from t = (x - mn) * is (or T - (mx - x) * is) with is = (T * f_j) / (mx - mn); weighted least
 *      squares (d, m) for those codes (double, sums left to right); its closed-form error ranks it;
 *   2. the best LS pair is rounded to fp16 (RNE), codes are re-assigned as the plain quantizer does,
 *      and its true weighted SSE (double, left to right) must beat candidate 0's to replace it;
 *   3. REFINE rounds of "assign codes -> LS refit -> fp16 -> true SSE", kept only while they improve;
 *   4. de-shrink (when the block's error is not 0): a least-squares fit is orthogonal to its error, so
 *      the reconstruction y is shrunk toward the block mean by beta = <y-mean y, x-mean x>/|x-mean x|^2
 *      (~0.97 at 3 bits). With the codes kept, d and m are stretched by 1/beta about mean(y)
 *      (d' = d/beta, m' = mean y + (m - mean y)/beta; unweighted, double, left to right; beta outside
 *      (0.5, 1.5) or an fp16 overflow leaves the block alone). This costs ~3 % in squared error and
 *      removed most of the perplexity loss of the plain LS search (docs/quality.md).
 * q6 does the same with m = 0 and the scale anchored at the largest-magnitude element (step 4: d/beta). */
#include "quant.h"
#include "round.h"

#define NCAND 11
#define NNEG 5
#define FSTEP 0.04f
#define REFINE 2

typedef struct { const float *L; int nl; float T; int q3p; float mids[7]; } lv_t;

static inline float rnd_s(float t) { const float b = 12582912.0f; return (t + b) - b; }
static inline float clamp_s(float t, float a, float b) { return t < a ? a : (t > b ? b : t); }

/* nearest level of t (level units); the plain quantizer's rule */
static inline int near_lv(const lv_t *v, float t) {
    if (v->q3p) { int q = 0; for (int j = 0; j < 7; j++) q += t > v->mids[j]; return q; }
    return (int)rnd_s(clamp_s(t, 0.0f, v->T));
}

static inline int bad16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

/* weighted SSE of x against d*L[q] + m with codes assigned under (d, m); codes written when c != NULL */
static double sse_asym(const float *x, const float *w, int nv, const lv_t *v, float d, float m, uint8_t *c) {
    double e2 = 0.0;
    for (int i = 0; i < nv; i++) {
        int q = d > 0 ? near_lv(v, (x[i] - m) / d) : 0;
        float r = d * v->L[q] + m;
        double e = (double)x[i] - (double)r;
        e2 += (double)(w ? w[i] : 1.0f) * e * e;
        if (c) c[i] = (uint8_t)q;
    }
    return e2;
}

static double sse_sym(const float *x, const float *w, int nv, float d, uint8_t *c) {
    double e2 = 0.0;
    for (int i = 0; i < nv; i++) {
        int q = (d != 0 ? (int)rnd_s(clamp_s(x[i] / d, -32.0f, 31.0f)) : 0) + 32;
        float r = d * (float)(q - 32);
        double e = (double)x[i] - (double)r;
        e2 += (double)(w ? w[i] : 1.0f) * e * e;
        if (c) c[i] = (uint8_t)q;
    }
    return e2;
}

/* LS fit of (d, m) for fixed codes; returns 0 when singular. err: closed-form weighted SSE (unrounded) */
static int ls_asym(const float *x, const float *w, int nv, const lv_t *v, const uint8_t *c,
                   double sxx, double *d, double *m, double *err) {
    double sw = 0, sl = 0, sll = 0, sx = 0, slx = 0;
    for (int i = 0; i < nv; i++) {
        double wi = (double)(w ? w[i] : 1.0f), li = (double)v->L[c[i]], xi = (double)x[i];
        sw += wi; sl += wi * li; sll += (wi * li) * li; sx += wi * xi; slx += (wi * li) * xi;
    }
    double D = sw * sll - sl * sl;
    if (!(D > 0)) return 0;
    *d = (sw * slx - sl * sx) / D;
    *m = (sll * sx - sl * slx) / D;
    *err = *d * *d * sll + 2.0 * *d * *m * sl + *m * *m * sw - 2.0 * *d * slx - 2.0 * *m * sx + sxx;
    return 1;
}

static int ls_sym(const float *x, const float *w, int nv, const uint8_t *c, double sxx, double *d, double *err) {
    double sll = 0, slx = 0;
    for (int i = 0; i < nv; i++) {
        double wi = (double)(w ? w[i] : 1.0f), li = (double)((int)c[i] - 32), xi = (double)x[i];
        sll += (wi * li) * li; slx += (wi * li) * xi;
    }
    if (!(sll > 0)) return 0;
    *d = slx / sll;
    *err = *d * *d * sll - 2.0 * *d * slx + sxx;
    return 1;
}

static double sum_wxx(const float *x, const float *w, int nv) {
    double s = 0;
    for (int i = 0; i < nv; i++) { double xi = (double)x[i]; s += (double)(w ? w[i] : 1.0f) * xi * xi; }
    return s;
}

/* step 4: beta of the reconstruction d*L[c]+m against x (codes c already assigned); 0 = leave alone */
static double shrink_beta(const float *x, int nv, const float *Lc, float d, float m, int center, double *mu_y) {
    double sy = 0, sx = 0;
    for (int i = 0; i < nv; i++) { sy += (double)(d * Lc[i] + m); sx += (double)x[i]; }
    double my = center ? sy / nv : 0.0, mx = center ? sx / nv : 0.0, syx = 0, sxx = 0;
    for (int i = 0; i < nv; i++) {
        double yc = (double)(d * Lc[i] + m) - my, xc = (double)x[i] - mx;
        syx += yc * xc; sxx += xc * xc;
    }
    if (!(sxx > 0)) return 0;
    double beta = syx / sxx;
    *mu_y = my;
    return (beta > 0.5 && beta < 1.5) ? beta : 0;
}

/* asymmetric formats: writes d, m into dst[0..4) and the codes */
void mq_search_asym(const float *x, const float *w, int nv, const float *L, int nl, int q3p,
                    uint8_t *dst, uint8_t *codes) {
    lv_t v = {L, nl, L[nl - 1], q3p, {0}};
    if (q3p) for (int j = 0; j < 7; j++) v.mids[j] = (L[j] + L[j + 1]) * 0.5f;
    float mn = x[0], mx = x[0];
    for (int i = 1; i < nv; i++) { if (x[i] < mn) mn = x[i]; if (x[i] > mx) mx = x[i]; }
    /* candidate 0: the plain min/max header */
    uint16_t mh = mq_f32_to_f16(mn + 0.0f);
    float m0 = mq_f16_to_f32(mh);
    float raw = (mx - m0) / v.T;
    if (!(raw > 0.0f)) raw = 0.0f;
    uint16_t dh = mq_snap(mq_f32_to_f16_rtz(raw), m0, v.T, mx);
    float bd = mq_f16_to_f32(dh), bm = m0;
    double best = sse_asym(x, w, nv, &v, bd, bm, NULL);
    if (bd > 0 && best > 0 && mx > mn) {
        uint8_t c[128];
        double sxx = sum_wxx(x, w, nv), cbest = 0, cd = 0, cm = 0;
        int have = 0;
        for (int a = 0; a < 2; a++) {
            for (int j = 0; j < NCAND; j++) {
                float f = 1.0f + (float)(j - NNEG) * FSTEP;
                float is = (v.T * f) / (mx - mn);
                for (int i = 0; i < nv; i++) {
                    float t = a == 0 ? (x[i] - mn) * is : v.T - (mx - x[i]) * is;
                    c[i] = (uint8_t)near_lv(&v, t);
                }
                double d, m, e;
                if (!ls_asym(x, w, nv, &v, c, sxx, &d, &m, &e)) continue;
                if (!(d > 0)) continue;
                if (!have || e < cbest) { have = 1; cbest = e; cd = d; cm = m; }
            }
        }
        for (int it = 0; have && it <= REFINE; it++) {
            uint16_t dh1 = mq_f32_to_f16((float)cd), mh1 = mq_f32_to_f16((float)cm);
            if (bad16(dh1) || bad16(mh1)) break;
            float d1 = mq_f16_to_f32(dh1), m1 = mq_f16_to_f32(mh1);
            if (!(d1 > 0)) break;
            double e1 = sse_asym(x, w, nv, &v, d1, m1, c);
            if (!(e1 < best)) break;
            best = e1; bd = d1; bm = m1; dh = dh1; mh = mh1;
            double e;
            if (!ls_asym(x, w, nv, &v, c, sxx, &cd, &cm, &e) || !(cd > 0)) break;
        }
    }
    double final = sse_asym(x, w, nv, &v, bd, bm, codes);
    if (final > 0 && bd > 0) {
        float Lc[128];
        double my = 0;
        for (int i = 0; i < nv; i++) Lc[i] = v.L[codes[i]];
        double beta = shrink_beta(x, nv, Lc, bd, bm, 1, &my);
        if (beta > 0) {
            uint16_t dh2 = mq_f32_to_f16((float)((double)bd / beta));
            uint16_t mh2 = mq_f32_to_f16((float)(my + ((double)bm - my) / beta));
            if (!bad16(dh2) && !bad16(mh2) && mq_f16_to_f32(dh2) > 0) { dh = dh2; mh = mh2; }
        }
    }
    mq_put16(dst + MQ_HDR_D, dh);
    mq_put16(dst + MQ_HDR_M, mh);
}

void mq_search_sym6(const float *x, const float *w, int nv, uint8_t *dst, uint8_t *codes) {
    float amax = -1.0f, ext = 0.0f;
    for (int i = 0; i < nv; i++) { float a = x[i] < 0 ? -x[i] : x[i]; if (a > amax) { amax = a; ext = x[i]; } }
    uint16_t dh = mq_f32_to_f16_rtz(ext / -32.0f);
    float bd = mq_f16_to_f32(dh);
    double best = sse_sym(x, w, nv, bd, NULL);
    if (bd != 0 && best > 0) {
        uint8_t c[128];
        double sxx = sum_wxx(x, w, nv), cbest = 0, cd = 0;
        int have = 0;
        for (int j = 0; j < NCAND; j++) {
            float f = 1.0f + (float)(j - NNEG) * FSTEP;
            float is = (-32.0f * f) / ext;
            for (int i = 0; i < nv; i++) c[i] = (uint8_t)((int)rnd_s(clamp_s(x[i] * is, -32.0f, 31.0f)) + 32);
            double d, e;
            if (!ls_sym(x, w, nv, c, sxx, &d, &e)) continue;
            if (!have || e < cbest) { have = 1; cbest = e; cd = d; }
        }
        for (int it = 0; have && it <= REFINE; it++) {
            uint16_t dh1 = mq_f32_to_f16((float)cd);
            if (bad16(dh1)) break;
            float d1 = mq_f16_to_f32(dh1);
            if (d1 == 0) break;
            double e1 = sse_sym(x, w, nv, d1, c);
            if (!(e1 < best)) break;
            best = e1; bd = d1; dh = dh1;
            double e;
            if (!ls_sym(x, w, nv, c, sxx, &cd, &e)) break;
        }
    }
    double final = sse_sym(x, w, nv, bd, codes);
    if (final > 0 && bd != 0) {
        float Lc[128];
        double my = 0;
        for (int i = 0; i < nv; i++) Lc[i] = (float)((int)codes[i] - 32);
        double beta = shrink_beta(x, nv, Lc, bd, 0.0f, 0, &my);   /* q6 scales about 0 */
        if (beta > 0) {
            uint16_t dh2 = mq_f32_to_f16((float)((double)bd / beta));
            if (!bad16(dh2) && mq_f16_to_f32(dh2) != 0) dh = dh2;
        }
    }
    mq_put16(dst + MQ_HDR_D, dh);
}

/* x [n, k]; imp: k column weights or NULL (all 1). fmt in {Q6, Q4, Q3U, Q3P}; others -> -1 */
int mq_quantize_search(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *lv,
                       const float *imp) {
    if (fmt != MQ_Q6 && fmt != MQ_Q4 && fmt != MQ_Q3U && fmt != MQ_Q3P) return -1;
    const mq_fmt_spec *f = &MQ_FORMATS[fmt];
    const int G = f->group, bits = f->bits, head = f->header, cb = MQ_CHUNK_BYTES(bits), bb = f->block_bytes;
    const int q3p = fmt == MQ_Q3P, nl = fmt == MQ_Q6 ? 0 : 1 << bits;   /* q6 is symmetric: no table */
    float L[1 << MQ_Q4_BITS];
    for (int j = 0; j < nl; j++) L[j] = q3p ? (float)lv[j] : (float)j;
    const int64_t nb = (k + G - 1) / G;
    uint8_t codes[MQ_Q3_GROUP];
    for (int64_t r = 0; r < n; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * G;
            const float *wb = imp ? imp + b * G : NULL;
            int nv = (int)(k - b * G < G ? k - b * G : G);
            uint8_t *dst = out + (r * nb + b) * bb;
            memset(codes, 0, sizeof codes);
            if (fmt == MQ_Q6) mq_search_sym6(xb, wb, nv, dst, codes);
            else mq_search_asym(xb, wb, nv, L, nl, q3p, dst, codes);
            for (int c = 0; c < G / MQ_CHUNK; c++) mq_pack_chunk(codes + MQ_CHUNK * c, f->pack, dst + head + c * cb);
        }
    }
    return 0;
}
