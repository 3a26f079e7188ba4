/* Float ops of a layer, written so that gcc vectorizes them without reassociating: the same source
 * is compiled per tier (misc.c, misc_avx2.c, misc_avx512.c) and gives bit-identical results in all
 * tiers. Include with MQ_SFX defined (function-name suffix). */
#include <math.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mq_format.h"   /* fp16 */
#include "misc.h"

#define MQ_CAT2(a, b) a##b
#define MQ_CAT(a, b) MQ_CAT2(a, b)
#define MQ_FN(name) MQ_CAT(name, MQ_SFX)

#define MQ_EXP_LO (-87.0f)
#define MQ_EXP_HI (88.0f)

/* exp on [MQ_EXP_LO, MQ_EXP_HI]: Cody-Waite reduction by ln2 + degree-6 polynomial (cephes expf),
 * scale 2^n built in the exponent bits. Max relative error ~2 ulp; out of range -> libm expf. */
static inline float MQ_FN(fexp_)(float x) {
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    uint32_t su = (uint32_t)((int32_t)n + 127) << 23;
    float sf;
    memcpy(&sf, &su, 4);
    return p * sf;
}

/* One vector of floats in the AVX2 / AVX-512 tiers (MQ_XV lanes), for the loops below that keep the
 * scalar code's operations per value (fast exp, block Hadamard); undefined in the generic tier. */
#if defined(__AVX512F__)
#define MQ_XV 16
typedef __m512 mq_xv;
#define MQ_X1(v) _mm512_set1_ps(v)
#define MQ_XMUL _mm512_mul_ps
#define MQ_XADD _mm512_add_ps
#define MQ_XSUB _mm512_sub_ps
#define MQ_XMAX _mm512_max_ps
#define MQ_XLOAD _mm512_loadu_ps
#define MQ_XSTORE _mm512_storeu_ps
#define MQ_XCLAMP(v) _mm512_min_ps(_mm512_max_ps(v, MQ_X1(MQ_EXP_LO)), MQ_X1(MQ_EXP_HI))
#define MQ_XROUND(v) _mm512_roundscale_ps(v, 0x0C)          /* nearbyint: current mode, no exception */
#define MQ_XSCALE(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23))
#elif defined(__AVX2__)
#define MQ_XV 8
typedef __m256 mq_xv;
#define MQ_X1(v) _mm256_set1_ps(v)
#define MQ_XMUL _mm256_mul_ps
#define MQ_XADD _mm256_add_ps
#define MQ_XSUB _mm256_sub_ps
#define MQ_XMAX _mm256_max_ps
#define MQ_XLOAD _mm256_loadu_ps
#define MQ_XSTORE _mm256_storeu_ps
#define MQ_XCLAMP(v) _mm256_min_ps(_mm256_max_ps(v, MQ_X1(MQ_EXP_LO)), MQ_X1(MQ_EXP_HI))
#define MQ_XROUND(v) _mm256_round_ps(v, 0x0C)
#define MQ_XSCALE(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23))
#endif

#if defined(MQ_XV)
/* fexp_ on a vector, operation for operation (the same bits per lane). Clamping by max / min differs
 * from fexp_'s callers only on NaN, whose lanes hexp_n_ recomputes with libm anyway. */
static inline __attribute__((always_inline)) mq_xv MQ_FN(fexp_v_)(mq_xv x) {
    const mq_xv n = MQ_XROUND(MQ_XMUL(x, MQ_X1(1.44269504088896341f)));
    mq_xv r = MQ_XSUB(x, MQ_XMUL(n, MQ_X1(0.693359375f)));
    r = MQ_XSUB(r, MQ_XMUL(n, MQ_X1(-2.12194440e-4f)));
    mq_xv p = MQ_X1(1.9875691500E-4f);
    p = MQ_XADD(MQ_XMUL(p, r), MQ_X1(1.3981999507E-3f));
    p = MQ_XADD(MQ_XMUL(p, r), MQ_X1(8.3334519073E-3f));
    p = MQ_XADD(MQ_XMUL(p, r), MQ_X1(4.1665795894E-2f));
    p = MQ_XADD(MQ_XMUL(p, r), MQ_X1(1.6666665459E-1f));
    p = MQ_XADD(MQ_XMUL(p, r), MQ_X1(5.0000001201E-1f));
    p = MQ_XADD(MQ_XADD(MQ_XMUL(p, MQ_XMUL(r, r)), r), MQ_X1(1.0f));
    return MQ_XMUL(p, MQ_XSCALE(n));
}
#endif

/* y[i] = hexp_(x[i] - sub) for n values, in two passes: the fast path on the input clamped to the
 * range (four vectors per step where the tier has them, else what gcc vectorizes), then libm expf for
 * the (rare) inputs outside it. Same values as hexp_ of the float difference. */
