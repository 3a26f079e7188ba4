/* The format spec: ids and byte layouts of every mixqrt tensor format, defined once.
 *
 * Every C file (quantizers, dequantizer, kernel tiers) and, through the extensions' format_table(),
 * every Python module (mixqrt.formats.layout, codec, ops) reads ids and sizes from here. The prose
 * and the numpy reference packers are mixqrt/formats/layout.py; docs/mxq-file.md has the file format.
 *
 * A packed [N, K] tensor is N rows of ceil(K / G) blocks of G weights. A block is a header (fp16
 * little-endian scales) then G/32 chunks of 32 codes. w = d * L[q] + m in float32 (one multiply,
 * one add); q5g has no header and a per-tensor (lo, hi) float32 trailer instead.
 *
 * Format ids are internal (a .mxq file names formats by string): they may change between versions,
 * but quantizers and kernels always share them. Packed ids come first, float ids after MQ_F32. */
#ifndef MIXQRT_MQ_FORMAT_H
#define MIXQRT_MQ_FORMAT_H
#include <stdint.h>
#include <string.h>

/* In this order: the row formats, the row-interleaved forms, then the plain ones from MQ_F32. Adding a
 * format: docs/architecture.md, "Adding a format" (tests/test_format_walkthrough.py does it). */
enum mq_fmt {
    MQ_Q8, MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P, MQ_Q2C, MQ_Q5G,
    MQ_Q4X, MQ_Q3X, MQ_Q6X,
    MQ_F32, MQ_F16, MQ_BF16,
    MQ_NFMT
};
#define MQ_NPACKED MQ_F32                       /* ids below are packed formats */
#define MQ_IS_PACKED(f) ((unsigned)(f) < (unsigned)MQ_NPACKED)

#define MQ_CHUNK 32                              /* codes per chunk: one ymm of u8 levels */

/* ---------------------------------------------------------------- chunk packings (32 codes)
 * pack2  8 B : byte i = c[i] | c[i+8] << 2 | c[i+16] << 4 | c[i+24] << 6      (i < 8)
 * pack3 12 B : pack2(c & 3), then u32 LE at MQ_PACK3_HI: bit i = bit 2 of c[i]
 * pack4 16 B : byte i = c[i] | c[i+16] << 4                                    (i < 16)
 * pack5 20 B : pack4(c & 15), then u32 LE at MQ_PACK5_HI: bit i = bit 4 of c[i]
 * pack6 24 B : pack4(c & 15), then pack2(c >> 4) at MQ_PACK6_HI
 * pack8 32 B : the codes as int8
 * pack3c 12 B: code i at bits 3i..3i+2 of the 96-bit little-endian integer (q3p since .mxq version 2:
 *             a block's 64 codes are then 24 contiguous bytes, which AVX-512 unpacks with one vpermb
 *             (3 bytes per qword), one vpmultishiftqb and one vpermb lookup of the levels)
 * A format's packing id (mq_fmt_spec.pack) is its bit count for the planar packings, MQ_PACK3C for
 * pack3c; mq_pack_chunk / mq_unpack_chunk take that id. */
#define MQ_CHUNK_BYTES(bits) ((bits) * 4)
#define MQ_PACK3C 35
#define MQ_PACK3_HI 8
#define MQ_PACK5_HI 16
#define MQ_PACK6_HI 16

