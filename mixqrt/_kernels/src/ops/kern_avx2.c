/* AVX2 tier (AVX2 + FMA + F16C + BMI2): one chunk (32 codes) per ymm, unpacked with a broadcast,
 * per-qword shifts (vpsrlvq) and masks, byte-bit expansion (vpshufb + vpcmpeqb) for 3rd/5th bits and
 * vpshufb for table levels; then u8 x s8 products with vpmaddubsw + vpmaddwd(ones).
 *
 * int16 saturation of vpmaddubsw (a pair U0*a0 + U1*a1 must stay within +-32767, |a| <= 127):
 *   q6/q4/q3u/q3p/q5g: U <= 63, pairs <= 2*63*127 = 16002: safe.
 *   q8: U = c + 128 would overflow; the product uses the signed code (|c| * sign(a, c), pairs <=
 *       2*128*127 = 32512), which is sum(c * a) directly: no zero-point term at all, so no large
 *       offset products cancel in float (the generic tier's 128-offset form rounds differently
 *       once the partial sums pass 2^24 units; this form is the exact one).
 *   q2c: per-block table levels up to 255: split U = (U & 0x7f) + (U & 0x80), two vpmaddubsw
 *       (pairs <= 32258 and <= 32512), summed in int32.
 * So isum_c = sum_i U_i a_i is exact, identical to the generic tier. Decode (T == 1) is fused, two
 * rows per iteration sharing the activation loads; T > 1 unpacks a tile of 4 rows once into u8
 * levels and reuses it for every token. */
#include <immintrin.h>
#include <string.h>

#include "mq_kern.h"
#include "kern_avx2.h"


static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* ------------------------------------------------------------------ activations */
void mq_quantize_act_avx2(const float *x, int K, int kp, int8_t *q, float *d, float *s) {
    const __m256 sgn = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int c = 0; c < kp / 32; c++) {
        int k0 = c * 32, n = K - k0;
        if (n <= 0) { memset(q + k0, 0, 32); d[c] = 0.0f; s[c] = 0.0f; continue; }
        __m256 v[4];
        if (n >= 32) {
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + k0 + 8 * i);
        } else {
            for (int i = 0; i < 4; i++) {
                int r = n - 8 * i;
                r = r < 0 ? 0 : (r > 8 ? 8 : r);
                __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                v[i] = _mm256_maskload_ps(x + k0 + 8 * i, m);
            }
        }
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sgn), _mm256_and_ps(v[1], sgn)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], sgn), _mm256_and_ps(v[3], sgn)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vid)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vid)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vid));
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + k0), _mm256_permutevar8x32_epi32(b, perm));
        __m256i sm = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        int sum = _mm_cvtsi128_si32(s4);
        d[c] = dd; s[c] = dd * (float)sum;
    }
}

/* ------------------------------------------------------------------ unpack one chunk */
typedef struct {
    __m256i tab;      /* q3p levels in both 128-bit lanes */
    __m256i bsh, bsel; /* bit expansion: byte i <- byte i/8 of a dword, select bit i%8 */
    __m256i t3x[2];   /* q3x: the level tables of q3x_lv (Q3X_LO, Q3X_T013) */
    float q5_lo, q5_step;
} ctx_t;

/* 32 bits -> 32 bytes 0xff / 0x00 */
static inline __m256i bits32(const ctx_t *cx, uint32_t hb) {
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)hb), cx->bsh);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, cx->bsel), cx->bsel);
}

/* q3p (pack3c): 32 codes in 12 bytes, code i at bits 3i..3i+2. The 16 bytes from 4 before the
 * chunk (inside its block) in both lanes; vpshufb gives each code its 16-bit window as a word, vpmullw
 * by 2^(13 - shift) moves the code to bits 13-15, vpsrlw 13 and one vpackuswb (the two word vectors
 * hold codes 0-7 | 16-23 and 8-15 | 24-31, so the pack comes out in order) */