static void MQ_FN(hexp_n_)(const float *x, float *y, size_t n, float sub) {   /* y may alias x */
    float t[256];
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        size_t m = n - i0 < 256 ? n - i0 : 256;
        for (size_t i = 0; i < m; i++) t[i] = x[i0 + i] - sub;
        size_t i = 0;
#if defined(MQ_XV)
        /* four independent vectors per step: Horner's chain is latency-bound one vector at a time */
        for (; i + 4 * MQ_XV <= m; i += 4 * MQ_XV) {
            mq_xv e0 = MQ_FN(fexp_v_)(MQ_XCLAMP(MQ_XLOAD(t + i)));
            mq_xv e1 = MQ_FN(fexp_v_)(MQ_XCLAMP(MQ_XLOAD(t + i + MQ_XV)));
            mq_xv e2 = MQ_FN(fexp_v_)(MQ_XCLAMP(MQ_XLOAD(t + i + 2 * MQ_XV)));
            mq_xv e3 = MQ_FN(fexp_v_)(MQ_XCLAMP(MQ_XLOAD(t + i + 3 * MQ_XV)));
            MQ_XSTORE(y + i0 + i, e0);
            MQ_XSTORE(y + i0 + i + MQ_XV, e1);
            MQ_XSTORE(y + i0 + i + 2 * MQ_XV, e2);
            MQ_XSTORE(y + i0 + i + 3 * MQ_XV, e3);
        }
        for (; i + MQ_XV <= m; i += MQ_XV) MQ_XSTORE(y + i0 + i, MQ_FN(fexp_v_)(MQ_XCLAMP(MQ_XLOAD(t + i))));
#endif
        for (; i < m; i++) {
            float v = t[i];
            v = v < MQ_EXP_LO ? MQ_EXP_LO : v;
            v = v > MQ_EXP_HI ? MQ_EXP_HI : v;
            y[i0 + i] = MQ_FN(fexp_)(v);
        }
        int out = 0;
        for (size_t i = 0; i < m; i++) out |= ((t[i] >= MQ_EXP_LO) & (t[i] <= MQ_EXP_HI)) ^ 1;
        if (out)
            for (size_t i = 0; i < m; i++)
                if (!(t[i] >= MQ_EXP_LO && t[i] <= MQ_EXP_HI)) y[i0 + i] = expf(t[i]);
    }
}

static inline float MQ_FN(hexp_)(float x) {   /* hybrid: fast in range, exact outside */
    return (x >= MQ_EXP_LO && x <= MQ_EXP_HI) ? MQ_FN(fexp_)(x) : expf(x);
}

float MQ_FN(mq_expf_fast_)(float x) { return MQ_FN(hexp_)(x); }

void MQ_FN(mq_rmsnorm_)(const float *x, const float *w, float *y, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *yr = y + (size_t)t * D;
        double a[8] = {0};
        int i = 0;
        for (; i + 8 <= D; i += 8) for (int l = 0; l < 8; l++) a[l] += (double)xr[i + l] * xr[i + l];
        for (; i < D; i++) a[0] += (double)xr[i] * xr[i];
        double ss = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        float r = (float)(1.0 / sqrt(ss / D + (double)eps));
        for (i = 0; i < D; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

/* y[t, n] = sum_k w[n, k] x[t, k] for a router (a MoE's expert scores) in float32 with a fixed order:
 * lane l (l < 16) sums the rounded products of k = l mod 16 in order (the K % 16 tail into lane 0),
 * then the 16 lanes in a fixed tree. gcc vectorizes the lanes without reassociating and nothing is
 * contracted into an FMA (-ffp-contract=off), so every tier gives the same bits (the packed and float
 * matmul kernels fold in a tier's own order, and a router's top-k must not depend on the CPU).
 * The AVX2 / AVX-512 lanes are the same sums in ymm / zmm registers. */
static inline float MQ_FN(tree16_)(const float *a) {
    return (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])))
         + (((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15])));
}

/* the 16 lanes of one row: a[l] = sum over i of w[16 i + l] x[16 i + l], each product rounded, in order */
static inline void MQ_FN(lanes16_)(const float *w0, const float *xr, int k16, float *a) {
#if defined(__AVX512F__)
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < k16; i += 16) s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_loadu_ps(w0 + i), _mm512_loadu_ps(xr + i)));
    _mm512_storeu_ps(a, s);
#elif defined(__AVX2__)
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (int i = 0; i < k16; i += 16) {
        s0 = _mm256_add_ps(s0, _mm256_mul_ps(_mm256_loadu_ps(w0 + i), _mm256_loadu_ps(xr + i)));
        s1 = _mm256_add_ps(s1, _mm256_mul_ps(_mm256_loadu_ps(w0 + i + 8), _mm256_loadu_ps(xr + i + 8)));
    }
    _mm256_storeu_ps(a, s0); _mm256_storeu_ps(a + 8, s1);
#else
    for (int l = 0; l < 16; l++) a[l] = 0.0f;
    for (int i = 0; i < k16; i += 16)
        for (int l = 0; l < 16; l++) a[l] += w0[i + l] * xr[i + l];
