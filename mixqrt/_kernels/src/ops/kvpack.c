/* The packed KV cache's block packer (mixqrt/kv/ref.py pack_block, value for value): portable C, one
 * version for every tier, since the bytes it writes are what every tier's attention reads. */
#include <math.h>
#include <string.h>

#include "mq_format.h"
#include "misc.h"

/* scale, min (f16) and codes of x against lo / hi, as ref._range_codes */
static inline void kv_range(float lo, float hi, int qmax, uint16_t *sc16, uint16_t *mn16, float *sc, float *mn) {
    *sc16 = mq_f32_to_f16((hi - lo) / (float)qmax);
    *mn16 = mq_f32_to_f16(lo);
    *sc = mq_f16_to_f32(*sc16);
    *mn = mq_f16_to_f32(*mn16);
}

static inline uint8_t kv_code(float x, float mn, float inv, int qmax) {
    float v = (x - mn) * inv;                   /* nearest, ties to even (the float magic, exact in range) */
    v = v < -1.0f ? -1.0f : (v > (float)qmax + 1.0f ? (float)qmax + 1.0f : v);
    v = (v + 12582912.0f) - 12582912.0f;
    if (!(v >= 0.0f)) v = 0.0f;
    if (v > (float)qmax) v = (float)qmax;
    return (uint8_t)(int)v;
}

/* per channel c < Dh: the squared error of the n positions of x (rows Dh apart) against (sc[c], mn[c]),
 * as ref._sub_error: codes rounded half to even (the float magic, exact for |y| <= 16) and clamped to
 * 0..15, added position by position in float32. Channels innermost, so the compiler vectorizes. */
typedef float kv_v4f __attribute__((vector_size(16)));
typedef float kv_v4fu __attribute__((vector_size(16), aligned(4)));
typedef int kv_v4i __attribute__((vector_size(16)));
#define KV_SEL(m, a, b) ((kv_v4f)(((m) & (kv_v4i)(a)) | (~(m) & (kv_v4i)(b))))

static void kv_sub_error(const float *x, int Dh, int n, const float *sc, const float *mn, float *e) {
    float inv[256];
    for (int c = 0; c < Dh; c++) { inv[c] = sc[c] > 0.0f ? 1.0f / sc[c] : 0.0f; e[c] = 0.0f; }
    const kv_v4f lo = {-1.0f, -1.0f, -1.0f, -1.0f}, hi = {16.0f, 16.0f, 16.0f, 16.0f};
    const kv_v4f zero = {0.0f, 0.0f, 0.0f, 0.0f}, top = {15.0f, 15.0f, 15.0f, 15.0f};
    const kv_v4f magic = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
    for (int c = 0; c < Dh; c += 4) {                 /* 4 channels at a time: IEEE operations lane by lane */
        const kv_v4f vs = *(const kv_v4fu *)(sc + c), vm = *(const kv_v4fu *)(mn + c);
        const kv_v4f vi = *(const kv_v4fu *)(inv + c);
        kv_v4f acc = zero;
        for (int t = 0; t < n; t++) {
            const kv_v4f xt = *(const kv_v4fu *)(x + (size_t)t * Dh + c);
            kv_v4f y = (xt - vm) * vi;
            y = KV_SEL(y < lo, lo, y);
            y = KV_SEL(y > hi, hi, y);
            y = (y + magic) - magic;
            y = KV_SEL(y < zero, zero, y);
            y = KV_SEL(y > top, top, y);
            const kv_v4f d = (y * vs + vm) - xt;
            acc = acc + d * d;
        }
        *(kv_v4fu *)(e + c) = acc;
    }
}