static const uint8_t Q3C_SHUF[2][32] = {{4,5,4,5,4,5,5,6,5,6,5,6,6,7,6,7,10,11,10,11,10,11,11,12,11,12,11,12,12,13,12,13}, {7,8,7,8,7,8,8,9,8,9,8,9,9,10,9,10,13,14,13,14,13,14,14,15,14,15,14,15,15,128,15,128}};
static const uint16_t Q3C_MUL[2][16] = {{8192,1024,128,4096,512,64,2048,256,8192,1024,128,4096,512,64,2048,256}, {8192,1024,128,4096,512,64,2048,256,8192,1024,128,4096,512,64,2048,256}};
static inline __attribute__((always_inline)) __m256i q3c_codes(const uint8_t *p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p - 4)));
    __m256i a = _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)Q3C_SHUF[0])),
                                   _mm256_loadu_si256((const __m256i *)Q3C_MUL[0]));
    __m256i b = _mm256_mullo_epi16(_mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)Q3C_SHUF[1])),
                                   _mm256_loadu_si256((const __m256i *)Q3C_MUL[1]));
    return _mm256_packus_epi16(_mm256_srli_epi16(a, 13), _mm256_srli_epi16(b, 13));
}

/* chunk c of a row -> u8 levels U (q8: the signed codes, see cdot), *dw, *mm (= m - off*dw) */
static inline __attribute__((always_inline)) __m256i
unpack_chunk(const ctx_t *cx, const int fmt, const uint8_t *row, int c, float *dw, float *mm) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    const __m256i sh2 = _mm256_setr_epi64x(0, 2, 4, 6), sh4 = _mm256_setr_epi64x(0, 0, 4, 4);
    switch (fmt) {
    case MQ_Q8: {
        const uint8_t *A = row + (size_t)c * MQ_Q8_BLOCK;
        float d = h2f(A);
        *dw = d; *mm = 0.0f;   /* cdot already gives sum(c * a) for signed codes: no offset */
        return _mm256_loadu_si256((const __m256i *)(A + MQ_Q8_HEADER));
    }
    case MQ_Q6: {
        const uint8_t *A = row + (size_t)c * MQ_Q6_BLOCK;
        float d = h2f(A);
        *dw = d; *mm = -32.0f * d;
        __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(A + MQ_Q6_HEADER)));
        lo = _mm256_and_si256(_mm256_srlv_epi64(lo, sh4), m15);
        __m256i hi = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)rd64(A + MQ_Q6_HEADER + MQ_PACK6_HI)), sh2), m3);
        return _mm256_or_si256(lo, _mm256_slli_epi64(hi, 4));
    }
    case MQ_Q4: {
        const uint8_t *A = row + (size_t)c * MQ_Q4_BLOCK;
        *dw = h2f(A + MQ_HDR_D); *mm = h2f(A + MQ_HDR_M);
        __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(A + MQ_Q4_HEADER)));
        return _mm256_and_si256(_mm256_srlv_epi64(lo, sh4), m15);
    }
    case MQ_Q5G: {
        const uint8_t *A = row + (size_t)c * MQ_Q5G_BLOCK;
        *dw = cx->q5_step; *mm = cx->q5_lo;
        __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)A));
        lo = _mm256_and_si256(_mm256_srlv_epi64(lo, sh4), m15);
        return _mm256_or_si256(lo, _mm256_and_si256(bits32(cx, rd32(A + MQ_PACK5_HI)), _mm256_set1_epi8(16)));
    }
    case MQ_Q3U:
    case MQ_Q3P: {
        const uint8_t *blk = row + (size_t)(c >> 1) * MQ_Q3_BLOCK, *p = blk + MQ_Q3_HEADER + MQ_CHUNK_BYTES(MQ_Q3_BITS) * (c & 1);
        *dw = h2f(blk + MQ_HDR_D); *mm = h2f(blk + MQ_HDR_M);
        if (fmt == MQ_Q3P) return _mm256_shuffle_epi8(cx->tab, q3c_codes(p));
        __m256i h = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)rd64(p)), sh2), m3);
        return _mm256_or_si256(h, _mm256_and_si256(bits32(cx, rd32(p + MQ_PACK3_HI)), _mm256_set1_epi8(4)));
    }
    case MQ_Q2C: {
        const uint8_t *blk = row + (size_t)(c >> 2) * MQ_Q2C_BLOCK, *p = blk + MQ_Q2C_HEADER + MQ_CHUNK_BYTES(MQ_Q2C_BITS) * (c & 3);
        *dw = h2f(blk + MQ_HDR_D); *mm = h2f(blk + MQ_HDR_M);
        __m256i h = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)rd64(p)), sh2), m3);
        return _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(blk + MQ_Q2C_LUT)), h);
    }
    /* a new row format: its case above (docs/architecture.md, "Adding a format") */
    default:   /* a listed format without its unpack: NaN products, loud, never silent */
        *dw = *mm = __builtin_nanf("");
        return _mm256_setzero_si256();
    }
}