#endif
}

void MQ_FN(mq_dot_rows_)(const float *w, const float *x, float *y, int N, int K, int T) {
    const int k16 = K / 16 * 16;
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        for (int n = 0; n < N; n++) {
            const float *w0 = w + (size_t)n * K;
            float a[16];
            MQ_FN(lanes16_)(w0, xr, k16, a);
            for (int i = k16; i < K; i++) a[0] += w0[i] * xr[i];
            y[(size_t)t * N + n] = MQ_FN(tree16_)(a);
        }
    }
}

void MQ_FN(mq_silu_mul_)(const float *g, const float *u, float *y, size_t n) {
    float ng[256], e[256];
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        size_t m = n - i0 < 256 ? n - i0 : 256;
        for (size_t i = 0; i < m; i++) ng[i] = -g[i0 + i];
        MQ_FN(hexp_n_)(ng, e, m, 0.0f);
        for (size_t i = 0; i < m; i++) y[i0 + i] = g[i0 + i] / (1.0f + e[i]) * u[i0 + i];
    }
}

/* Block Hadamard rotation of T rows of K values: y = H_b (s * x) per block of b values, H_b the
 * Sylvester Hadamard matrix scaled by 1/sqrt(b) (orthonormal and symmetric), s the +-1 signs (NULL:
 * none). Butterflies in a fixed order (stage h = 1, 2, 4, ..., b/2), each output an a+b or a-b of two
 * floats, then one multiply by the scale: no reassociation, so every tier gives the same bits.
 * b is a power of two <= 1024 dividing K (checked by the caller); y may alias x. */
#if defined(__AVX512F__)
/* one butterfly stage h < 16 inside a vector (stages 1, 2, 4, 8 run in a register): lane j pairs with
 * lane j^h. Lanes with bit h clear get v[j] + v[j^h] (= a + c), the others v[j^h] - v[j] (= a - c):
 * the scalar loop's operands, exactly. */
static inline __m512 MQ_FN(hstage_)(__m512 v, int h) {
    static const int masks[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), v);
    int k = h == 1 ? 0 : h == 2 ? 1 : h == 4 ? 2 : 3;
    return _mm512_mask_blend_ps((__mmask16)masks[k], _mm512_add_ps(v, p), _mm512_sub_ps(p, v));
}
#elif defined(__AVX2__)
static inline __m256 MQ_FN(hstage_)(__m256 v, int h) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 p = _mm256_permutevar8x32_ps(v, _mm256_xor_si256(lane, _mm256_set1_epi32(h)));
    __m256 s = _mm256_add_ps(v, p), d = _mm256_sub_ps(p, v);
    return h == 1 ? _mm256_blend_ps(s, d, 0xAA) : h == 2 ? _mm256_blend_ps(s, d, 0xCC) : _mm256_blend_ps(s, d, 0xF0);
}
#endif

