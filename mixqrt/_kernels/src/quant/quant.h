/* Quantize + pack and dequantize for every mixqrt format (the fast path of mixqrt.quant.formats).
 * Bit-exact with the numpy reference: float32 ops in the reference's order, no contraction
 * (-ffp-contract=off), fp16 conversion with round-to-nearest-even including subnormals. */
#ifndef MIXQRT_QUANT_H
#define MIXQRT_QUANT_H
#include <stdint.h>
#include <string.h>

enum mq_fmt { MQ_Q8 = 0, MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P, MQ_Q2C, MQ_Q5G, MQ_F16, MQ_BF16, MQ_F32, MQ_NFMT };

/* x: n rows of k float32 (row stride k); out: layout.expected_nbytes(fmt, (n, k)) bytes.
 * levels: Q3P_LEVELS (8 bytes). lo/hi: q5g range (already validated). Returns 0, or -1 for a bad fmt. */
int mq_quantize(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *levels,
                float lo, float hi);

/* Dequantize rows ids[0..nids) (or rows 0..nids when ids == NULL) of a packed [*, k] tensor into
 * out [nids, k]. lo/hi: the q5g trailer. */
int mq_dequantize_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *ids, int64_t nids,
                       float *out, const uint8_t *levels, float lo, float hi);

int64_t mq_row_bytes(int fmt, int64_t k);

/* Error-minimising (d, m) search for q6/q4/q3u/q3p, same layouts (search.c; spec: formats.py
 * _search_parts). imp: k per-column weights (imatrix) or NULL for plain squared error.
 * Returns 0, or -1 for a format without a search. */
int mq_quantize_search(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *levels,
                       const float *imp);

/* q2c: one block of nv (<= 128) values -> 40 packed bytes; scratch >= 4 * 128 doubles */
void mq_q2c_block(const float *x, int nv, uint8_t *dst);

/* ---------------------------------------------------------------- fp16, shared by every file */
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

/* round toward zero: the scale never exceeds the exact quotient (see formats.py) */
static inline uint16_t mq_f32_to_f16_rtz(float f) {
    uint16_t h = mq_f32_to_f16(f);
    float back = mq_f16_to_f32(h);
    if ((back < 0 ? -back : back) > (f < 0 ? -f : f)) h = (uint16_t)(h - 1);
    return h;
}

/* keep d if fl(d*top + m) == target, else the next fp16 up if that one hits target exactly */
static inline uint16_t mq_snap(uint16_t d, float m, float top, float target) {
    if (mq_f16_to_f32(d) * top + m == target) return d;
    uint32_t up = (uint32_t)d + 1;
    if (up < 0x7c00u && mq_f16_to_f32((uint16_t)up) * top + m == target) return (uint16_t)up;
    return d;
}

static inline void mq_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline uint16_t mq_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* AVX2 tier (f16_avx2.c; compiled to nothing on non-x86, never selected there) */
void mq_f32_to_f16_avx2(const float *x, uint8_t *out, int64_t n);
void mq_f16_to_f32_avx2(const uint8_t *h, float *out, int64_t n);

/* chunk packers (layout.py): 32 codes -> bits*4 bytes */
void mq_pack_chunk(const uint8_t *c, int bits, uint8_t *dst);
void mq_unpack_chunk(const uint8_t *src, int bits, uint8_t *c);
#endif