/* int32 lanes whose sum is sum_i U_i a_i (q8: sum_i c_i a_i with the signed codes) */
static inline __attribute__((always_inline)) __m256i cdot(const int fmt, __m256i u, __m256i a) {
    const __m256i one = _mm256_set1_epi16(1);
    if (fmt == MQ_Q8)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(a, u)), one);
    if (fmt == MQ_Q2C) {
        const __m256i hb = _mm256_set1_epi8((char)0x80);
        __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_andnot_si256(hb, u), a), one);
        __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(hb, u), a), one);
        return _mm256_add_epi32(lo, hi);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), one);
}

/* ------------------------------------------------------------------ decode: fused, 2 rows at once */
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#ifndef PF_BYTES
#define PF_BYTES 1536
#endif
#ifndef PF_SHORT_ROW
#define PF_SHORT_ROW 2048   /* rows up to this many bytes keep the whole-rows-ahead prefetch */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0   /* the decode prefetch level */
#endif
static inline __attribute__((always_inline)) void
mv_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const int8_t *q = j->a->q;
    const float *xd = j->a->d, *xs = j->a->s;
    const int nc = j->nc;
    const uint8_t *end = j->w + (size_t)j->N * j->row_bytes;
    const size_t rb = j->row_bytes, pd = rb < PF_BYTES ? rb : PF_BYTES;
    int n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint8_t *r0 = j->w + (size_t)n * rb, *r1 = r0 + rb;
        /* short rows: PF_ROWS rows ahead; long rows: each row stream pd bytes ahead inside the chunk
         * loop, past the row's end into the same row of the next pair (rows ahead would overflow L1
         * next to the activations: see docs/kernels.md, "Lessons measured") */
        if (rb <= PF_SHORT_ROW && r0 + PF_ROWS * rb + 2 * rb <= end)
            for (size_t o = 0; o < 2 * rb; o += 64) _mm_prefetch((const char *)r0 + PF_ROWS * rb + o, PF_HINT);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        float am0 = 0.0f, am1 = 0.0f;
        size_t po = pd, pstep = rb / (size_t)nc;
        for (int c = 0; c < nc; c++, po += pstep) {
            if (rb > PF_SHORT_ROW && (pstep >= 32 || (c & 1) == 0)) {
                size_t o = po < rb ? po : po - rb + 2 * rb;
                _mm_prefetch((const char *)r0 + o, PF_HINT);
                _mm_prefetch((const char *)r1 + o, PF_HINT);
            }
            float d0, m0, d1, m1;
            __m256i u0 = unpack_chunk(cx, fmt, r0, c, &d0, &m0);
            __m256i u1 = unpack_chunk(cx, fmt, r1, c, &d1, &m1);
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i i0 = cdot(fmt, u0, a), i1 = cdot(fmt, u1, a);
            float dx = xd[c], sx = xs[c];
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d0 * dx), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d1 * dx), acc1);
            am0 += m0 * sx; am1 += m1 * sx;
        }
        j->y[n] = hsum8(acc0) + am0;
        j->y[n + 1] = hsum8(acc1) + am1;
    }
    for (; n < n1; n++) {
        const uint8_t *r0 = j->w + (size_t)n * j->row_bytes;
        __m256 acc0 = _mm256_setzero_ps();
        float am0 = 0.0f;
        for (int c = 0; c < nc; c++) {
            float d0, m0;
            __m256i u0 = unpack_chunk(cx, fmt, r0, c, &d0, &m0);
            __m256i i0 = cdot(fmt, u0, _mm256_loadu_si256((const __m256i *)(q + 32 * c)));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d0 * xd[c]), acc0);
            am0 += m0 * xs[c];
        }
        j->y[n] = hsum8(acc0) + am0;
    }
}

