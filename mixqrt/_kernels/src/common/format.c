/* Portable chunk packing and the one dequantizer of every format (spec: mq_format.h, layout.py). */
#include <math.h>

#include "mq_format.h"
#include "cpu.h"

static void pack2(const uint8_t *c, uint8_t *d) {
    for (int i = 0; i < 8; i++) d[i] = (uint8_t)(c[i] | (c[i + 8] << 2) | (c[i + 16] << 4) | (c[i + 24] << 6));
}
static void pack4(const uint8_t *c, uint8_t *d) {
    for (int i = 0; i < 16; i++) d[i] = (uint8_t)(c[i] | (c[i + 16] << 4));
}
static void packbit(const uint8_t *c, int b, uint8_t *d) {
    uint32_t v = 0;
    for (int i = 0; i < 32; i++) v |= (uint32_t)((c[i] >> b) & 1u) << i;
    d[0] = (uint8_t)v; d[1] = (uint8_t)(v >> 8); d[2] = (uint8_t)(v >> 16); d[3] = (uint8_t)(v >> 24);
}
static void unpack2(const uint8_t *s, uint8_t *c) {
    for (int i = 0; i < 8; i++) for (int j = 0; j < 4; j++) c[i + 8 * j] = (s[i] >> (2 * j)) & 3;
}
static void unpack4(const uint8_t *s, uint8_t *c) {
    for (int i = 0; i < 16; i++) { c[i] = s[i] & 15; c[i + 16] = s[i] >> 4; }
}
static void unpackbit(const uint8_t *s, int b, uint8_t *c) {
    uint32_t v = (uint32_t)s[0] | ((uint32_t)s[1] << 8) | ((uint32_t)s[2] << 16) | ((uint32_t)s[3] << 24);
    for (int i = 0; i < 32; i++) c[i] |= (uint8_t)(((v >> i) & 1u) << b);
}

static void pack3c(const uint8_t *c, uint8_t *d) {
    memset(d, 0, MQ_CHUNK_BYTES(3));
    for (int i = 0; i < 32; i++) {
        uint32_t v = (uint32_t)(c[i] & 7u) << ((3 * i) & 7);
        d[3 * i / 8] |= (uint8_t)v;
        if (v >> 8) d[3 * i / 8 + 1] |= (uint8_t)(v >> 8);
    }
}
static void unpack3c(const uint8_t *s, uint8_t *c) {
    for (int i = 0; i < 32; i++) {
        int b = 3 * i / 8;
        uint32_t v = (uint32_t)s[b] | (b + 1 < MQ_CHUNK_BYTES(3) ? (uint32_t)s[b + 1] << 8 : 0u);
        c[i] = (uint8_t)((v >> ((3 * i) & 7)) & 7u);
    }
}

void mq_pack_chunk(const uint8_t *c, int pack, uint8_t *d) {
    uint8_t lo[MQ_CHUNK];
    switch (pack) {
    case MQ_PACK3C: pack3c(c, d); break;
    case 8: memcpy(d, c, MQ_CHUNK); break;
    case 2: pack2(c, d); break;
    case 3: for (int i = 0; i < 32; i++) lo[i] = c[i] & 3; pack2(lo, d); packbit(c, 2, d + MQ_PACK3_HI); break;
    case 4: pack4(c, d); break;
    case 5: for (int i = 0; i < 32; i++) lo[i] = c[i] & 15; pack4(lo, d); packbit(c, 4, d + MQ_PACK5_HI); break;
    case 6:
        for (int i = 0; i < 32; i++) lo[i] = c[i] & 15;
        pack4(lo, d);
        for (int i = 0; i < 32; i++) lo[i] = c[i] >> 4;
        pack2(lo, d + MQ_PACK6_HI);
        break;
    }
}

void mq_unpack_chunk(const uint8_t *s, int pack, uint8_t *c) {
    uint8_t hi[MQ_CHUNK];
    switch (pack) {
    case MQ_PACK3C: unpack3c(s, c); break;
    case 8: memcpy(c, s, MQ_CHUNK); break;
    case 2: unpack2(s, c); break;
    case 3: unpack2(s, c); unpackbit(s + MQ_PACK3_HI, 2, c); break;
    case 4: unpack4(s, c); break;
    case 5: unpack4(s, c); unpackbit(s + MQ_PACK5_HI, 4, c); break;
    case 6:
        unpack4(s, c);
        unpack2(s + MQ_PACK6_HI, hi);
        for (int i = 0; i < 32; i++) c[i] |= (uint8_t)(hi[i] << 4);
        break;
    }
}