/* q4 (ref._q4_keys, ref._nf4_values, the 4-bit layouts): k, v [64][Dh] -> one block */
static void kv_pack_q4(const float *k, const float *v, int Dh, uint8_t *out) {
    static const float lev[16] = MQ_KV_VLEV;
    const int G = 64, SUB = MQ_KV_SUB;
    uint16_t *kmin = (uint16_t *)out;
    uint8_t *kscale = out + 2 * (size_t)Dh;
    uint8_t *adj = out + 3 * (size_t)Dh;
    uint8_t *kcodes = adj + (size_t)(G / SUB) * Dh;
    const size_t nk = (size_t)G * Dh / 2;
    uint8_t *vscale = kcodes + nk;
    uint8_t *vcodes = vscale + G;
    uint8_t kc[64 * 256], vc[64 * 256];
    float ks[256], km[256], a0[256], lo[256], hi[256], li[256], hs[256];
    float csc[256], cmn[256], e[256], berr[256];
    int ba[256], bb[256];
    for (int c = 0; c < Dh; c++) { lo[c] = k[c]; hi[c] = k[c]; }
    for (int t = 1; t < G; t++)                       /* keys: per channel over the block ... */
        for (int c = 0; c < Dh; c++) {
            const float x = k[(size_t)t * Dh + c];
            lo[c] = x < lo[c] ? x : lo[c];
            hi[c] = x > hi[c] ? x : hi[c];
        }
    for (int c = 0; c < Dh; c++) {
        kscale[c] = mq_kv_logcode((hi[c] - lo[c]) / 15.0f);
        kmin[c] = mq_f32_to_f16(lo[c]);
        ks[c] = mq_kv_logscale(kscale[c]);
        km[c] = mq_f16_to_f32(kmin[c]);
    }
    for (int i = 0; i < G / SUB; i++) {               /* ... each sub-block narrowing it: the (a, b) of least error */
        const float *x = k + (size_t)(i * SUB) * Dh;
        for (int c = 0; c < Dh; c++) { li[c] = x[c]; hs[c] = x[c]; }
        for (int t = 1; t < SUB; t++)
            for (int c = 0; c < Dh; c++) {
                const float y = x[(size_t)t * Dh + c];
                li[c] = y < li[c] ? y : li[c];
                hs[c] = y > hs[c] ? y : hs[c];
            }
        for (int c = 0; c < Dh; c++) {
            const float div = ks[c] > 0.0f ? ks[c] : 1.0f;
            float fa = floorf((li[c] - km[c]) / div);
            a0[c] = fa < 0.0f ? 0.0f : (fa > 15.0f ? 15.0f : fa);
        }
        for (int da = 0; da < MQ_KV_KEY_NA; da++)
            for (int db = 0; db < MQ_KV_KEY_NB; db++) {
                int ca[256], cb[256];
                for (int c = 0; c < Dh; c++) {
                    if (ks[c] > 0.0f) {
                        ca[c] = (int)a0[c] + da > 15 ? 15 : (int)a0[c] + da;
                        const float mi = km[c] + ks[c] * (float)ca[c];
                        float need = ceilf(((hs[c] - mi) * 16.0f) / (ks[c] * 15.0f));
                        need = need < 1.0f ? 1.0f : (need > 16.0f ? 16.0f : need);
                        const int b1max = (255 - 16 * ca[c]) / 15;   /* 16 a + (b + 1) code fits a byte */
                        cb[c] = (int)need - db < 1 ? 1 : (int)need - db;
                        cb[c] = cb[c] > b1max ? b1max : cb[c];
                    } else {
                        ca[c] = 0;
                        cb[c] = 16;
                    }
                    csc[c] = (ks[c] * (float)cb[c]) * 0.0625f;
                    cmn[c] = km[c] + ks[c] * (float)ca[c];
                }
                kv_sub_error(x, Dh, SUB, csc, cmn, e);
                for (int c = 0; c < Dh; c++)
                    if ((da == 0 && db == 0) || e[c] < berr[c]) { berr[c] = e[c]; ba[c] = ca[c]; bb[c] = cb[c]; }
            }
        for (int c = 0; c < Dh; c++) {
            adj[(size_t)i * Dh + c] = (uint8_t)(ba[c] | ((bb[c] - 1) << 4));
            const float sc = (ks[c] * (float)bb[c]) * 0.0625f, mn = km[c] + ks[c] * (float)ba[c];
            const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
            for (int t = i * SUB; t < (i + 1) * SUB; t++) kc[(size_t)t * Dh + c] = kv_code(k[(size_t)t * Dh + c], mn, inv, 15);
        }
    }
    float mid[15];
    for (int j = 0; j < 15; j++) mid[j] = (lev[j] + lev[j + 1]) / 2.0f;
    for (int t = 0; t < G; t++) {                     /* values: per position, absmax / 127, the nearest level */
        const float *vr = v + (size_t)t * Dh;
        kv_v4f m4 = {0.0f, 0.0f, 0.0f, 0.0f};      /* absmax (a NaN never wins, as before) */
        for (int d = 0; d < Dh; d += 4) {
            const kv_v4f x4 = *(const kv_v4fu *)(vr + d);
            const kv_v4f a4 = (kv_v4f)((kv_v4i)x4 & (kv_v4i){0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff});
            m4 = KV_SEL(a4 > m4, a4, m4);
        }
        float am = 0.0f;
        for (int j = 0; j < 4; j++) am = m4[j] > am ? m4[j] : am;
        vscale[t] = mq_kv_logcode(am / 127.0f);
        const float vs = mq_kv_logscale(vscale[t]);
        const float inv = vs > 0.0f ? 1.0f / vs : 0.0f;
        float y[256];
        int code[256];
        for (int d = 0; d < Dh; d++) { y[d] = vr[d] * inv; code[d] = 0; }
        for (int j = 0; j < 15; j++)
            for (int d = 0; d < Dh; d++) code[d] += y[d] > mid[j];
        for (int d = 0; d < Dh; d++) vc[(size_t)t * Dh + d] = (uint8_t)code[d];
    }
    memset(kcodes, 0, nk);
    memset(vcodes, 0, nk);
    for (int t = 0; t < G; t++)
        for (int c = 0; c < Dh; c++)
            kcodes[((size_t)(t / 16) * (Dh / 8) + c / 8) * 64 + (t % 16) * 4 + c % 4] |=
                (uint8_t)(kc[(size_t)t * Dh + c] << (4 * ((c % 8) / 4)));
    for (int t = 0; t < G; t++)
        for (int d = 0; d < Dh; d++)
            vcodes[((size_t)(t / 4) * (Dh / 32) + d / 32) * 64 + (d % 16) * 4 + t % 4] |=
                (uint8_t)(vc[(size_t)t * Dh + d] << (4 * ((d % 32) / 16)));
}