/* ------------------------------------------------------------------ prefill: unpacked row tiles */
#define TR 4
static inline __attribute__((always_inline)) void
mm_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1) {
    const mq_act *a = j->a;
    const int nc = j->nc;
    /* per tile row: nc x 32 levels, nc dw, nc mm */
    uint8_t *buf = (uint8_t *)mq_scratch((size_t)TR * nc * 40 + 64);
    __m256i *lv = (__m256i *)buf;
    float *dwv = (float *)(buf + (size_t)TR * nc * 32), *mmv = dwv + (size_t)TR * nc;
    for (int nt = n0; nt < n1; nt += TR) {
        int nr = n1 - nt < TR ? n1 - nt : TR;
        for (int r = 0; r < nr; r++) {
            const uint8_t *row = j->w + (size_t)(nt + r) * j->row_bytes;
            for (int c = 0; c < nc; c++)
                lv[r * nc + c] = unpack_chunk(cx, fmt, row, c, &dwv[r * nc + c], &mmv[r * nc + c]);
        }
        for (int t = 0; t < j->T; t++) {
            const int8_t *q = a->q + (size_t)t * a->kp;
            const float *xd = a->d + (size_t)t * a->ncp, *xs = a->s + (size_t)t * a->ncp;
            float *y = j->y + (size_t)t * j->ldy + nt;
            if (nr == TR) {
                __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                const __m256i *l0 = lv, *l1 = lv + nc, *l2 = lv + 2 * nc, *l3 = lv + 3 * nc;
                const float *w0 = dwv, *w1 = dwv + nc, *w2 = dwv + 2 * nc, *w3 = dwv + 3 * nc;
                const float *m0 = mmv, *m1 = mmv + nc, *m2 = mmv + 2 * nc, *m3 = mmv + 3 * nc;
                for (int c = 0; c < nc; c++) {
                    __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                    __m256i i0 = cdot(fmt, l0[c], xq), i1 = cdot(fmt, l1[c], xq);
                    __m256i i2 = cdot(fmt, l2[c], xq), i3 = cdot(fmt, l3[c], xq);
                    float dx = xd[c], sx = xs[c];
                    c0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(w0[c] * dx), c0);
                    c1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(w1[c] * dx), c1);
                    c2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_set1_ps(w2[c] * dx), c2);
                    c3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i3), _mm256_set1_ps(w3[c] * dx), c3);
                    s0 += m0[c] * sx; s1 += m1[c] * sx; s2 += m2[c] * sx; s3 += m3[c] * sx;
                }
                y[0] = hsum8(c0) + s0; y[1] = hsum8(c1) + s1; y[2] = hsum8(c2) + s2; y[3] = hsum8(c3) + s3;
            } else {
                for (int r = 0; r < nr; r++) {
                    __m256 c0 = _mm256_setzero_ps();
                    float s0 = 0.0f;
                    for (int c = 0; c < nc; c++) {
                        __m256i i0 = cdot(fmt, lv[r * nc + c], _mm256_loadu_si256((const __m256i *)(q + 32 * c)));
                        c0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(dwv[r * nc + c] * xd[c]), c0);
                        s0 += mmv[r * nc + c] * xs[c];
                    }
                    y[r] = hsum8(c0) + s0;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ float weights */
static float dot_ps(const float *w, const float *x, int K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float r = hsum8(_mm256_add_ps(a0, a1));
    for (; k < K; k++) r += w[k] * x[k];
    return r;
}

static void load_row_f32(const mq_mm_job *j, int n, float *out) {
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    int k = 0;
    if (j->fmt == MQ_F16) {
        for (; k + 8 <= j->K; k += 8) _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))));
        for (; k < j->K; k++) out[k] = h2f(row + 2 * k);
    } else {
        for (; k + 8 <= j->K; k += 8)
            _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * k))), 16)));
        for (; k < j->K; k++) out[k] = mq_bf16_to_f32(rd16(row + 2 * k));
    }
}

static void mm_float(const mq_mm_job *j, int n0, int n1) {
    float *wf = (float *)mq_scratch((size_t)j->K * 4 + 64);
    for (int n = n0; n < n1; n++) {
        const float *wr;
        if (j->fmt == MQ_F32) wr = (const float *)(j->w + (size_t)n * j->row_bytes);
        else { load_row_f32(j, n, wf); wr = wf; }
        for (int t = 0; t < j->T; t++) j->y[(size_t)t * j->ldy + n] = dot_ps(wr, j->x + (size_t)t * j->ldx, j->K);
    }
}

/* ------------------------------------------------------------------ decode of the row-interleaved formats
 * q4x / q6x / q3x (mq_format.h): a 64-byte word vector of a group is two ymm, rows 0-7 and 8-15; lanes
 * are rows, so the u8 levels of 4 codes meet the broadcast activation bytes k..k+3 in one vpmaddubsw
 * and the pairs are summed per row by vpmaddwd(ones) (int16 bounds: q4x sums 8 products of levels
 * <= 15 before vpmaddwd, 8 x 2 x 15 x 127 = 30480; q6x 2 of levels <= 63, 32004; q3x one of levels
 * <= 127, 32258). */