/* ---------------------------------------------------------------- row-interleaved storage (q4x, q6x, q3x)
 * q4x holds q4's blocks (same d, m and codes, same bytes per row) with the rows interleaved in groups
 * of MQ_XROWS, for decode: a group is one contiguous stream, and one zmm load gives 4 code bytes of
 * each of the 16 rows, the layout of a vpdpbusd with broadcast activations (no shuffles, no
 * horizontal sums). Rows [16g, 16g + 16), chunk c (32 weights) is MQ_Q4X_CHUNK bytes at
 * (g * nc + c) * MQ_Q4X_CHUNK:
 *     [0, 32)    d of rows 0..15 (fp16)
 *     [32, 64)   m of rows 0..15 (fp16)
 *     [64, 320)  for s < 4, r < 16: bytes 4s..4s+3 of row r's pack4 chunk, at 64 + 64 s + 4 r
 * so the low nibbles of word (s, r) are row r's codes 4s..4s+3 and the high nibbles 16+4s..19+4s.
 * A q4x tensor has N % MQ_XROWS == 0 (mixqrt stores q4 tensors of other heights as q4).
 *
 * q6x is q6 the same way, MQ_Q6X_CHUNK bytes per chunk of 16 rows: [0, 32) d of the 16 rows (fp16),
 * [32, 288) bytes 4s..4s+3 of row r's pack4 part at 32 + 64 s + 4 r (the low 4 bits, as q4x), then
 * [288, 416) bytes 4y..4y+3 of its pack2 part at 288 + 64 y + 4 r: bits 2f..2f+1 of word (y, r) are
 * the top 2 bits of codes 4 (2f + y) .. +3. q4x and q6x are byte permutations of q4 and q6: per row
 * block, each 2-byte header field becomes 32 bytes (16 rows) and each 4-byte code word 64 bytes.
 *
 * q3x holds q3p's blocks (64 weights, d, m, codes into the level table) the same way, for a
 * vpermb level lookup per 64 codes of 16 rows: block b of group g is MQ_Q3X_BLOCK bytes at
 * (g * nb + b) * MQ_Q3X_BLOCK. Step i (i < 16) is the codes k = 4i .. 4i + 3 of the 16 rows, and
 * its level vector is one vpdpbusd operand (dword lane r = row r, byte j = code 4i + j):
 *     [0, 32) d, [32, 64) m of rows 0..15 (fp16)
 *     [64, 448)  six code planes P_w (w < 6) of 64 bytes; byte 64 + 64 w + 4 r + j of row r holds
 *                bits 0-2: code 8w + j        (step 2w)
 *                bits 3-5: code 8w + 4 + j    (step 2w + 1)
 *                bits 6-7: for w < 4, bits 0-1 of code 48 + 4w + j (step 12 + w);
 *                          for w = 4 / 5, bit 2 of the codes of steps 12, 13 / 14, 15 (bit 6, bit 7)
 * vpermb reads index bits 0-5, so steps 0-11 are one vpermb each on a plane as loaded (a table of
 * the level of bits 0-2, or of bits 3-5), with no shift and no merge; steps 12-15 take one shift,
 * one bit select and one vpermb (.mxq version 5; version 4 stored a 2-bit and a 1-bit plane that
 * every step had to merge, docs/mxq-file.md). */
#define MQ_XROWS 16
#define MQ_Q4X_CHUNK (MQ_XROWS * 20)
#define MQ_Q4X_CODES 64
#define MQ_Q6X_CHUNK (MQ_XROWS * 26)
#define MQ_Q6X_LO 32
#define MQ_Q6X_HI 288
#define MQ_Q3X_BLOCK (MQ_XROWS * 28)
#define MQ_Q3X_CODES 64

/* ---------------------------------------------------------------- block headers */
#define MQ_HDR_D 0                               /* fp16 d */
#define MQ_HDR_M 2                               /* fp16 m (formats with a 4+ byte header) */
#define MQ_HDR_LUT 4                             /* a block table (MQ_LV_BLOCK_LUT): u8 lut[4] after d, m */
#define MQ_Q2C_LUT MQ_HDR_LUT                    /* q2c: L[q] = lut[q] */
#define MQ_Q3P_NLEVELS 8                         /* q3p: L[q] = levels[q], a u8 table passed in */
#define MQ_Q3P_LEVEL_MAX 127                     /* keeps AVX2 vpmaddubsw pairs (2 x 127 x 127) below int16 saturation */
#define MQ_Q5G_TRAILER 8                         /* q5g: float32 lo, hi after all rows */

/* per format: bits, weights per block, header bytes, bytes per block, level offset (the kernels'
 * u8 levels are U = L + off: q8's signed codes + 128, q6's q - 32 + 32; q6 carries -off * d in the
 * float offset term, q8 subtracts off * sum(q) from the integer sums so that they are the exact
 * signed sums) */