void MQ_FN(mq_hadamard_)(const float *x, float *y, const float *s, int T, int K, int b, float scale) {
#if defined(MQ_XV)
    if (b >= 2 * MQ_XV && b <= 8 * MQ_XV) {
        /* a whole block in registers (2-8 vectors): signs, the in-vector stages of every vector (they
         * are independent, so their latency overlaps), the cross-vector stages, the scale; one load and
         * one store per value. The same operations per value as the passes below: the same bits. */
        const mq_xv sc = MQ_X1(scale);
        const int nv = b / MQ_XV;
        for (int t = 0; t < T; t++) {
            const float *xr = x + (size_t)t * K;
            float *yr = y + (size_t)t * K;
            for (int i0 = 0; i0 < K; i0 += b) {
                mq_xv r[8];
                for (int j = 0; j < nv; j++) {
                    r[j] = MQ_XLOAD(xr + i0 + j * MQ_XV);
                    if (s) r[j] = MQ_XMUL(r[j], MQ_XLOAD(s + i0 + j * MQ_XV));
                }
                for (int hh = 1; hh < MQ_XV; hh *= 2)
                    for (int j = 0; j < nv; j++) r[j] = MQ_FN(hstage_)(r[j], hh);
                for (int hv = 1; hv < nv; hv *= 2)          /* stage h = hv * MQ_XV: vector j with j + hv */
                    for (int j0 = 0; j0 < nv; j0 += 2 * hv)
                        for (int j = j0; j < j0 + hv; j++) {
                            const mq_xv a = r[j], c = r[j + hv];
                            r[j] = MQ_XADD(a, c);
                            r[j + hv] = MQ_XSUB(a, c);
                        }
                for (int j = 0; j < nv; j++) MQ_XSTORE(yr + i0 + j * MQ_XV, MQ_XMUL(r[j], sc));
            }
        }
        return;
    }
#endif
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        float *yr = y + (size_t)t * K;
        if (s) for (int i = 0; i < K; i++) yr[i] = xr[i] * s[i];
        else if (yr != xr) memcpy(yr, xr, (size_t)K * 4);
        for (int i0 = 0; i0 < K; i0 += b) {
            float *v = yr + i0;
            int h = 1;
#if defined(MQ_XV)
            if (b >= 2 * MQ_XV) {            /* the first log2(lanes) stages in registers */
                for (int j = 0; j < b; j += MQ_XV) {
                    mq_xv r = MQ_XLOAD(v + j);
                    for (int hh = 1; hh < MQ_XV; hh *= 2) r = MQ_FN(hstage_)(r, hh);
                    MQ_XSTORE(v + j, r);
                }
                for (h = MQ_XV; h < b; h *= 2)
                    for (int j0 = 0; j0 < b; j0 += 2 * h)
                        for (int j = j0; j < j0 + h; j += MQ_XV) {
                            mq_xv a = MQ_XLOAD(v + j), c = MQ_XLOAD(v + j + h);
                            MQ_XSTORE(v + j, MQ_XADD(a, c));
                            MQ_XSTORE(v + j + h, MQ_XSUB(a, c));
                        }
                continue;
            }
#endif
            if (b >= 8) {               /* stages 1, 2, 4 on registers: 8 values at a time */
                for (int j = 0; j < b; j += 8) {
                    float *u = v + j;
                    float a0 = u[0] + u[1], a1 = u[0] - u[1], a2 = u[2] + u[3], a3 = u[2] - u[3];
                    float a4 = u[4] + u[5], a5 = u[4] - u[5], a6 = u[6] + u[7], a7 = u[6] - u[7];
                    float c0 = a0 + a2, c2 = a0 - a2, c1 = a1 + a3, c3 = a1 - a3;
                    float c4 = a4 + a6, c6 = a4 - a6, c5 = a5 + a7, c7 = a5 - a7;
                    u[0] = c0 + c4; u[4] = c0 - c4; u[1] = c1 + c5; u[5] = c1 - c5;
                    u[2] = c2 + c6; u[6] = c2 - c6; u[3] = c3 + c7; u[7] = c3 - c7;
                }
                h = 8;
            }
            for (; h < b; h *= 2)
                for (int j0 = 0; j0 < b; j0 += 2 * h) {
                    float *p = v + j0, *q = v + j0 + h;
#pragma GCC ivdep
                    for (int j = 0; j < h; j++) {
                        float a = p[j], c = q[j];
                        p[j] = a + c;
                        q[j] = a - c;
                    }
                }
        }
        for (int i = 0; i < K; i++) yr[i] = yr[i] * scale;
    }
}

/* one row in place; returns nothing. fast=0 uses libm expf everywhere (the "exact" variant). */
static void MQ_FN(softmax_row_)(float *x, int n, int fast) {
    /* the max in 16 lanes (a vector max instead of a serial chain; the max is the same value in
     * any order, and a +-0 tie changes no exp below) */
    float m16[16], mx = -INFINITY;
    int i0 = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; i0 + 16 <= n; i0 += 16) mv = _mm512_max_ps(_mm512_loadu_ps(x + i0), mv);   /* x > m ? x : m */
    _mm512_storeu_ps(m16, mv);
#elif defined(__AVX2__)
    __m256 ma = _mm256_set1_ps(-INFINITY), mb = ma;
    for (; i0 + 16 <= n; i0 += 16) {
        ma = _mm256_max_ps(_mm256_loadu_ps(x + i0), ma);
        mb = _mm256_max_ps(_mm256_loadu_ps(x + i0 + 8), mb);
    }
    _mm256_storeu_ps(m16, ma);
    _mm256_storeu_ps(m16 + 8, mb);
#else
    for (int l = 0; l < 16; l++) m16[l] = -INFINITY;
    for (; i0 + 16 <= n; i0 += 16) for (int l = 0; l < 16; l++) m16[l] = x[i0 + l] > m16[l] ? x[i0 + l] : m16[l];
#endif
    for (; i0 < n; i0++) m16[0] = x[i0] > m16[0] ? x[i0] : m16[0];
    for (int l = 0; l < 16; l++) mx = m16[l] > mx ? m16[l] : mx;
    if (mx == -INFINITY) { for (int i = 0; i < n; i++) x[i] = 0.0f; return; }
    float sum[16] = {0};
    int i = 0;
    if (fast) {
        MQ_FN(hexp_n_)(x, x, (size_t)n, mx);
    } else {
        for (i = 0; i < n; i++) x[i] = expf(x[i] - mx);
    }
    for (i = 0; i + 16 <= n; i += 16) for (int l = 0; l < 16; l++) sum[l] += x[i + l];
    for (; i < n; i++) sum[0] += x[i];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += sum[l];
    float inv = 1.0f / s;
    for (i = 0; i < n; i++) x[i] *= inv;
}

void MQ_FN(mq_softmax_rows_)(float *x, int rows, int n, int fast) {
    for (int r = 0; r < rows; r++) MQ_FN(softmax_row_)(x + (size_t)r * n, n, fast);
}