static inline __m256i bc32(const uint32_t *x, int i) { return _mm256_set1_epi32((int)x[i]); }

/* level vector of q6x step w (0..7) of half h of a chunk: low 4 bits from word w & 3 (nibble w >> 2),
 * top 2 bits from high word w & 1, field w >> 1, moved to bits 4-5 */
static inline __attribute__((always_inline)) __m256i q6x_lv(const uint8_t *b, int h, int w, const __m256i *hw) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + MQ_Q6X_LO + 64 * (w & 3) + 32 * h));
    const __m256i lo = w < 4 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m256i hv = hw[w & 1];
    const int f = w >> 1;
    const __m256i hs = f == 0 ? _mm256_slli_epi16(hv, 4) : f == 1 ? _mm256_slli_epi16(hv, 2) : f == 2 ? hv : _mm256_srli_epi16(hv, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hs, m30));
}

static void mv_q4x(const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < j->nc; c++, b += MQ_Q4X_CHUNK) {
            const uint32_t *xc = x32 + 8 * c;
            for (int h = 0; h < 2; h++) {
                __m256i i16 = _mm256_setzero_si256();
                for (int s = 0; s < 4; s++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + MQ_Q4X_CODES + 64 * s + 32 * h));
                    i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(_mm256_and_si256(v, m4), bc32(xc, s)));
                    i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), bc32(xc, 4 + s)));
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16, ones)), _mm256_mul_ps(d, _mm256_set1_ps(dx[c])), acc[h]);
                accm[h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[c]), accm[h]);
            }
        }
        _mm256_storeu_ps(j->y + g0, _mm256_add_ps(acc[0], accm[0]));
        _mm256_storeu_ps(j->y + g0 + 8, _mm256_add_ps(acc[1], accm[1]));
    }
}

static void mv_q6x(const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < j->nc; c++, b += MQ_Q6X_CHUNK) {
            const uint32_t *xc = x32 + 8 * c;
            for (int h = 0; h < 2; h++) {
                const __m256i hw[2] = {_mm256_loadu_si256((const __m256i *)(b + MQ_Q6X_HI + 32 * h)),
                                       _mm256_loadu_si256((const __m256i *)(b + MQ_Q6X_HI + 64 + 32 * h))};
                __m256i i32 = _mm256_setzero_si256();
                for (int s = 0; s < 8; s += 2) {
                    __m256i i16 = _mm256_setzero_si256();
                    for (int t = s; t < s + 2; t++)   /* levels lo4 | hi2 << 4 (mv_q6x of the AVX-512 tier) */
                        i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(q6x_lv(b, h, t, hw), bc32(xc, t)));
                    i32 = _mm256_add_epi32(i32, _mm256_madd_epi16(i16, ones));
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_mul_ps(d, _mm256_set1_ps(dx[c])), acc[h]);
                accm[h] = _mm256_fmadd_ps(d, _mm256_set1_ps(-32.0f * sx[c]), accm[h]);
            }
        }
        _mm256_storeu_ps(j->y + g0, _mm256_add_ps(acc[0], accm[0]));
        _mm256_storeu_ps(j->y + g0 + 8, _mm256_add_ps(acc[1], accm[1]));
    }
}

/* q3x (mq_format.h, .mxq version 5) on a block half (rows 8h .. 8h + 7: 32 bytes of each code plane).
 * vpshufb reads index bits 0-3 and zeroes the lane on bit 7, so every index is masked: step 2w is
 * plane w & 7, step 2w + 1 is (plane w >> 3) & 7, both through the table of the level of bits 0-2
 * (Q3X_LO); step 12 + w is bits 6-7 of plane w at bits 0-1, or'ed with bit 6 / 7 of plane 4 + (w >> 1)
 * moved to bit 2 / 3 (one shift shared by two steps), through Q3X_LO or the table of bits 0, 1, 3
 * (Q3X_T013). 2, 3 or ~5 operations per step (version 4's planes: 7). */
enum { Q3X_LO, Q3X_T013, Q3X_NT };
_Static_assert(Q3X_NT == sizeof(((ctx_t *)0)->t3x) / sizeof(__m256i), "ctx_t.t3x holds every q3x table");

static void q3x_tables(__m256i *t, const uint8_t *levels) {
    uint8_t b[Q3X_NT][16];
    for (int e = 0; e < 16; e++) {
        b[Q3X_LO][e] = levels[e & 7];
        b[Q3X_T013][e] = levels[(e & 3) | (((e >> 3) & 1) << 2)];
    }
    for (int n = 0; n < Q3X_NT; n++) t[n] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b[n]));
}

