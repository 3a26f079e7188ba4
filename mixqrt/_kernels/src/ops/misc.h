/* The float ops of a layer: dispatched by misc.c to the tiers misc_generic.c, misc_avx2.c and
 * misc_avx512.c, which compile one source (misc_impl.h) each. */
#ifndef MIXQRT_MISC_H
#define MIXQRT_MISC_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

void mq_rmsnorm(const float *x, const float *w, float *y, int T, int D, float eps);
void mq_rope(float *x, const int64_t *pos, int T, int H, int Dh, double theta);
void mq_silu_mul(const float *g, const float *u, float *y, size_t n);
/* y [T, N] = x [T, K] w [N, K]^T, the same bits on every tier (16 float lanes in a fixed order): routers */
void mq_dot_rows(const float *w, const float *x, float *y, int N, int K, int T);
/* y = H_b (s * x) per block of b (a power of two dividing K), H_b scaled by `scale`; s may be NULL */
void mq_hadamard(const float *x, float *y, const float *s, int T, int K, int b, float scale);
void mq_softmax_rows(float *x, int rows, int n, int fast);
/* causal softmax of score rows [r0, r1) of [rows, n]; row r is query r % T at position pos0 + r % T */
void mq_softmax_causal(float *x, int n, int T, int pos0, int r0, int r1);
float mq_expf_fast(float x);   /* valid on [-87, 88]; see misc_impl.h */
/* scratch: MQ_ATT_SCRATCH(S, Dh, T) floats (score rows for MQ_ATT_GB heads of one KV group at up to
 * MQ_ATT_TP query positions at once; a group of more heads runs in passes of MQ_ATT_GB) */
void mq_attention(const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                  int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch);
#define MQ_ATT_GB 8
#define MQ_ATT_TP 8
#define MQ_ATT_SCRATCH(S, Dh, T) ((size_t)((T) < 1 ? 1 : (T) < MQ_ATT_TP ? (T) : MQ_ATT_TP) * MQ_ATT_GB * ((size_t)(S) + 16) \
                                  + 2 * (size_t)(Dh) + 16)
/* Attention over the packed KV cache (kvattn_impl.h, reference mixqrt/kv/ref.py). kf, vf: f16 keys /
 * values [Hkv, S, Dh] (the positions a row reads in f16: block 0 and its own partial block, or every
 * position without a packed store); pk: packed blocks [Hkv, S / 64, block_bytes] or NULL; rows t read
 * positions 0 .. pos0 + t (window > 0: the last `window` of them). S a multiple of 64, Dh a multiple of
 * 32 and <= 256. */
typedef struct {
    const float *q;          /* [T, Hq, Dh] */
    float *out;              /* [T, Hq, Dh] */
    const uint16_t *kf, *vf;
    const uint8_t *pk;
    int T, Hq, Hkv, Dh, S, pos0, bits, window, block_bytes;
} mq_kvatt;
#define MQ_KV_TR 8           /* rows of a tile (each block read once per tile) */
/* Whole blocks before a row's own that it still reads in f16 (the packed KV cache's rule, kv/ref.py RECENT). */
#define MQ_KV_RECENT 3
#define MQ_KV_PF 2           /* packed blocks prefetched ahead of the one being read */
#define MQ_KV_GB 16          /* query heads of one KV head per pass */
/* q8: kscale, kmin [Dh] f16, codes, vscale, vmin [64] f16, codes. q4: kmin [Dh] f16, kscale [Dh] u8 (a
 * LOGSCALE code), the four 16-position sub-blocks' adjustments [4][Dh] bytes, codes, vscale [64] u8,
 * codes (kv/ref.py) */
#define MQ_KV_SUB 16
#define MQ_KV_BLOCK_BYTES(Dh, bits) ((bits) == 4 ? 2 * (Dh) + (Dh) + 4 * (Dh) + 64 * (Dh) + 64 \
                                                 : 4 * (Dh) + 2 * (64 * (Dh)) + 4 * 64)
/* q4 values: the int8 level of each 4-bit code (NF4's normal quantiles x 127; kv/ref.py VLEV) */
#define MQ_KV_KEY_NA 3       /* q4 keys: a half-block's (a, b) searched over 3 mins x 4 scales (ref.KEY_NA, KEY_NB) */
#define MQ_KV_KEY_NB 4
/* q4's 8-bit scales: code e stands for 2^((e mod 12) / 12) * 2^(e / 12 - 16) (1.5e-5 .. 38.1, steps of
 * 2^(1/12)), built exactly from the float32 bits of the 12 factors 2^(k/12) (kv/ref.py LOGTAB); a scale
 * is stored as the first code at or above it (255 if none) */
#define MQ_KV_LOGMANT_BITS {0x3f800000u, 0x3f879c7du, 0x3f8facd6u, 0x3f9837f0u, 0x3fa14518u, 0x3faadc08u, 0x3fb504f3u, 0x3fbfc887u, 0x3fcb2ff5u, 0x3fd744fdu, 0x3fe411f0u, 0x3ff1a1bfu}
static inline float mq_kv_logscale(unsigned e) {
    static const uint32_t mb[12] = MQ_KV_LOGMANT_BITS;
    const uint32_t b = mb[e % 12] + ((e / 12) << 23) - (16u << 23);
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline uint8_t mq_kv_logcode(float x) {
    int lo = 0, hi = 256;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (mq_kv_logscale((unsigned)mid) >= x) hi = mid;
        else lo = mid + 1;
    }
    return (uint8_t)(lo > 255 ? 255 : lo);
}
#define MQ_KV_VLEV {-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127}
#define MQ_KV_SCRATCH_FLOATS(Dh) ((size_t)MQ_KV_TR * (17 * MQ_KV_GB + (size_t)MQ_KV_GB * (Dh)) + MQ_KV_GB * 64 + 256 \
                                  + (2 * MQ_KV_GB * 256 + MQ_KV_GB * 256 * 4 + MQ_KV_GB * 64) / 4 + 64)
/* KV head kh, rows [r0, r1); scratch MQ_KV_SCRATCH_FLOATS(Dh) floats */
void mq_kvattn(const mq_kvatt *a, int kh, int r0, int r1, float *scratch);
/* pack blocks [b0, b1) of every head from the f16 stores into pk [Hkv, NB, block_bytes] */
/* in place: the orthonormal Walsh-Hadamard transform of dh floats in blocks of dh's largest power-of-two
 * divisor (kv/ref.py fwht); q4 keeps a packed layer's values rotated by it */
void mq_kv_fwht(float *x, int dh);
void mq_kv_pack(const uint16_t *kf, const uint16_t *vf, int S, int Dh, int Hkv, int b0, int b1, int bits,
                uint8_t *pk, int NB);
#endif