/* rows [r0, r1) of scores [rows, n]: row r is query t = r % T at position pos0 + t; softmax over
 * its first min(n, pos0 + t + 1) keys, zeros after (causal mask without -inf). */
void MQ_FN(mq_softmax_causal_)(float *x, int n, int T, int pos0, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        int v = pos0 + r % T + 1;
        if (v > n) v = n;
        float *row = x + (size_t)r * n;
        MQ_FN(softmax_row_)(row, v, 1);
        for (int i = v; i < n; i++) row[i] = 0.0f;
    }
}

/* 16 lane partial sums (lane l: k = l mod 16, products then adds, no FMA), then a fixed tree
 * reduction. Written with intrinsics where the tier has them (gcc kept this loop scalar when
 * inlined in the attention loop), with the same per-lane operations, so every tier gives the
 * same bits. */
static inline float MQ_FN(dotf_)(const float *restrict a, const float *restrict b, int n) {
    int i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
    }
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#elif defined(__AVX2__)
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    if (i < n) {
        float t[16] = {0};
        for (int l = 0; l < n - i; l++) t[l] = a[i + l] * b[i + l];
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(t));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(t + 8));
    }
    __m256 h = _mm256_add_ps(lo, hi);
#endif
#if defined(__AVX2__)
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float r[4];
    _mm_storeu_ps(r, q);
    return (r[0] + r[2]) + (r[1] + r[3]);
#else
    float acc[16] = {0};
    for (; i + 16 <= n; i += 16) for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    if (i < n) {
        float t[16] = {0};
        for (int l = 0; l < n - i; l++) t[l] = a[i + l] * b[i + l];
        for (int l = 0; l < 16; l++) acc[l] += t[l];
    }
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
#endif
}

/* ---- grouped decode attention (AVX2 / AVX-512; att_grouped_ below). Per tier: MQ_ATT_KB keys per
 * score block, att_scores_ (the scaled scores of one head on one block: per key exactly dotf_'s
 * operations, then * scale) and att_pv_group_ (the value sums of a group's heads, o += p * v per key
 * in order, the sums in registers: the generic tier's operations). */
#if defined(__AVX512F__)
#define MQ_ATT_KB 16
static inline __attribute__((always_inline)) __m512 MQ_FN(att_ld_)(const void *base, int f16, size_t off) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    return _mm512_loadu_ps((const float *)base + off);
}

/* 16 dot accumulators -> lane i = the sum of a[i]'s 16 lanes, by dotf_'s tree for every one of them
 * (256-bit halves, 128-bit halves, then (r0 + r2) + (r1 + r3)): the same bits as 16 dotf_ calls */
static inline __attribute__((always_inline)) __m512 MQ_FN(att_red16_)(const __m512 *a) {
    __m512 h[8], q[4];
    for (int m = 0; m < 8; m++)     /* h[m] = [h(a[2m]) | h(a[2m+1])], h(x)[l] = x[l] + x[l + 8] */
        h[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++)     /* q[m] = [q(4m) | q(4m+1) | q(4m+2) | q(4m+3)], q(x)[l] = h(x)[l] + h(x)[l + 4] */
        q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* per 128-bit block j: [r(j), r(4+j), r(8+j), r(12+j)], r(x) = (x0 + x2) + (x1 + x3) */
    __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
    __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s, t, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(s, t, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

static inline __attribute__((always_inline)) void MQ_FN(att_scores_)(const float *qr, const void *k, int f16, size_t off, int Dh, float scale, float *out) {
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < Dh; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qr + c);
        for (int r = 0; r < 16; r++)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(qv, MQ_FN(att_ld_)(k, f16, off + (size_t)r * Dh + c)));
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(MQ_FN(att_red16_)(acc), _mm512_set1_ps(scale)));
}

/* The value sums of the G heads of one KV group (G <= MQ_ATT_GB) over keys [i0, n), columns
 * [16 c0, 16 (c0 + W)) of every head: W x G sums in registers, one pass over those columns of V. */
static inline __attribute__((always_inline)) void MQ_FN(att_pv_cols_)(const float *scratch, size_t rs, int G, const void *v, int f16,
                                                                    size_t kb, int i0, int n, int Dh, float *out, const int acc,
                                                                    int c0, const int W, const int HM) {
    __m512 o[MQ_ATT_GB][4];
    for (int j = 0; j < HM; j++)
        for (int c = 0; c < W; c++)
            o[j][c] = acc && j < G ? _mm512_loadu_ps(out + (size_t)j * Dh + 16 * (c0 + c)) : _mm512_setzero_ps();
    for (int i = i0; i < n; i++) {
        __m512 vr[4];
        for (int c = 0; c < W; c++) vr[c] = MQ_FN(att_ld_)(v, f16, kb + (size_t)i * Dh + 16 * (c0 + c));
        for (int j = 0; j < HM; j++) {
            if (j >= G) break;
            const __m512 p = _mm512_set1_ps(scratch[(size_t)j * rs + i]);
            for (int c = 0; c < W; c++) o[j][c] = _mm512_add_ps(o[j][c], _mm512_mul_ps(p, vr[c]));
        }
    }
    for (int j = 0; j < HM; j++) {
        if (j >= G) break;
        for (int c = 0; c < W; c++) _mm512_storeu_ps(out + (size_t)j * Dh + 16 * (c0 + c), o[j][c]);
    }
}