/* half h of a q3x block: its code planes start at q (plane w at q + 64 w), and h4 = planes 4, 5
 * shifted right by 4 (the bit 2 of steps 12-15 at bits 2, 3) */
static inline __attribute__((always_inline)) const uint8_t *q3x_half(const uint8_t *b, int h, __m256i h4[2]) {
    const uint8_t *q = b + MQ_Q3X_CODES + 32 * h;
    h4[0] = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(q + 256)), 4);
    h4[1] = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(q + 320)), 4);
    return q;
}

/* level vector of q3x step i (0..15) of the half at q: each step loads its plane (an L1 hit, shared
 * by steps 2w and 2w + 1 once unrolled) rather than keeping six planes live in 16 ymm registers */
static inline __attribute__((always_inline)) __m256i q3x_lv(const ctx_t *cx, const uint8_t *q, const __m256i *h4, int i) {
    if (i < 12) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(q + 64 * (i >> 1)));
        const __m256i v = (i & 1) ? _mm256_srli_epi16(p, 3) : p;
        return _mm256_shuffle_epi8(cx->t3x[Q3X_LO], _mm256_and_si256(v, _mm256_set1_epi8(7)));
    }
    const int w = i - 12;
    const __m256i p = _mm256_loadu_si256((const __m256i *)(q + 64 * w));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(p, 6), _mm256_set1_epi8(3));
    const __m256i hi = _mm256_and_si256(h4[w >> 1], _mm256_set1_epi8((char)((w & 1) ? 8 : 4)));
    return _mm256_shuffle_epi8(cx->t3x[(w & 1) ? Q3X_T013 : Q3X_LO], _mm256_or_si256(lo, hi));
}

static void mv_q3x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const uint32_t *x32 = (const uint32_t *)j->a->q;
    const float *dx = j->a->d, *sx = j->a->s;
    const __m256i ones = _mm256_set1_epi16(1);
    const int nb = j->nc / 2;
    const uint8_t *end = j->w + (size_t)n1 * j->row_bytes;
    const size_t pfd = mq_q3x_prefetch();   /* as the AVX-512 mv_q3x: into L2, 16 KiB ahead by default */
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS) {
        const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int bi = 0; bi < nb; bi++, b += MQ_Q3X_BLOCK) {
            if (pfd && b + pfd + MQ_Q3X_BLOCK <= end)
                for (int o = 0; o < MQ_Q3X_BLOCK; o += 64) _mm_prefetch((const char *)b + pfd + o, _MM_HINT_T1);
            const uint32_t *xc = x32 + 16 * bi;
            for (int h = 0; h < 2; h++) {
                __m256i h4[2], ia = _mm256_setzero_si256(), ib = _mm256_setzero_si256();
                const uint8_t *q = q3x_half(b, h, h4);
                _Pragma("GCC unroll 16")   /* constant steps */
                for (int i = 0; i < 16; i++) {   /* steps 0-7: chunk 2 bi, 8-15: chunk 2 bi + 1 */
                    const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(q3x_lv(cx, q, h4, i), bc32(xc, i)), ones);
                    if (i < 8) ia = _mm256_add_epi32(ia, pr); else ib = _mm256_add_epi32(ib, pr);
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(d, _mm256_set1_ps(dx[2 * bi])), acc[h]);
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(d, _mm256_set1_ps(dx[2 * bi + 1])), acc[h]);
                accm[h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[2 * bi] + sx[2 * bi + 1]), accm[h]);
            }
        }
        _mm256_storeu_ps(j->y + g0, _mm256_add_ps(acc[0], accm[0]));
        _mm256_storeu_ps(j->y + g0 + 8, _mm256_add_ps(acc[1], accm[1]));
    }
}

/* ------------------------------------------------------------------ T >= 2 on the interleaved formats
 * (prefill, batched decode): per half group (8 rows, lanes are rows) the decode kernels' unpack of a
 * step feeds up to MX_T tokens' vpmaddubsw, and each token gets the decode kernel's float fold in its
 * order, so every row is bit for bit the T = 1 row (test). The groups used to be gathered back into
 * q4 / q6 / q3p rows for the row GEMM (mm_fmt: a horizontal sum per row and token, the unpack per
 * 4-row tile). */
#define MX_T 4
typedef struct { const uint32_t *x32; const float *dx, *sx; float *y; } mx_tok;