#define MQ_Q8_BITS 8
#define MQ_Q8_GROUP 32
#define MQ_Q8_HEADER 2
#define MQ_Q8_OFF 128
#define MQ_Q6_BITS 6
#define MQ_Q6_GROUP 32
#define MQ_Q6_HEADER 2
#define MQ_Q6_OFF 32
#define MQ_Q4_BITS 4
#define MQ_Q4_GROUP 32
#define MQ_Q4_HEADER 4
#define MQ_Q3_BITS 3                             /* q3u and q3p: same block, q3p packs its codes pack3c */
#define MQ_Q3_GROUP 64
#define MQ_Q3_HEADER 4
#define MQ_Q2C_BITS 2
#define MQ_Q2C_GROUP 128
#define MQ_Q2C_HEADER 8
#define MQ_Q5G_BITS 5
#define MQ_Q5G_GROUP 32
#define MQ_Q5G_HEADER 0

#define MQ_BLOCK_BYTES(hdr, group, bits) ((hdr) + ((group) / MQ_CHUNK) * MQ_CHUNK_BYTES(bits))
#define MQ_Q8_BLOCK MQ_BLOCK_BYTES(MQ_Q8_HEADER, MQ_Q8_GROUP, MQ_Q8_BITS)
#define MQ_Q6_BLOCK MQ_BLOCK_BYTES(MQ_Q6_HEADER, MQ_Q6_GROUP, MQ_Q6_BITS)
#define MQ_Q4_BLOCK MQ_BLOCK_BYTES(MQ_Q4_HEADER, MQ_Q4_GROUP, MQ_Q4_BITS)
#define MQ_Q3_BLOCK MQ_BLOCK_BYTES(MQ_Q3_HEADER, MQ_Q3_GROUP, MQ_Q3_BITS)
#define MQ_Q2C_BLOCK MQ_BLOCK_BYTES(MQ_Q2C_HEADER, MQ_Q2C_GROUP, MQ_Q2C_BITS)
#define MQ_Q5G_BLOCK MQ_BLOCK_BYTES(MQ_Q5G_HEADER, MQ_Q5G_GROUP, MQ_Q5G_BITS)

/* the sizes the kernels' shuffle tables and the bpw in docs/quant-formats.md were written for */
_Static_assert(MQ_Q8_BLOCK == 34, "q8 block: 2 + 32 bytes (8.5 bpw)");
_Static_assert(MQ_Q6_BLOCK == 26, "q6 block: 2 + 24 bytes (6.5 bpw)");
_Static_assert(MQ_Q4_BLOCK == 20, "q4 block: 4 + 16 bytes (5.0 bpw)");
_Static_assert(MQ_Q3_BLOCK == 28, "q3u/q3p block: 4 + 2 x 12 bytes (3.5 bpw)");
_Static_assert(MQ_Q2C_BLOCK == 40, "q2c block: 8 + 4 x 8 bytes (2.5 bpw)");
_Static_assert(MQ_Q5G_BLOCK == 20, "q5g block: 20 bytes, no header");
_Static_assert(MQ_Q4X_CHUNK == MQ_XROWS * MQ_Q4_BLOCK, "q4x: 16 q4 blocks per chunk group");
_Static_assert(MQ_Q3X_BLOCK == MQ_XROWS * MQ_Q3_BLOCK && MQ_Q3X_CODES + 6 * 64 == MQ_Q3X_BLOCK, "q3x: 16 q3p blocks per block group");
_Static_assert(MQ_Q6X_CHUNK == MQ_XROWS * MQ_Q6_BLOCK && MQ_Q6X_HI + 128 == MQ_Q6X_CHUNK, "q6x: 16 q6 blocks per chunk group");
_Static_assert(MQ_Q2C_LUT + 4 == MQ_Q2C_HEADER, "q2c header: d, m, lut[4]");
_Static_assert(MQ_Q3P_NLEVELS == 1 << MQ_Q3_BITS, "one q3p level per 3-bit code");

/* ---------------------------------------------------------------- the table */
/* how a format's codes become the u8 levels U the integer kernels multiply (mq_fmt_spec.levels);
 * the value is w = d * (U - off) + m, m from the header when it has one (q5g: lo + U * step) */