/* The value sums of a KV group's G heads over keys [i0, n) (acc: continued from out, else from zero):
 * all G heads against each V row, its columns in passes of 4 zmm (G <= 6) or 3 (G <= 8), so that
 * the sums stay in registers and V is read once per token whatever the group size (4 heads per
 * pass read it twice for Qwen2's 7 query heads per KV head, and head pairs 4x at Dh 128). Every
 * sum is the generic tier's: p x v, then +, in key order. */
static inline __attribute__((always_inline)) void MQ_FN(att_pv_group_)(const float *scratch, int S, int G, const void *v, int f16, size_t kb,
                                                                    int i0, int n, int Dh, float *out, const int acc) {
    const size_t rs = (size_t)S + 16;
    const int nc = Dh / 16;
    int c0 = 0;
    if (G <= 6) {
        for (; c0 + 4 <= nc; c0 += 4) MQ_FN(att_pv_cols_)(scratch, rs, G, v, f16, kb, i0, n, Dh, out, acc, c0, 4, 6);
    } else {
        for (; c0 + 3 <= nc; c0 += 3) MQ_FN(att_pv_cols_)(scratch, rs, G, v, f16, kb, i0, n, Dh, out, acc, c0, 3, MQ_ATT_GB);
    }
    switch (nc - c0) {
    case 3: MQ_FN(att_pv_cols_)(scratch, rs, G, v, f16, kb, i0, n, Dh, out, acc, c0, 3, MQ_ATT_GB); break;
    case 2: MQ_FN(att_pv_cols_)(scratch, rs, G, v, f16, kb, i0, n, Dh, out, acc, c0, 2, MQ_ATT_GB); break;
    case 1: MQ_FN(att_pv_cols_)(scratch, rs, G, v, f16, kb, i0, n, Dh, out, acc, c0, 1, MQ_ATT_GB); break;
    default: break;
    }
}
#elif defined(__AVX2__)
#define MQ_ATT_KB 4
static inline __attribute__((always_inline)) __m256 MQ_FN(att_ld_)(const void *base, int f16, size_t off) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
    return _mm256_loadu_ps((const float *)base + off);
}

/* 4 keys at once, dotf_'s AVX2 order for each: lo / hi 8-lane sums over the 16-wide chunks, lo + hi,
 * the 128-bit halves, then (r0 + r2) + (r1 + r3) */
static inline __attribute__((always_inline)) void MQ_FN(att_scores_)(const float *qr, const void *k, int f16, size_t off, int Dh, float scale, float *out) {
    __m256 lo[4], hi[4];
    for (int r = 0; r < 4; r++) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
    for (int c = 0; c < Dh; c += 16) {
        const __m256 ql = _mm256_loadu_ps(qr + c), qh = _mm256_loadu_ps(qr + c + 8);
        for (int r = 0; r < 4; r++) {
            lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(ql, MQ_FN(att_ld_)(k, f16, off + (size_t)r * Dh + c)));
            hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(qh, MQ_FN(att_ld_)(k, f16, off + (size_t)r * Dh + c + 8)));
        }
    }
    __m256 h[4];
    for (int r = 0; r < 4; r++) h[r] = _mm256_add_ps(lo[r], hi[r]);
    /* [q(h0) | q(h1)] and [q(h2) | q(h3)], q(x) = low 128 + high 128 */
    const __m256 q01 = _mm256_add_ps(_mm256_permute2f128_ps(h[0], h[1], 0x20), _mm256_permute2f128_ps(h[0], h[1], 0x31));
    const __m256 q23 = _mm256_add_ps(_mm256_permute2f128_ps(h[2], h[3], 0x20), _mm256_permute2f128_ps(h[2], h[3], 0x31));
    /* per 128-bit block [A0 + A2, B0 + B2, A1 + A3, B1 + B3], then lane 0 / 1: r(A), r(B) */
    const __m256 s = _mm256_add_ps(_mm256_unpacklo_ps(q01, q23), _mm256_unpackhi_ps(q01, q23));
    const __m256 r = _mm256_add_ps(s, _mm256_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m256 p = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));   /* keys 0..3 */
    _mm_storeu_ps(out, _mm_mul_ps(_mm256_castps256_ps128(p), _mm_set1_ps(scale)));
}