static inline __attribute__((always_inline)) void mx_toks(const mq_mm_job *j, int t0, const int nt, mx_tok *tk) {
    const mq_act *a = j->a;
    for (int t = 0; t < nt; t++) {
        tk[t].x32 = (const uint32_t *)(a->q + (size_t)(t0 + t) * a->kp);
        tk[t].dx = a->d + (size_t)(t0 + t) * a->ncp; tk[t].sx = a->s + (size_t)(t0 + t) * a->ncp;
        tk[t].y = j->y + (size_t)(t0 + t) * j->ldy;
    }
}

/* one unit of a half group (q4x / q6x: a chunk, q3x: a block) for nt tokens: the decode kernel's
 * steps (mv_q4x / mv_q6x / mv_q3x), each unpacked step feeding every token, then its float fold */
static inline __attribute__((always_inline)) void
mx_unit(const ctx_t *cx, const int fmt, const uint8_t *b, int u, int h, const mx_tok *tk, const int nt, __m256 *acc, __m256 *accm) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    if (fmt == MQ_Q4X) {
        __m256i i16[MX_T];
        for (int t = 0; t < nt; t++) i16[t] = _mm256_setzero_si256();
        for (int s = 0; s < 4; s++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + MQ_Q4X_CODES + 64 * s + 32 * h));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            for (int t = 0; t < nt; t++) {
                const uint32_t *xc = tk[t].x32 + 8 * u;
                i16[t] = _mm256_add_epi16(i16[t], _mm256_maddubs_epi16(lo, bc32(xc, s)));
                i16[t] = _mm256_add_epi16(i16[t], _mm256_maddubs_epi16(hi, bc32(xc, 4 + s)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
        for (int t = 0; t < nt; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t], ones)), _mm256_mul_ps(d, _mm256_set1_ps(tk[t].dx[u])), acc[t]);
            accm[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(tk[t].sx[u]), accm[t]);
        }
    } else if (fmt == MQ_Q6X) {
        const __m256i hw[2] = {_mm256_loadu_si256((const __m256i *)(b + MQ_Q6X_HI + 32 * h)),
                               _mm256_loadu_si256((const __m256i *)(b + MQ_Q6X_HI + 64 + 32 * h))};
        __m256i i32[MX_T];
        for (int t = 0; t < nt; t++) i32[t] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s += 2) {   /* step pairs: int16 bound */
            __m256i i16[MX_T];
            for (int t = 0; t < nt; t++) i16[t] = _mm256_setzero_si256();
            for (int w = s; w < s + 2; w++) {
                const __m256i lv = q6x_lv(b, h, w, hw);
                for (int t = 0; t < nt; t++)
                    i16[t] = _mm256_add_epi16(i16[t], _mm256_maddubs_epi16(lv, bc32(tk[t].x32 + 8 * u, w)));
            }
            for (int t = 0; t < nt; t++) i32[t] = _mm256_add_epi32(i32[t], _mm256_madd_epi16(i16[t], ones));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
        for (int t = 0; t < nt; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[t]), _mm256_mul_ps(d, _mm256_set1_ps(tk[t].dx[u])), acc[t]);
            accm[t] = _mm256_fmadd_ps(d, _mm256_set1_ps(-32.0f * tk[t].sx[u]), accm[t]);
        }
    } else {   /* q3x block u: activation chunks 2u, 2u + 1 */
        __m256i h4[2], ia[MX_T], ib[MX_T];
        for (int t = 0; t < nt; t++) ia[t] = ib[t] = _mm256_setzero_si256();
        const uint8_t *q = q3x_half(b, h, h4);
        _Pragma("GCC unroll 16")
        for (int i = 0; i < 16; i++) {
            const __m256i lv = q3x_lv(cx, q, h4, i);
            for (int t = 0; t < nt; t++) {
                const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(lv, bc32(tk[t].x32 + 16 * u, i)), ones);
                if (i < 8) ia[t] = _mm256_add_epi32(ia[t], pr); else ib[t] = _mm256_add_epi32(ib[t], pr);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
        for (int t = 0; t < nt; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), _mm256_mul_ps(d, _mm256_set1_ps(tk[t].dx[2 * u])), acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib[t]), _mm256_mul_ps(d, _mm256_set1_ps(tk[t].dx[2 * u + 1])), acc[t]);
            accm[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(tk[t].sx[2 * u] + tk[t].sx[2 * u + 1]), accm[t]);
        }
    }
}