enum mq_levels {
    MQ_LV_CODES,       /* U = the code */
    MQ_LV_SIGNED,      /* int8 codes, U = code ^ 0x80 (off 128: the products subtract 128 * sum(q) in integers) */
    MQ_LV_TABLE,       /* U = the tensor's level table at the code (q3p: MQ_Q3P_NLEVELS bytes passed in) */
    MQ_LV_BLOCK_LUT,   /* U = the block's own 4-entry table at the code (MQ_HDR_LUT; q2c) */
};
#define MQ_GROUP_MAX 128                         /* the largest group (q2c): the code buffers' size */

typedef struct {
    const char *name;
    int bits;          /* code bits (plain formats: bits per value) */
    int group;         /* weights per block (plain: 1) */
    int header;        /* header bytes per block */
    int block_bytes;   /* bytes per block (plain: bytes per value) */
    int trailer;       /* bytes after all rows */
    int off;           /* level offset of the integer kernels */
    int pack;          /* chunk packing id: bits, or MQ_PACK3C (packed formats only) */
    int levels;        /* enum mq_levels; the scale and minimum come from the trailer when trailer > 0 */
} mq_fmt_spec;

/* The packed formats as X-macro lists, for the kernels' per-format entries and traits tables (each
 * tier instantiates its kernels for every format listed): X(name, id). Row formats keep each row's
 * blocks together; the interleaved ones (q4x / q6x / q3x) store MQ_XROWS rows' blocks side by side. */
#define MQ_FOR_ROW_FORMATS(X) X(q8, MQ_Q8) X(q6, MQ_Q6) X(q4, MQ_Q4) X(q3u, MQ_Q3U) X(q3p, MQ_Q3P) \
    X(q2c, MQ_Q2C) X(q5g, MQ_Q5G)
#define MQ_FOR_X_FORMATS(X) X(q4x, MQ_Q4X) X(q6x, MQ_Q6X) X(q3x, MQ_Q3X)

static const mq_fmt_spec MQ_FORMATS[MQ_NFMT] = {
    [MQ_Q8] = {"q8", MQ_Q8_BITS, MQ_Q8_GROUP, MQ_Q8_HEADER, MQ_Q8_BLOCK, 0, MQ_Q8_OFF, MQ_Q8_BITS, MQ_LV_SIGNED},
    [MQ_Q6] = {"q6", MQ_Q6_BITS, MQ_Q6_GROUP, MQ_Q6_HEADER, MQ_Q6_BLOCK, 0, MQ_Q6_OFF, MQ_Q6_BITS, MQ_LV_CODES},
    [MQ_Q4] = {"q4", MQ_Q4_BITS, MQ_Q4_GROUP, MQ_Q4_HEADER, MQ_Q4_BLOCK, 0, 0, MQ_Q4_BITS, MQ_LV_CODES},
    [MQ_Q3U] = {"q3u", MQ_Q3_BITS, MQ_Q3_GROUP, MQ_Q3_HEADER, MQ_Q3_BLOCK, 0, 0, MQ_Q3_BITS, MQ_LV_CODES},
    [MQ_Q3P] = {"q3p", MQ_Q3_BITS, MQ_Q3_GROUP, MQ_Q3_HEADER, MQ_Q3_BLOCK, 0, 0, MQ_PACK3C, MQ_LV_TABLE},
    [MQ_Q2C] = {"q2c", MQ_Q2C_BITS, MQ_Q2C_GROUP, MQ_Q2C_HEADER, MQ_Q2C_BLOCK, 0, 0, MQ_Q2C_BITS, MQ_LV_BLOCK_LUT},
    [MQ_Q5G] = {"q5g", MQ_Q5G_BITS, MQ_Q5G_GROUP, MQ_Q5G_HEADER, MQ_Q5G_BLOCK, MQ_Q5G_TRAILER, 0, MQ_Q5G_BITS, MQ_LV_CODES},
    [MQ_Q4X] = {"q4x", MQ_Q4_BITS, MQ_Q4_GROUP, MQ_Q4_HEADER, MQ_Q4_BLOCK, 0, 0, MQ_Q4_BITS, MQ_LV_CODES},
    [MQ_Q3X] = {"q3x", MQ_Q3_BITS, MQ_Q3_GROUP, MQ_Q3_HEADER, MQ_Q3_BLOCK, 0, 0, MQ_PACK3C, MQ_LV_TABLE},
    [MQ_Q6X] = {"q6x", MQ_Q6_BITS, MQ_Q6_GROUP, MQ_Q6_HEADER, MQ_Q6_BLOCK, 0, MQ_Q6_OFF, MQ_Q6_BITS, MQ_LV_CODES},
    [MQ_F32] = {"f32", 32, 1, 0, 4, 0, 0},
    [MQ_F16] = {"f16", 16, 1, 0, 2, 0, 0},
    [MQ_BF16] = {"bf16", 16, 1, 0, 2, 0, 0},
};