static inline __attribute__((always_inline)) void MQ_FN(att_pv_)(const float *sc, const void *v, int f16, size_t kb, int i0, int n, int Dh,
                                                                float *out, const int acc) {
    const int nc = Dh / 8;
    __m256 o[16];
    for (int c = 0; c < nc; c++) o[c] = acc ? _mm256_loadu_ps(out + 8 * c) : _mm256_setzero_ps();
    for (int i = i0; i < n; i++) {
        const __m256 p = _mm256_set1_ps(sc[i]);
        for (int c = 0; c < nc; c++) o[c] = _mm256_add_ps(o[c], _mm256_mul_ps(p, MQ_FN(att_ld_)(v, f16, kb + (size_t)i * Dh + 8 * c)));
    }
    for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + 8 * c, o[c]);
}

/* AVX2: head by head, each head's whole row of sums in registers (16 ymm). Sharing each V row
 * among the heads in column passes of 2 ymm, as the AVX-512 tier does, measured 0.67-0.78x of this
 * (a broadcast and a pass per column pair; docs/kernels.md "Where a 2-thread decode step goes"). */
static inline __attribute__((always_inline)) void MQ_FN(att_pv_group_)(const float *scratch, int S, int G, const void *v, int f16, size_t kb,
                                                                     int i0, int n, int Dh, float *out, const int acc) {
    for (int j = 0; j < G; j++)
        MQ_FN(att_pv_)(scratch + (size_t)j * ((size_t)S + 16), v, f16, kb, i0, n, Dh, out + (size_t)j * Dh, acc);
}
#endif

#if defined(MQ_ATT_KB)
#define MQ_ATT_MAXDH (MQ_ATT_KB == 16 ? 256 : 128)   /* the value sums of one head fit the registers */
/* The attention below for Dh a multiple of 16 (<= MQ_ATT_MAXDH), bit for bit: the query heads of one KV
 * group (MQ_ATT_GB at a time) share each block of MQ_ATT_KB keys of K while it sits in L1, and a
 * block's dot products are reduced together (att_scores_) instead of one horizontal sum per key; the
 * value sums stay in registers. A prompt (T > 1) runs in tiles of MQ_ATT_TP positions: each key block
 * serves every position of the tile, and the value sums run over MQ_ATT_PVC keys at a time for every
 * position, continued from out in key order, so K and V are read once per tile instead of once per
 * position, and every row keeps the single-position operations (the same bits). */
#define MQ_ATT_PVC 64
static inline __attribute__((always_inline)) void
MQ_FN(att_grouped_f_)(const float *q, const void *k, const void *v, const int f16, float *out, int T,
                      int Hq, int Hkv, const int Dh, int S, int pos0, int h0, int h1, float *scratch) {
    const int g = Hq / Hkv;
    const float scale = (float)(1.0 / sqrt((double)Dh));
    const size_t rs = (size_t)S + 16;                                   /* one row of scores */
    const int tp = T < MQ_ATT_TP ? T : MQ_ATT_TP;
    float *kr = scratch + (size_t)tp * MQ_ATT_GB * rs;
    for (int t0 = 0; t0 < T; t0 += MQ_ATT_TP) {
        const int tn = T - t0 < MQ_ATT_TP ? T - t0 : MQ_ATT_TP;
        int nmax = pos0 + t0 + tn;
        if (nmax > S) nmax = S;
        for (int hb = h0; hb < h1;) {
            const int kh = hb / g;
            int he = (kh + 1) * g;
            if (he > h1) he = h1;
            if (he - hb > MQ_ATT_GB) he = hb + MQ_ATT_GB;
            const int G = he - hb;
            const size_t kb = (size_t)kh * S * Dh;
            for (int i0 = 0; i0 + MQ_ATT_KB <= nmax; i0 += MQ_ATT_KB)     /* whole key blocks */
                for (int p = 0; p < tn; p++) {
                    int n = pos0 + t0 + p + 1;
                    if (n > S) n = S;
                    if (i0 + MQ_ATT_KB > n) continue;
                    const float *qt = q + ((size_t)(t0 + p) * Hq + hb) * Dh;
                    float *sp = scratch + (size_t)p * MQ_ATT_GB * rs;
                    for (int j = 0; j < G; j++)
                        MQ_FN(att_scores_)(qt + (size_t)j * Dh, k, f16, kb + (size_t)i0 * Dh, Dh, scale, sp + (size_t)j * rs + i0);
                }
            for (int p = 0; p < tn; p++) {
                int n = pos0 + t0 + p + 1;
                if (n > S) n = S;
                const float *qt = q + ((size_t)(t0 + p) * Hq + hb) * Dh;
                float *sp = scratch + (size_t)p * MQ_ATT_GB * rs;
                for (int i = n / MQ_ATT_KB * MQ_ATT_KB; i < n; i++) {   /* the last keys: one at a time */
                    const float *krow = (const float *)k + kb + (size_t)i * Dh;
                    if (f16) {
                        for (int d = 0; d < Dh; d++) kr[d] = mq_f16_to_f32(((const uint16_t *)k)[kb + (size_t)i * Dh + d]);
                        krow = kr;
                    }
                    for (int j = 0; j < G; j++)
                        sp[(size_t)j * rs + i] = MQ_FN(dotf_)(qt + (size_t)j * Dh, krow, Dh) * scale;
                }
                for (int j = 0; j < G; j++) MQ_FN(softmax_row_)(sp + (size_t)j * rs, n, 1);
            }
            if (tn == 1) {                                               /* decode: one pass */
                float *ot = out + ((size_t)t0 * Hq + hb) * Dh;
                int n = nmax;
                MQ_FN(att_pv_group_)(scratch, S, G, v, f16, kb, 0, n, Dh, ot, 0);
            } else {
                for (int p = 0; p < tn; p++) memset(out + ((size_t)(t0 + p) * Hq + hb) * Dh, 0, sizeof(float) * G * Dh);
                for (int c0 = 0; c0 < nmax; c0 += MQ_ATT_PVC)
                    for (int p = 0; p < tn; p++) {
                        int n = pos0 + t0 + p + 1;
                        if (n > S) n = S;
                        const int c1 = c0 + MQ_ATT_PVC < n ? c0 + MQ_ATT_PVC : n;
                        if (c1 <= c0) continue;
                        float *sp = scratch + (size_t)p * MQ_ATT_GB * rs;
                        float *ot = out + ((size_t)(t0 + p) * Hq + hb) * Dh;
                        MQ_FN(att_pv_group_)(sp, S, G, v, f16, kb, c0, c1, Dh, ot, 1);
                    }
            }
            hb = he;
        }
    }
}

