/* Portable quantize + pack of every format, mirroring mixqrt/formats/codec.py step for step. */
#include "quant.h"
#include "kmeans.h"
#include "round.h"
#include "cpu.h"

/* rint of t already clamped to a small integer range: the 1.5*2^23 trick is exact RNE there */
static inline float rnd(float t) {
    const float b = 12582912.0f;        /* IEEE semantics (no -ffast-math) keep (t + b) - b */
    return (t + b) - b;
}
static inline float clampf(float t, float a, float b) { return t < a ? a : (t > b ? b : t); }

/* ---------------------------------------------------------------- one block per format */
static void blk_q8(const float *x, int nv, uint8_t *dst, uint8_t *codes) {
    float amax = 0.0f;
    for (int i = 0; i < nv; i++) { float a = x[i] < 0 ? -x[i] : x[i]; if (a > amax) amax = a; }
    uint16_t dh = mq_snap(mq_f32_to_f16_rtz(amax / 127.0f), 0.0f, 127.0f, amax);
    float d = mq_f16_to_f32(dh);
    mq_put16(dst + MQ_HDR_D, dh);
    if (d > 0)
        for (int i = 0; i < nv; i++) codes[i] = (uint8_t)(int)rnd(clampf(x[i] / d, -127.0f, 127.0f));
}

static void blk_q6(const float *x, int nv, uint8_t *dst, uint8_t *codes) {
    float amax = -1.0f, ext = 0.0f;
    for (int i = 0; i < nv; i++) { float a = x[i] < 0 ? -x[i] : x[i]; if (a > amax) { amax = a; ext = x[i]; } }
    uint16_t dh = mq_f32_to_f16_rtz(ext / -32.0f);
    float d = mq_f16_to_f32(dh);
    mq_put16(dst + MQ_HDR_D, dh);
    for (int i = 0; i < nv; i++) codes[i] = (uint8_t)((d != 0 ? (int)rnd(clampf(x[i] / d, -32.0f, 31.0f)) : 0) + 32);
}

/* asymmetric min/max header; returns d (0 means every code is 0) and m */
static void minmax_dm(const float *x, int nv, float top, uint8_t *dst, float *d, float *m) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < nv; i++) { if (x[i] < mn) mn = x[i]; if (x[i] > mx) mx = x[i]; }
    uint16_t mh = mq_f32_to_f16(mn + 0.0f);   /* -0.0 -> +0.0, as the reference does */
    *m = mq_f16_to_f32(mh);
    float raw = (mx - *m) / top;
    if (!(raw > 0.0f)) raw = 0.0f;
    uint16_t dh = mq_snap(mq_f32_to_f16_rtz(raw), *m, top, mx);
    *d = mq_f16_to_f32(dh);
    mq_put16(dst + MQ_HDR_D, dh);
    mq_put16(dst + MQ_HDR_M, mh);
}

static void blk_uni(const float *x, int nv, uint8_t *dst, uint8_t *codes, float top) {
    float d, m;
    minmax_dm(x, nv, top, dst, &d, &m);
    if (d > 0)
        for (int i = 0; i < nv; i++) codes[i] = (uint8_t)(int)rnd(clampf((x[i] - m) / d, 0.0f, top));
}

static void blk_q3p(const float *x, int nv, uint8_t *dst, uint8_t *codes, const uint8_t *lv) {
    float mids[7], d, m;
    for (int j = 0; j < 7; j++) mids[j] = ((float)lv[j] + (float)lv[j + 1]) * 0.5f;
    minmax_dm(x, nv, (float)lv[7], dst, &d, &m);
    for (int i = 0; i < nv; i++) {
        int q = 0;
        if (d > 0) { float t = (x[i] - m) / d; for (int j = 0; j < 7; j++) q += t > mids[j]; }
        codes[i] = (uint8_t)q;
    }
}

static void blk_q5g(const float *x, int nv, uint8_t *codes, float lo, float step) {
    for (int i = 0; i < nv; i++) codes[i] = step > 0 ? (uint8_t)rnd(clampf((x[i] - lo) / step, 0.0f, 31.0f)) : 0;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

int mq_quantize(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *lv,
                float lo, float hi) {
    if (fmt < 0 || fmt >= MQ_NFMT || mq_x_base(fmt) >= 0) return -1;   /* q4x/q3x: q4/q3p, then interleaved (layout.py) */
    if (fmt == MQ_F32) { memcpy(out, x, (size_t)(n * k) * 4); return 0; }
#if defined(__x86_64__) || defined(__i386__)
    if (fmt == MQ_F16 && mq_isa_get() >= MQ_ISA_AVX2) { mq_f32_to_f16_avx2(x, out, n * k); return 0; }
#endif
    if (fmt == MQ_F16 || fmt == MQ_BF16) {
        for (int64_t i = 0; i < n * k; i++) mq_put16(out + 2 * i, fmt == MQ_F16 ? mq_f32_to_f16(x[i]) : f32_to_bf16(x[i]));
        return 0;
    }
    const mq_fmt_spec *l = &MQ_FORMATS[fmt];
    const int G = l->group, bb = l->block_bytes, cb = MQ_CHUNK_BYTES(l->bits);
    const int64_t nb = (k + G - 1) / G;
    const float step = (hi - lo) / 31.0f;
    uint8_t codes[MQ_GROUP_MAX];
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * k;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + b * G;
            int nv = (int)(k - b * G < G ? k - b * G : G);
            uint8_t *dst = out + (r * nb + b) * bb;
            if (fmt == MQ_Q2C) { mq_q2c_block(xb, nv, dst); continue; }
            memset(codes, 0, sizeof codes);
            switch (fmt) {
            case MQ_Q8: blk_q8(xb, nv, dst, codes); break;
            case MQ_Q6: blk_q6(xb, nv, dst, codes); break;
            case MQ_Q4: blk_uni(xb, nv, dst, codes, 15.0f); break;
            case MQ_Q3U: blk_uni(xb, nv, dst, codes, 7.0f); break;
            case MQ_Q3P: blk_q3p(xb, nv, dst, codes, lv); break;
            case MQ_Q5G: blk_q5g(xb, nv, codes, lo, step); break;
            }
            for (int c = 0; c < G / MQ_CHUNK; c++) mq_pack_chunk(codes + MQ_CHUNK * c, l->pack, dst + l->header + c * cb);
        }
    }
    if (fmt == MQ_Q5G) { memcpy(out + n * nb * bb, &lo, 4); memcpy(out + n * nb * bb + 4, &hi, 4); }
    return 0;
}

int mq_dequantize_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *ids, int64_t nids,
                       float *out, const uint8_t *lv, float lo, float hi) {
    int64_t rb = mq_row_bytes(fmt, k);
    if (rb < 0) return -1;
    const float step = (hi - lo) / 31.0f;
    for (int64_t i = 0; i < nids; i++) {
        int64_t r = ids ? ids[i] : i;
        mq_dequant_row_at(fmt, raw, r, rb, k, out + i * k, lv, lo, step);
    }
    return 0;
}