void mq_kv_fwht(float *x, int dh) {
    const int n = dh & -dh;                         /* blocks of dh's largest power-of-two divisor */
    const float s = (float)(1.0 / sqrt((double)n));
    for (int o = 0; o < dh; o += n) {
        float *y = x + o;
        for (int h = 1; h < n; h *= 2)
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (int i = 0; i < n; i++) y[i] = y[i] * s;
    }
}

void mq_kv_pack(const uint16_t *kf, const uint16_t *vf, int S, int Dh, int Hkv, int b0, int b1, int bits,
                uint8_t *pk, int NB) {
    const int G = 64, qmax = (1 << bits) - 1;
    const size_t bb = (size_t)MQ_KV_BLOCK_BYTES(Dh, bits);
    const size_t nk = (size_t)G * Dh;
    float k[64 * 256], v[64 * 256];
    uint8_t kc[64 * 256], vc[64 * 256];
    for (int h = 0; h < Hkv; h++)
        for (int b = b0; b < b1; b++) {
            const uint16_t *ks = kf + ((size_t)h * S + (size_t)b * G) * Dh, *vs = vf + ((size_t)h * S + (size_t)b * G) * Dh;
            for (size_t i = 0; i < (size_t)G * Dh; i++) { k[i] = mq_f16_to_f32(ks[i]); v[i] = mq_f16_to_f32(vs[i]); }
            uint8_t *out = pk + ((size_t)h * NB + b) * bb;
            if (bits == 4) {
                kv_pack_q4(k, v, Dh, out);
                continue;
            }
            uint16_t *kscale = (uint16_t *)out, *kmin = kscale + Dh;
            uint8_t *kcodes = out + 4 * (size_t)Dh;
            uint16_t *vscale = (uint16_t *)(kcodes + nk), *vmin = vscale + G;
            uint8_t *vcodes = (uint8_t *)(vmin + G);
            for (int c = 0; c < Dh; c++) {                /* keys: per channel over the 64 positions */
                float lo = k[c], hi = k[c];
                for (int t = 1; t < G; t++) {
                    const float x = k[(size_t)t * Dh + c];
                    lo = x < lo ? x : lo;
                    hi = x > hi ? x : hi;
                }
                float sc, mn;
                kv_range(lo, hi, qmax, &kscale[c], &kmin[c], &sc, &mn);
                const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
                for (int t = 0; t < G; t++) kc[(size_t)t * Dh + c] = kv_code(k[(size_t)t * Dh + c], mn, inv, qmax);
            }
            for (int t = 0; t < G; t++) {                 /* values: per position over the Dh channels */
                const float *vr = v + (size_t)t * Dh;
                float lo = vr[0], hi = vr[0];
                for (int d = 1; d < Dh; d++) { lo = vr[d] < lo ? vr[d] : lo; hi = vr[d] > hi ? vr[d] : hi; }
                float sc, mn;
                kv_range(lo, hi, qmax, &vscale[t], &vmin[t], &sc, &mn);
                const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
                for (int d = 0; d < Dh; d++) vc[(size_t)t * Dh + d] = kv_code(vr[d], mn, inv, qmax);
            }
            /* layouts: ref.k_layout / ref.v_layout (8 bits) */
            for (int t = 0; t < G; t++)
                for (int c = 0; c < Dh; c++)
                    kcodes[((size_t)(t / 16) * (Dh / 4) + c / 4) * 64 + (t % 16) * 4 + c % 4] = kc[(size_t)t * Dh + c];
            for (int t = 0; t < G; t++)
                for (int d = 0; d < Dh; d++)
                    vcodes[((size_t)(t / 4) * (Dh / 16) + d / 16) * 64 + (d % 16) * 4 + t % 4] = vc[(size_t)t * Dh + d];
        }
}