/* specialised per cache dtype and for head_dim 64 and 128 (a constant head_dim turns the 16 key rows
 * of a block into displacements from one pointer instead of 16 offsets in registers) */
static void MQ_FN(att_grouped_)(const float *q, const void *k, const void *v, int f16, float *out, int T,
                                int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch) {
#define MQ_ATT_CALL(F16, DH) MQ_FN(att_grouped_f_)(q, k, v, F16, out, T, Hq, Hkv, DH, S, pos0, h0, h1, scratch)
    if (f16) {
        if (Dh == 64) MQ_ATT_CALL(1, 64);
        else if (Dh == 128) MQ_ATT_CALL(1, 128);
        else MQ_ATT_CALL(1, Dh);
    } else {
        if (Dh == 64) MQ_ATT_CALL(0, 64);
        else if (Dh == 128) MQ_ATT_CALL(0, 128);
        else MQ_ATT_CALL(0, Dh);
    }
#undef MQ_ATT_CALL
}
#endif

/* Heads [h0, h1) of causal GQA attention. q [T,Hq,Dh]; k, v [Hkv,S,Dh] (f32, or f16 if kv_f16);
 * out [T,Hq,Dh]; scratch: MQ_ATT_SCRATCH(S, Dh, T) floats. */
void MQ_FN(mq_attention_)(const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                          int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch) {
#if defined(MQ_ATT_KB)
    if (Dh % 16 == 0 && Dh <= MQ_ATT_MAXDH) {
        MQ_FN(att_grouped_)(q, k, v, kv_f16, out, T, Hq, Hkv, Dh, S, pos0, h0, h1, scratch);
        return;
    }
#endif
    int g = Hq / Hkv;
    float scale = (float)(1.0 / sqrt((double)Dh));
    float *sc = scratch, *kr = scratch + S, *o = kr + Dh;
    for (int h = h0; h < h1; h++) {
        int kh = h / g;
        for (int t = 0; t < T; t++) {
            const float *qr = q + ((size_t)t * Hq + h) * Dh;
            int n = pos0 + t + 1;
            if (n > S) n = S;
            for (int i = 0; i < n; i++) {
                size_t off = ((size_t)kh * S + i) * Dh;
                const float *krow;
                if (kv_f16) {
                    const uint16_t *kp = (const uint16_t *)k + off;
                    for (int d = 0; d < Dh; d++) kr[d] = mq_f16_to_f32(kp[d]);
                    krow = kr;
                } else {
                    krow = (const float *)k + off;
                }
                sc[i] = MQ_FN(dotf_)(qr, krow, Dh) * scale;
            }
            MQ_FN(softmax_row_)(sc, n, 1);
            for (int d = 0; d < Dh; d++) o[d] = 0.0f;
            for (int i = 0; i < n; i++) {
                size_t off = ((size_t)kh * S + i) * Dh;
                float p = sc[i];
                if (kv_f16) {
                    const uint16_t *vp = (const uint16_t *)v + off;
                    for (int d = 0; d < Dh; d++) o[d] += p * mq_f16_to_f32(vp[d]);
                } else {
                    const float *vr = (const float *)v + off;
                    for (int d = 0; d < Dh; d++) o[d] += p * vr[d];
                }
            }
            memcpy(out + ((size_t)t * Hq + h) * Dh, o, (size_t)Dh * 4);
        }
    }
}
