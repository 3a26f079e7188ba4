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
    float v = nearbyintf((x - mn) * inv);
    if (!(v >= 0.0f)) v = 0.0f;
    if (v > (float)qmax) v = (float)qmax;
    return (uint8_t)(int)v;
}

/* q4 (ref._q4_keys, ref._nf4_values, the 4-bit layouts): k, v [64][Dh] -> one block */
static void kv_pack_q4(const float *k, const float *v, int Dh, uint8_t *out) {
    static const float lev[16] = MQ_KV_VLEV;
    const int G = 64, SUB = 32;
    uint16_t *kscale = (uint16_t *)out, *kmin = kscale + Dh;
    uint8_t *adj = out + 4 * (size_t)Dh;
    uint8_t *kcodes = adj + 2 * (size_t)Dh;
    const size_t nk = (size_t)G * Dh / 2;
    uint16_t *vscale = (uint16_t *)(kcodes + nk);
    uint8_t *vcodes = (uint8_t *)(vscale + G);
    uint8_t kc[64 * 256], vc[64 * 256];
    for (int c = 0; c < Dh; c++) {                    /* keys: per channel, two sub-blocks narrowing the range */
        float lo = k[c], hi = k[c];
        for (int t = 1; t < G; t++) {
            const float x = k[(size_t)t * Dh + c];
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
        }
        kscale[c] = mq_f32_to_f16((hi - lo) / 15.0f);
        kmin[c] = mq_f32_to_f16(lo);
        const float ks = mq_f16_to_f32(kscale[c]), km = mq_f16_to_f32(kmin[c]);
        const float div = ks > 0.0f ? ks : 1.0f;
        for (int i = 0; i < 2; i++) {
            float li = k[(size_t)(i * SUB) * Dh + c], hs = li;
            for (int t = i * SUB + 1; t < (i + 1) * SUB; t++) {
                const float x = k[(size_t)t * Dh + c];
                li = x < li ? x : li;
                hs = x > hs ? x : hs;
            }
            int a = 0, b1 = 16;
            if (ks > 0.0f) {
                float fa = floorf((li - km) / div);
                fa = fa < 0.0f ? 0.0f : (fa > 15.0f ? 15.0f : fa);
                a = (int)fa;
                const float mi = km + ks * (float)a;
                float need = ceilf(((hs - mi) * 16.0f) / (div * 15.0f));
                need = need < 1.0f ? 1.0f : (need > 16.0f ? 16.0f : need);
                b1 = (int)need;
            }
            adj[(size_t)i * Dh + c] = (uint8_t)(a | ((b1 - 1) << 4));
            const float sc = (ks * (float)b1) * 0.0625f, mn = km + ks * (float)a;
            const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
            for (int t = i * SUB; t < (i + 1) * SUB; t++) kc[(size_t)t * Dh + c] = kv_code(k[(size_t)t * Dh + c], mn, inv, 15);
        }
    }
    float mid[15];
    for (int j = 0; j < 15; j++) mid[j] = (lev[j] + lev[j + 1]) / 2.0f;
    for (int t = 0; t < G; t++) {                     /* values: per position, absmax / 127, the nearest level */
        const float *vr = v + (size_t)t * Dh;
        float am = 0.0f;
        for (int d = 0; d < Dh; d++) { const float a = vr[d] < 0 ? -vr[d] : vr[d]; am = a > am ? a : am; }
        vscale[t] = mq_f32_to_f16(am / 127.0f);
        const float vs = mq_f16_to_f32(vscale[t]);
        const float inv = vs > 0.0f ? 1.0f / vs : 0.0f;
        for (int d = 0; d < Dh; d++) {
            const float y = vr[d] * inv;
            int code = 0;
            for (int j = 0; j < 15; j++) code += y > mid[j];
            vc[(size_t)t * Dh + d] = (uint8_t)code;
        }
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
