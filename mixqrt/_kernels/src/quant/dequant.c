/* Portable dequantization: w = d * L[q] + m in float32, one multiply then one add (layout.py). */
#include "quant.h"
#include "cpu.h"

static void deq_row(int fmt, const uint8_t *row, int64_t k, float *out, const uint8_t *lv, float lo, float step) {
    static const int BITS[7] = {8, 6, 4, 3, 3, 2, 5}, GROUP[7] = {32, 32, 32, 64, 64, 128, 32},
                     HEAD[7] = {2, 2, 4, 4, 4, 8, 0};
    if (fmt == MQ_F32) { memcpy(out, row, (size_t)k * 4); return; }
#if defined(__x86_64__) || defined(__i386__)
    if (fmt == MQ_F16 && mq_isa_get() >= MQ_ISA_AVX2) { mq_f16_to_f32_avx2(row, out, k); return; }
#endif
    if (fmt == MQ_F16) { for (int64_t i = 0; i < k; i++) out[i] = mq_f16_to_f32(mq_get16(row + 2 * i)); return; }
    if (fmt == MQ_BF16) {
        for (int64_t i = 0; i < k; i++) { uint32_t u = (uint32_t)mq_get16(row + 2 * i) << 16; memcpy(out + i, &u, 4); }
        return;
    }
    const int bits = BITS[fmt], G = GROUP[fmt], hd = HEAD[fmt], cb = bits * 4;
    const int bb = hd + (G / 32) * cb;
    uint8_t codes[128];
    float L[256];
    for (int64_t b = 0, nb = (k + G - 1) / G; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        int nv = (int)(k - b * G < G ? k - b * G : G);
        for (int c = 0; c < (nv + 31) / 32; c++) mq_unpack_chunk(blk + hd + c * cb, bits, codes + 32 * c);
        float *o = out + b * G;
        if (fmt == MQ_Q5G) { for (int i = 0; i < nv; i++) o[i] = lo + (float)codes[i] * step; continue; }
        float d = mq_f16_to_f32(mq_get16(blk));
        if (fmt == MQ_Q8) { for (int i = 0; i < nv; i++) o[i] = d * (float)(int8_t)codes[i]; continue; }
        if (fmt == MQ_Q6) { for (int i = 0; i < nv; i++) o[i] = d * ((float)codes[i] - 32.0f); continue; }
        float m = mq_f16_to_f32(mq_get16(blk + 2));
        if (fmt == MQ_Q4 || fmt == MQ_Q3U) { for (int i = 0; i < nv; i++) o[i] = d * (float)codes[i] + m; continue; }
        const uint8_t *tab = fmt == MQ_Q3P ? lv : blk + 4;
        int nl = fmt == MQ_Q3P ? 8 : 4;
        for (int j = 0; j < nl; j++) L[j] = d * (float)tab[j] + m;   /* same two roundings per level */
        for (int i = 0; i < nv; i++) o[i] = L[codes[i]];
    }
}

int mq_dequantize_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *ids, int64_t nids,
                       float *out, const uint8_t *lv, float lo, float hi) {
    int64_t rb = mq_row_bytes(fmt, k);
    if (rb < 0) return -1;
    const float step = (hi - lo) / 31.0f;
    for (int64_t i = 0; i < nids; i++) {
        int64_t r = ids ? ids[i] : i;
        deq_row(fmt, raw + r * rb, k, out + i * k, lv, lo, step);
    }
    return 0;
}