/* bytes of one row of k weights (trailer excluded); -1 for an unknown id */
static inline int64_t mq_row_bytes(int fmt, int64_t k) {
    if (fmt < 0 || fmt >= MQ_NFMT) return -1;
    const mq_fmt_spec *f = &MQ_FORMATS[fmt];
    return (k + f->group - 1) / f->group * f->block_bytes;
}

/* ---------------------------------------------------------------- fp16 / bf16 (little-endian) */
static inline uint16_t mq_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline void mq_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* round to nearest even, subnormals exact (as numpy's float16 cast) */
static inline uint16_t mq_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* >= 65520 rounds to Inf */
    if (ax < 0x38800000u) {                                             /* below 2^-14: subnormal */
        if (ax < 0x33000000u) return (uint16_t)sign;                    /* <= 2^-25 ties to 0 */
        uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = ax - 0x38000000u, q = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static inline float mq_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        if (m == 0) x = sign;
        else {                                              /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            x = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) x = sign | 0x7f800000u | (m << 13);
    else x = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline float mq_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---------------------------------------------------------------- portable pack / unpack (format.c) */
void mq_pack_chunk(const uint8_t *c, int pack, uint8_t *dst);     /* 32 codes -> bits*4 bytes (pack: packing id) */
void mq_unpack_chunk(const uint8_t *src, int pack, uint8_t *c);   /* inverse (q8: int8 bits) */

/* The one dequantizer: row of k weights in `fmt` -> out[k] float32 (w = d*L + m, layout.py).
 * levels: the q3p table (MQ_Q3P_NLEVELS bytes; may be NULL for other formats); q5_lo/q5_step:
 * the decoded q5g trailer (step = (hi - lo) / 31). Uses the F16C tier for f16 where available. */
void mq_dequant_row(int fmt, const uint8_t *row, int64_t k, float *out, const uint8_t *levels,
                    float q5_lo, float q5_step);

/* Row n of a [N, k] tensor starting at w (row_bytes per row) -> out[k] float32: mq_dequant_row of the
 * row, or for q4x / q3x the row gathered from its group first. */
void mq_dequant_row_at(int fmt, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, float *out,
                       const uint8_t *levels, float q5_lo, float q5_step);
/* An interleaved group (rows [16g, 16g + 16), at grp; nblk blocks per row) -> its 16 rows in the base
 * format at out (nblk * block bytes each) */
void mq_x_group_to_rows(int fmt, const uint8_t *grp, int64_t nblk, uint8_t *out);
/* interleaved formats: the format whose rows they hold (MQ_Q4, MQ_Q6, MQ_Q3P), else -1 */
static inline int mq_x_base(int fmt) { return fmt == MQ_Q4X ? MQ_Q4 : fmt == MQ_Q6X ? MQ_Q6 : fmt == MQ_Q3X ? MQ_Q3P : -1; }

/* F16C tier (f16_avx2.c; compiled to nothing off x86, never selected there) */
void mq_f32_to_f16_avx2(const float *x, uint8_t *out, int64_t n);
void mq_f16_to_f32_avx2(const uint8_t *h, float *out, int64_t n);
#endif