void mq_dequant_row(int fmt, const uint8_t *row, int64_t k, float *out, const uint8_t *lv,
                    float lo, float step) {
    if (fmt == MQ_F32) { memcpy(out, row, (size_t)k * 4); return; }
#if defined(__x86_64__) || defined(__i386__)
    if (fmt == MQ_F16 && mq_isa_get() >= MQ_ISA_AVX2) { mq_f16_to_f32_avx2(row, out, k); return; }
#endif
    if (fmt == MQ_F16) { for (int64_t i = 0; i < k; i++) out[i] = mq_f16_to_f32(mq_get16(row + 2 * i)); return; }
    if (fmt == MQ_BF16) { for (int64_t i = 0; i < k; i++) out[i] = mq_bf16_to_f32(mq_get16(row + 2 * i)); return; }
    if (mq_x_base(fmt) >= 0) {   /* q4x/q6x/q3x rows are not contiguous (mq_dequant_row_at): loud, never silent */
        for (int64_t i = 0; i < k; i++) out[i] = NAN;
        return;
    }
    if (!MQ_IS_PACKED(fmt)) return;
    /* every row format by its row of MQ_FORMATS: w = d * (U - off) + m (levels, header, trailer) */
    const mq_fmt_spec *f = &MQ_FORMATS[fmt];
    const int G = f->group, hd = f->header, cb = MQ_CHUNK_BYTES(f->bits), bb = f->block_bytes;
    const int add_m = f->trailer > 0 || hd >= MQ_HDR_M + 2;
    const float off = (float)f->off;
    if ((f->levels == MQ_LV_TABLE && lv == NULL) || G > MQ_GROUP_MAX) {
        for (int64_t i = 0; i < k; i++) out[i] = NAN;
        return;
    }
    uint8_t codes[MQ_GROUP_MAX];
    float L[256];
    for (int64_t b = 0, nb = (k + G - 1) / G; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        int nv = (int)(k - b * G < G ? k - b * G : G);
        for (int c = 0; c < (nv + MQ_CHUNK - 1) / MQ_CHUNK; c++)
            mq_unpack_chunk(blk + hd + c * cb, f->pack, codes + MQ_CHUNK * c);
        float *o = out + b * G;
        float d, m = 0.0f;
        if (f->trailer > 0) { d = step; m = lo; }   /* q5g: the tensor's (lo, step) */
        else {
            d = mq_f16_to_f32(mq_get16(blk + MQ_HDR_D));
            if (add_m) m = mq_f16_to_f32(mq_get16(blk + MQ_HDR_M));
        }
        const uint8_t *tab = f->levels == MQ_LV_TABLE ? lv : f->levels == MQ_LV_BLOCK_LUT ? blk + MQ_HDR_LUT : NULL;
        if (tab != NULL) {   /* one value per level: the same two roundings as per weight */
            for (int j = 0; j < 1 << f->bits; j++) L[j] = add_m ? d * ((float)tab[j] - off) + m : d * ((float)tab[j] - off);
            for (int i = 0; i < nv; i++) o[i] = L[codes[i]];
            continue;
        }
        const uint8_t flip = f->levels == MQ_LV_SIGNED ? 0x80 : 0;
        if (add_m) for (int i = 0; i < nv; i++) o[i] = d * ((float)(uint8_t)(codes[i] ^ flip) - off) + m;
        else for (int i = 0; i < nv; i++) o[i] = d * ((float)(uint8_t)(codes[i] ^ flip) - off);
    }
}

/* q4x / q6x: per row block, 2-byte header fields then 4-byte code words; interleaved, field h of the
 * 16 rows is 32 bytes at 32 h, word w 64 bytes at 32 H + 64 w */
static void xperm_fields(int fmt, int *H, int *W) {
    if (fmt == MQ_Q4X) { *H = 2; *W = 4; }
    else { *H = 1; *W = 6; }
}

static void xperm_row(int fmt, const uint8_t *b, int r, uint8_t *o) {   /* one block of row r */
    int H, W;
    xperm_fields(fmt, &H, &W);
    for (int h = 0; h < H; h++) memcpy(o + 2 * h, b + 32 * h + 2 * r, 2);
    for (int w = 0; w < W; w++) memcpy(o + 2 * H + 4 * w, b + 32 * H + 64 * w + 4 * r, 4);
}