static inline __attribute__((always_inline)) void
mx_fmt(const ctx_t *cx, const int fmt, const mq_mm_job *j, int n0, int n1, int t0, const int nt) {
    mx_tok tk[MX_T];
    mx_toks(j, t0, nt, tk);
    const int units = fmt == MQ_Q3X ? j->nc / 2 : j->nc;
    const size_t ub = fmt == MQ_Q4X ? MQ_Q4X_CHUNK : fmt == MQ_Q6X ? MQ_Q6X_CHUNK : MQ_Q3X_BLOCK;
    for (int g0 = n0; g0 < n1; g0 += MQ_XROWS)
        for (int h = 0; h < 2; h++) {
            const uint8_t *b = j->w + (size_t)g0 * j->row_bytes;
            __m256 acc[MX_T], accm[MX_T];
            for (int t = 0; t < nt; t++) acc[t] = accm[t] = _mm256_setzero_ps();
            for (int u = 0; u < units; u++, b += ub) mx_unit(cx, fmt, b, u, h, tk, nt, acc, accm);
            for (int t = 0; t < nt; t++) _mm256_storeu_ps(tk[t].y + g0 + 8 * h, _mm256_add_ps(acc[t], accm[t]));
        }
}

/* q4x / q6x / q3x, T >= 2: MX_T tokens at a time, the token count a constant per call */
#define MX_RUN(name, F) \
    static void mx_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { \
        for (int t0 = 0; t0 < j->T; t0 += MX_T) { \
            switch (j->T - t0) { \
            case 1: mx_fmt(cx, F, j, n0, n1, t0, 1); break; \
            case 2: mx_fmt(cx, F, j, n0, n1, t0, 2); break; \
            case 3: mx_fmt(cx, F, j, n0, n1, t0, 3); break; \
            default: mx_fmt(cx, F, j, n0, n1, t0, 4); break; \
            } \
        } \
    }
MX_RUN(q4x, MQ_Q4X)
MX_RUN(q6x, MQ_Q6X)
MX_RUN(q3x, MQ_Q3X)
#undef MX_RUN

/* ------------------------------------------------------------------ the traits table
 * Each format's kernels of this tier: mv for T == 1, mm for T >= 2, the format a constant in each (the
 * kernel instantiated for it). The interleaved formats take whole groups only (mq_mm_rows sends the
 * rest through the gathering path). */
typedef void (*avx2_kern)(const ctx_t *cx, const mq_mm_job *j, int n0, int n1);
typedef struct {
    avx2_kern mv, mm;
    int q3x_tables;     /* the kernels read cx->t3x */
} avx2_traits;

#define ROW_ENTRIES(name, F) \
    static void mv_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mv_fmt(cx, F, j, n0, n1); } \
    static void mm_##name(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { mm_fmt(cx, F, j, n0, n1); }
MQ_FOR_ROW_FORMATS(ROW_ENTRIES)
#undef ROW_ENTRIES
static void mvx_q4x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { (void)cx; mv_q4x(j, n0, n1); }
static void mvx_q6x(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) { (void)cx; mv_q6x(j, n0, n1); }

#define ROW(name, F) [F] = {.mv = mv_##name, .mm = mm_##name},
static const avx2_traits AVX2_TRAITS[MQ_NFMT] = {
    MQ_FOR_ROW_FORMATS(ROW)
    [MQ_Q4X] = {.mv = mvx_q4x, .mm = mx_q4x},
    [MQ_Q6X] = {.mv = mvx_q6x, .mm = mx_q6x},
    [MQ_Q3X] = {.mv = mv_q3x, .mm = mx_q3x, .q3x_tables = 1},
    /* f32 / f16 / bf16: mm_float */
};
#undef ROW

void mq_mm_rows_avx2(const mq_mm_job *j, int n0, int n1) {
    if (j->fmt >= MQ_F32) { mm_float(j, n0, n1); return; }
    const avx2_traits *t = &AVX2_TRAITS[j->fmt];
    ctx_t cx;
    uint8_t t16[16] = {0};
    if (j->q3p_levels) memcpy(t16, j->q3p_levels, MQ_Q3P_NLEVELS);
    cx.tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t16));
    cx.bsh = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    cx.bsel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    cx.q5_lo = j->q5_lo; cx.q5_step = j->q5_step;
    if (t->q3x_tables) q3x_tables(cx.t3x, t16);
    (j->T == 1 ? t->mv : t->mm)(&cx, j, n0, n1);
}