/* row r's 64 codes of a q3x block (mq_format.h): the scalar reference of the kernels' steps */
static void q3x_codes(const uint8_t *b, int r, uint8_t *c) {
    const uint8_t *p = b + MQ_Q3X_CODES + 4 * r;
    for (int j = 0; j < 4; j++) {
        for (int w = 0; w < 6; w++) {
            c[8 * w + j] = p[64 * w + j] & 7;
            c[8 * w + 4 + j] = (p[64 * w + j] >> 3) & 7;
        }
        for (int w = 0; w < 4; w++)
            c[48 + 4 * w + j] = (uint8_t)((p[64 * w + j] >> 6) | (((p[64 * (4 + (w >> 1)) + j] >> (6 + (w & 1))) & 1) << 2));
    }
}

void mq_x_group_to_rows(int fmt, const uint8_t *grp, int64_t nb, uint8_t *out) {
    if (fmt == MQ_Q4X || fmt == MQ_Q6X) {
        const int bb = MQ_FORMATS[fmt].block_bytes;
        for (int64_t c = 0; c < nb; c++)
            for (int r = 0; r < MQ_XROWS; r++) xperm_row(fmt, grp + c * MQ_XROWS * bb, r, out + (r * nb + c) * bb);
        return;
    }
    const int64_t rb = nb * MQ_Q3_BLOCK;
    uint8_t c[64];
    for (int64_t bi = 0; bi < nb; bi++) {
        const uint8_t *b = grp + bi * MQ_Q3X_BLOCK;
        for (int r = 0; r < MQ_XROWS; r++) {
            uint8_t *o = out + r * rb + bi * MQ_Q3_BLOCK;
            memcpy(o + MQ_HDR_D, b + 2 * r, 2);
            memcpy(o + MQ_HDR_M, b + 32 + 2 * r, 2);
            q3x_codes(b, r, c);
            mq_pack_chunk(c, MQ_PACK3C, o + MQ_Q3_HEADER);
            mq_pack_chunk(c + MQ_CHUNK, MQ_PACK3C, o + MQ_Q3_HEADER + MQ_CHUNK_BYTES(MQ_Q3_BITS));
        }
    }
}

void mq_dequant_row_at(int fmt, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, float *out,
                       const uint8_t *lv, float lo, float step) {
    if (fmt == MQ_Q3X) {   /* one q3p block at a time, then the q3p dequantizer */
        const int64_t nb = (k + MQ_Q3_GROUP - 1) / MQ_Q3_GROUP;
        const uint8_t *g = w + (n / MQ_XROWS) * MQ_XROWS * row_bytes;
        const int r = (int)(n % MQ_XROWS);
        uint8_t blk[MQ_Q3_BLOCK], c[64];
        for (int64_t bi = 0; bi < nb; bi++) {
            const uint8_t *b = g + bi * MQ_Q3X_BLOCK;
            memcpy(blk + MQ_HDR_D, b + 2 * r, 2);
            memcpy(blk + MQ_HDR_M, b + 32 + 2 * r, 2);
            q3x_codes(b, r, c);
            mq_pack_chunk(c, MQ_PACK3C, blk + MQ_Q3_HEADER);
            mq_pack_chunk(c + MQ_CHUNK, MQ_PACK3C, blk + MQ_Q3_HEADER + MQ_CHUNK_BYTES(MQ_Q3_BITS));
            int64_t nv = k - bi * MQ_Q3_GROUP < MQ_Q3_GROUP ? k - bi * MQ_Q3_GROUP : MQ_Q3_GROUP;
            mq_dequant_row(MQ_Q3P, blk, nv, out + bi * MQ_Q3_GROUP, lv, lo, step);
        }
        return;
    }
    if (fmt != MQ_Q4X && fmt != MQ_Q6X) { mq_dequant_row(fmt, w + n * row_bytes, k, out, lv, lo, step); return; }
    const int base = mq_x_base(fmt), bb = MQ_FORMATS[fmt].block_bytes;
    const int64_t nc = (k + MQ_CHUNK - 1) / MQ_CHUNK;
    const uint8_t *g = w + (n / MQ_XROWS) * MQ_XROWS * row_bytes;
    uint8_t blk[32];
    for (int64_t c = 0; c < nc; c++) {   /* one block at a time, then the base format's dequantizer */
        xperm_row(fmt, g + c * MQ_XROWS * bb, (int)(n % MQ_XROWS), blk);
        int64_t nv = k - c * MQ_CHUNK < MQ_CHUNK ? k - c * MQ_CHUNK : MQ_CHUNK;
        mq_dequant_row(base, blk, nv, out + c * MQ_CHUNK, lv, lo, step);
    }
}
