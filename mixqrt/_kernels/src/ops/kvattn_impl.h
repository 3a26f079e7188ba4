/* Attention over the packed KV cache (mixqrt/kv): one source compiled per tier after misc_impl.h
 * (misc_generic.c, misc_avx2.c, misc_avx512.c), so it shares that file's exp and dot. The numpy
 * reference, operation for operation, is mixqrt/kv/ref.py: read its docstring for the format and
 * the arithmetic. Integer sums are exact; every float operation is the reference's, in its order
 * (no FMA contraction: -ffp-contract=off), so every tier gives the same bits.
 *
 * Work is one KV head and a range of query rows: every query head of the KV head's group reads each
 * block of K and V once per row, and a tile of up to MQ_KV_TR rows reads each block once per tile
 * (the block stays in L1 while the tile's rows use it). */


/* sum of n <= 64 floats (x holds zeros up to 64) in the reference's sum16 order */
static inline float MQ_FN(kv_sum16_)(const float *x) {
#if defined(__AVX512F__)
    __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)),
                                           _mm512_loadu_ps(x + 32)), _mm512_loadu_ps(x + 48));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float r[4];
    _mm_storeu_ps(r, q);
    return (r[0] + r[2]) + (r[1] + r[3]);
#else
    float a[16];
    for (int l = 0; l < 16; l++) a[l] = ((x[l] + x[l + 16]) + x[l + 32]) + x[l + 48];
    for (int l = 0; l < 8; l++) a[l] += a[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

/* The attention's exp, in base 2 (scores carry log2(e) in their scale): 2^x for x in [MQ_KV_E2LO, 0] as
 * 2^n * P(f), n = rint(x), f = x - n (exact) in [-1/2, 1/2], P of degree 4 (relative error 2.9e-6: the
 * probabilities are rounded to 8 bits after it). P(f) is in [0.70, 1.42] and n >= -125, so the
 * product is normal and exact: scalef, a multiply by 2^n and numpy's ldexp give the same bits. */
#define MQ_KV_E2LO (-125.0f)
#define MQ_KV_E2C1 0x1.62e12ep-1f
#define MQ_KV_E2C2 0x1.ec0368p-3f
#define MQ_KV_E2C3 0x1.c9fc2ap-5f
#define MQ_KV_E2C4 0x1.3a0728p-7f
#define MQ_KV_LOG2E 0x1.715476p+0f

static inline float MQ_FN(kexp2_)(float x) {
    const float n = nearbyintf(x), f = x - n;
    float p = MQ_KV_E2C4;
    p = p * f + MQ_KV_E2C3;
    p = p * f + MQ_KV_E2C2;
    p = p * f + MQ_KV_E2C1;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } sc = { (uint32_t)((int)n + 127) << 23 };
    return p * sc.f;
}

#if defined(MQ_XV)
/* kexp2_ on a vector, the same bits per lane (AVX-512 scales by scalef, the others by a multiply with
 * 2^n built from its bits: both exact here) */
static inline __attribute__((always_inline)) mq_xv MQ_FN(kexp2_v_)(mq_xv v) {
    const mq_xv n = MQ_XROUND(v), f = MQ_XSUB(v, n);
    mq_xv q = MQ_XADD(MQ_XMUL(MQ_X1(MQ_KV_E2C4), f), MQ_X1(MQ_KV_E2C3));
    q = MQ_XADD(MQ_XMUL(q, f), MQ_X1(MQ_KV_E2C2));
    q = MQ_XADD(MQ_XMUL(q, f), MQ_X1(MQ_KV_E2C1));
    q = MQ_XADD(MQ_XMUL(q, f), MQ_X1(1.0f));
#if defined(__AVX512F__)
    return _mm512_scalef_ps(q, n);
#else
    return MQ_XMUL(q, MQ_XSCALE(n));
#endif
}
#endif

/* p[i] = kexp2(max(x[i] - mx, MQ_KV_E2LO)) for 64 values (x - mx <= 0) */
static inline void MQ_FN(kv_exp64_)(const float *x, float mx, float *p) {
    int i = 0;
#if defined(MQ_XV)
    for (; i < 64; i += MQ_XV)
        MQ_XSTORE(p + i, MQ_FN(kexp2_v_)(MQ_XMAX(MQ_XSUB(MQ_XLOAD(x + i), MQ_X1(mx)), MQ_X1(MQ_KV_E2LO))));
#endif
    for (; i < 64; i++) {
        float v = x[i] - mx;
        v = v < MQ_KV_E2LO ? MQ_KV_E2LO : v;
        p[i] = MQ_FN(kexp2_)(v);
    }
}

/* The softmax's sum stays in 16 lanes per head (lane i: positions i, i + 16, i + 32, i + 48 of every
 * block, added in that order), folded once per row by kv_ltree_ (sum16's tree) */
static inline void MQ_FN(kv_lanes_)(float *L, float alpha, const float *p) {
    int i = 0;
#if defined(__AVX512F__)
    _mm512_storeu_ps(L, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(L), _mm512_set1_ps(alpha)),
                                      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)),
                                                                  _mm512_loadu_ps(p + 32)), _mm512_loadu_ps(p + 48))));
    i = 16;
#endif
    for (; i < 16; i++) L[i] = L[i] * alpha + (((p[i] + p[i + 16]) + p[i + 32]) + p[i + 48]);
}

static inline float MQ_FN(kv_ltree_)(const float *L) {
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = L[i] + L[i + 8];
    for (int i = 0; i < 4; i++) a[i] += a[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* q4's kdot walks the codes in 4 groups of 16 positions, one sub-block each, and its fac holds [4][Dh] */
_Static_assert(MQ_KV_SUB == 16, "q4's key sub-blocks are the kdot's 16-position groups");

/* ---- small vector helpers: the same values on every tier (conversions and roundings are exact /
 * round-to-nearest-even in all of them; max is order-free) */
static inline void MQ_FN(kv_cvt16_)(const uint16_t *src, float *dst, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = mq_f16_to_f32(src[i]);
}

/* y = a * b, returns max |y| (0 if none is larger); the AVX-512 tier reduces four heads at once
 * (kv_hred_) instead */
static inline float MQ_FN(kv_mul_absmax_)(const float *a, const float *b, float *y, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) {
        y[i] = a[i] * b[i];
        const float v = y[i] < 0 ? -y[i] : y[i];
        m = v > m ? v : m;
    }
    return m;
}

/* out[i] = rint(x[i] * s) as a byte (|x[i] * s| <= 127, or 0 .. 255 unsigned) */
static inline void MQ_FN(kv_round8_)(const float *x, float s, uint8_t *out, int n) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), sv))));
#endif
    for (; i < n; i++) out[i] = (uint8_t)(int)nearbyintf(x[i] * s);
}

/* q4's 8-bit scales -> floats (misc.h mq_kv_logscale, exact): e = 12 q + r, the bits of 2^(r/12) plus q - 16
 * in the exponent (e / 12 as (e * 2731) >> 15, exact for e < 256) */
static inline void MQ_FN(kv_logscales_)(const uint8_t *e8, float *out, int n) {
    int i = 0;
#if defined(__AVX512F__)
    static const uint32_t mb[16] = MQ_KV_LOGMANT_BITS;
    const __m512i tab = _mm512_loadu_si512((const void *)mb);
    for (; i + 16 <= n; i += 16) {
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(e8 + i)));
        const __m512i qd = _mm512_srli_epi32(_mm512_mullo_epi32(e, _mm512_set1_epi32(2731)), 15);
        const __m512i r = _mm512_sub_epi32(e, _mm512_mullo_epi32(qd, _mm512_set1_epi32(12)));
        const __m512i b = _mm512_add_epi32(_mm512_permutexvar_epi32(r, tab),
                                           _mm512_slli_epi32(_mm512_sub_epi32(qd, _mm512_set1_epi32(16)), 23));
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(b));
    }
#endif
    for (; i < n; i++) out[i] = mq_kv_logscale(e8[i]);
}

/* max of x[0 .. n) (the AVX-512 tier: kv_hred_) */
static inline float MQ_FN(kv_max_)(const float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

#if defined(__AVX512F__)
/* Horizontal sums in sum16's tree (lanes i + i+8, then i + i+4, then (0 + 2) + (1 + 3)) or maxima of
 * four vectors at once: the four results, in order. Each step pairs the same lanes as the one-vector
 * tree, so the sums have its bits; the shuffles serve four heads. */
static inline __m128 MQ_FN(kv_tree4_)(__m512 v0, __m512 v1, __m512 v2, __m512 v3, int is_max) {
#define MQ_KV_OP(a, b) (is_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b))
    const __m512 h01 = MQ_KV_OP(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
    const __m512 h23 = MQ_KV_OP(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
    const __m512 q = MQ_KV_OP(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
    const __m512 t = MQ_KV_OP(q, _mm512_permute_ps(q, 0x4E));          /* (q0 + q2), (q1 + q3) */
    const __m512 r = MQ_KV_OP(t, _mm512_permute_ps(t, 0xB1));          /* their sum in element 0 */
#undef MQ_KV_OP
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), r));
}

/* out[j] = the tree of v[j] for j < g (g <= 16) */
static inline void MQ_FN(kv_hred_)(const __m512 *v, int g, int is_max, float *out) {
    for (int j = 0; j < g; j += 4) {
        const __m512 z = _mm512_setzero_ps();
        float r[4];
        _mm_storeu_ps(r, MQ_FN(kv_tree4_)(v[j], j + 1 < g ? v[j + 1] : z, j + 2 < g ? v[j + 2] : z,
                                          j + 3 < g ? v[j + 3] : z, is_max));
        for (int i = 0; i < 4 && j + i < g; i++) out[j + i] = r[i];
    }
}

#endif

/* The online-softmax step shared by both block kinds: s [g][64] scores (base 2) of n positions (the
 * rest is ignored) -> s holds p (zeros past n), alpha[j] the old sums' factor; m, L [g][16] updated. */
static inline void MQ_FN(kv_probs_)(float *s, int g, int n, float *m, float *L, float *alpha) {
#if defined(__AVX512F__)
    {   /* the heads' maxima in one tree, m' and alpha for all heads in one vector */
        __m512 v[MQ_KV_GB];
        float bm[MQ_KV_GB];
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < g; j++) {
            const float *sj = s + (size_t)j * 64;
            __m512 x = ninf;
            for (int k = 0; k < 64 && k < n; k += 16)
                x = _mm512_max_ps(x, n - k >= 16 ? _mm512_loadu_ps(sj + k)
                                                 : _mm512_mask_loadu_ps(ninf, (__mmask16)((1u << (n - k)) - 1), sj + k));
            v[j] = x;
        }
        MQ_FN(kv_hred_)(v, g, 1, bm);
        const __mmask16 gm = (__mmask16)((1u << g) - 1);
        const __m512 mo = _mm512_mask_loadu_ps(ninf, gm, m);
        const __m512 mn = _mm512_max_ps(mo, _mm512_mask_loadu_ps(ninf, gm, bm));
        const __m512 d = _mm512_max_ps(_mm512_sub_ps(mo, mn), _mm512_set1_ps(MQ_KV_E2LO));
        const __m512 al = _mm512_mask_mov_ps(MQ_FN(kexp2_v_)(d), _mm512_cmp_ps_mask(mo, ninf, _CMP_EQ_OQ),
                                             _mm512_setzero_ps());  /* 2^0 is exactly 1: m' = m gives 1 */
        _mm512_mask_storeu_ps(alpha, gm, al);
        _mm512_mask_storeu_ps(m, gm, mn);
        for (int j = 0; j < g; j++) {
            float *sj = s + (size_t)j * 64;
            for (int t = n; t < 64; t++) sj[t] = m[j];
            MQ_FN(kv_exp64_)(sj, m[j], sj);
            for (int t = n; t < 64; t++) sj[t] = 0.0f;
            MQ_FN(kv_lanes_)(L + (size_t)j * 16, alpha[j], sj);
        }
        return;
    }
#endif
    for (int j = 0; j < g; j++) {
        float *sj = s + (size_t)j * 64;
        const float bm = MQ_FN(kv_max_)(sj, n);
        const float mn = m[j] > bm ? m[j] : bm;
        if (m[j] == -INFINITY) alpha[j] = 0.0f;
        else if (m[j] == mn) alpha[j] = 1.0f;      /* kexp2(0) is exactly 1 (the reference's value) */
        else {
            float d = m[j] - mn;
            d = d < MQ_KV_E2LO ? MQ_KV_E2LO : d;
            alpha[j] = MQ_FN(kexp2_)(d);
        }
        for (int t = n; t < 64; t++) sj[t] = mn;   /* 2^0 = 1 below, zeroed after */
        MQ_FN(kv_exp64_)(sj, mn, sj);
        for (int t = n; t < 64; t++) sj[t] = 0.0f;
        MQ_FN(kv_lanes_)(L + (size_t)j * 16, alpha[j], sj);
        m[j] = mn;
    }
}

/* ---- f16 positions [0, n) of one block (n <= 64): k, v point at the first one's row */
static void MQ_FN(kv_f16_block_)(const float *q, int g, int Dh, const uint16_t *k, const uint16_t *v, int n,
                                 float scale, float *m, float *L, float *acc, float *sc, float *row) {
    for (int t = 0; t < n; t++) {
        MQ_FN(kv_cvt16_)(k + (size_t)t * Dh, row, Dh);
#if defined(__AVX512F__)
        if (Dh % 16 == 0)
        for (int j = 0; j < g; j += 4) {          /* dotf_ of four heads, their trees as one */
            __m512 d[4];
            for (int i = 0; i < 4; i++) {
                const float *qj = q + (size_t)(j + i < g ? j + i : j) * Dh;
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < Dh; c += 16)
                    a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(qj + c), _mm512_loadu_ps(row + c)));
                d[i] = a;
            }
            float r[4];
            _mm_storeu_ps(r, _mm_mul_ps(MQ_FN(kv_tree4_)(d[0], d[1], d[2], d[3], 0), _mm_set1_ps(scale)));
            for (int i = 0; i < 4 && j + i < g; i++) sc[(size_t)(j + i) * 64 + t] = r[i];
        }
        else
#endif
        for (int j = 0; j < g; j++) sc[(size_t)j * 64 + t] = MQ_FN(dotf_)(q + (size_t)j * Dh, row, Dh) * scale;
    }
    float alpha[MQ_KV_GB];
    MQ_FN(kv_probs_)(sc, g, n, m, L, alpha);
    float vr[64 * 256];                               /* the block's values once in float, then per head */
    for (int t = 0; t < n; t++) MQ_FN(kv_cvt16_)(v + (size_t)t * Dh, vr + (size_t)t * Dh, Dh);
    for (int j = 0; j < g; j++) {                     /* acc * alpha, then + p_t v_t in position order */
        float *aj = acc + (size_t)j * Dh;
        const float *pj = sc + (size_t)j * 64;
        int d = 0;
#if defined(__AVX512F__)
        const __m512 al = _mm512_set1_ps(alpha[j]);
        for (; d + 64 <= Dh; d += 64) {               /* four accumulators in registers */
            __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(aj + d), al), a1 = _mm512_mul_ps(_mm512_loadu_ps(aj + d + 16), al);
            __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(aj + d + 32), al), a3 = _mm512_mul_ps(_mm512_loadu_ps(aj + d + 48), al);
            for (int t = 0; t < n; t++) {
                const __m512 p = _mm512_set1_ps(pj[t]);
                const float *x = vr + (size_t)t * Dh + d;
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(p, _mm512_loadu_ps(x)));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(p, _mm512_loadu_ps(x + 16)));
                a2 = _mm512_add_ps(a2, _mm512_mul_ps(p, _mm512_loadu_ps(x + 32)));
                a3 = _mm512_add_ps(a3, _mm512_mul_ps(p, _mm512_loadu_ps(x + 48)));
            }
            _mm512_storeu_ps(aj + d, a0); _mm512_storeu_ps(aj + d + 16, a1);
            _mm512_storeu_ps(aj + d + 32, a2); _mm512_storeu_ps(aj + d + 48, a3);
        }
#endif
        for (; d < Dh; d++) {
            float a = aj[d] * alpha[j];
            for (int t = 0; t < n; t++) a = a + pj[t] * vr[(size_t)t * Dh + d];
            aj[d] = a;
        }
    }
}

/* ---- the integer sums of a packed block, per tier:
 * kv_kdot_: isum[j][t] = sum_c q8[j][c] code(t, c) for the block's 64 positions
 * kv_vdot_: iv[j][d]   = sum_t p8[j][t] code(t, d) */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* q4's keys: isum[j][t] = sum_c q8[j][c] u(t, c), u = (b + 1) code + 16 a (< 256), for gn heads (a
 * compile-time constant where the caller switches on it: no per-head branch in the loop). fe, fo: the
 * factors b + 1 of the even / the odd byte of each 16-bit lane, [4][Dh] bytes with zeros between;
 * a16: 16 a [4][Dh]. A byte's code times its factor is one 16-bit product: the even byte's code masked
 * in place (bits 0-3) times fe, the odd byte's (bits 8-11) times fo lands in the odd byte. */
static inline __attribute__((always_inline)) void MQ_FN(kv_kdot4_)(const int8_t *q8, const uint8_t *fe, const uint8_t *fo,
                                                                  const uint8_t *a16, int gn, int Dh, const uint8_t *kc,
                                                                  int32_t *isum) {
    const __m512i me = _mm512_set1_epi16(0x000F), mo = _mm512_set1_epi16(0x0F00);
    for (int j0 = 0; j0 < gn; j0 += 8) {
        const int gj = gn - j0 < 8 ? gn - j0 : 8;
        for (int s = 0; s < 4; s++) {                    /* 16 positions: one sub-block */
            __m512i a[8];
            for (int j = 0; j < gj; j++) a[j] = _mm512_setzero_si512();
            const uint8_t *p = kc + (size_t)s * (Dh / 8) * 64;
            const uint8_t *fes = fe + (size_t)s * Dh, *fos = fo + (size_t)s * Dh, *as = a16 + (size_t)s * Dh;
            for (int mm = 0; mm < Dh / 8; mm++) {
                const __m512i x = _mm512_loadu_si512((const void *)(p + (size_t)mm * 64));
                const __m512i xh = _mm512_srli_epi16(x, 4);
                int32_t e0, e1, o0, o1, a0, a1;
                memcpy(&e0, fes + 8 * mm, 4); memcpy(&e1, fes + 8 * mm + 4, 4);
                memcpy(&o0, fos + 8 * mm, 4); memcpy(&o1, fos + 8 * mm + 4, 4);
                memcpy(&a0, as + 8 * mm, 4); memcpy(&a1, as + 8 * mm + 4, 4);
                const __m512i lo = _mm512_add_epi8(_mm512_or_si512(
                    _mm512_mullo_epi16(_mm512_and_si512(x, me), _mm512_set1_epi32(e0)),
                    _mm512_mullo_epi16(_mm512_and_si512(x, mo), _mm512_set1_epi32(o0))), _mm512_set1_epi32(a0));
                const __m512i hi = _mm512_add_epi8(_mm512_or_si512(
                    _mm512_mullo_epi16(_mm512_and_si512(xh, me), _mm512_set1_epi32(e1)),
                    _mm512_mullo_epi16(_mm512_and_si512(xh, mo), _mm512_set1_epi32(o1))), _mm512_set1_epi32(a1));
                for (int j = 0; j < gj; j++) {
                    const int8_t *qj = q8 + (size_t)(j0 + j) * Dh + 8 * mm;
                    int32_t w0, w1;
                    memcpy(&w0, qj, 4); memcpy(&w1, qj + 4, 4);
                    a[j] = _mm512_dpbusd_epi32(a[j], lo, _mm512_set1_epi32(w0));
                    a[j] = _mm512_dpbusd_epi32(a[j], hi, _mm512_set1_epi32(w1));
                }
            }
            for (int j = 0; j < gj; j++) _mm512_storeu_si512((void *)(isum + (size_t)(j0 + j) * 64 + 16 * s), a[j]);
        }
    }
}

/* q4's per-sub-block factors from the block's kadj [4][Dh]: fe, fo (kv_kdot4_) and 16 a */
static inline void MQ_FN(kv_q4_factors_)(const uint8_t *adj, int Dh, uint8_t *fe, uint8_t *fo, uint8_t *a16) {
    const __m512i l4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1), ev = _mm512_set1_epi16(0x00FF);
    const int n = 4 * Dh;
    int c = 0;
    for (; c + 64 <= n; c += 64) {
        const __m512i x = _mm512_loadu_si512((const void *)(adj + c));
        const __m512i b1 = _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), l4), one);
        _mm512_storeu_si512((void *)(a16 + c), _mm512_slli_epi16(_mm512_and_si512(x, l4), 4));
        _mm512_storeu_si512((void *)(fe + c), _mm512_and_si512(b1, ev));
        _mm512_storeu_si512((void *)(fo + c), _mm512_srli_epi16(b1, 8));
    }
    for (; c < n; c++) {
        const uint8_t b1 = (uint8_t)((adj[c] >> 4) + 1);
        a16[c] = (uint8_t)(16 * (adj[c] & 15));
        fe[c] = c % 2 ? 0 : b1;
        fo[c] = c % 2 ? 0 : (uint8_t)((adj[c + 1] >> 4) + 1);
    }
}

static void MQ_FN(kv_kdot_)(const int8_t *q8, const uint8_t *fac, int g, int Dh, const uint8_t *kc, int bits,
                            int32_t *isum) {
    if (bits == 4) {                                     /* fac: fe, fo, 16 a, each [4][Dh] */
        const uint8_t *fe = fac, *fo = fac + 4 * (size_t)Dh, *a16 = fac + 8 * (size_t)Dh;
        switch (g) {
        case 1: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 1, Dh, kc, isum); return;
        case 2: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 2, Dh, kc, isum); return;
        case 4: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 4, Dh, kc, isum); return;
        case 6: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 6, Dh, kc, isum); return;
        case 7: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 7, Dh, kc, isum); return;
        case 8: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, 8, Dh, kc, isum); return;
        default: MQ_FN(kv_kdot4_)(q8, fe, fo, a16, g, Dh, kc, isum); return;
        }
    }
    for (int j0 = 0; j0 < g; j0 += 8) {
        const int gn = g - j0 < 8 ? g - j0 : 8;
        for (int s = 0; s < 4; s++) {                    /* 16 positions */
            __m512i a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_si512();
            {
                const uint8_t *p = kc + (size_t)s * (Dh / 4) * 64;
                for (int c4 = 0; c4 < Dh / 4; c4++) {
                    const __m512i x = _mm512_loadu_si512((const void *)(p + (size_t)c4 * 64));
                    for (int j = 0; j < 8; j++) {
                        if (j >= gn) break;
                        int32_t w;
                        memcpy(&w, q8 + (size_t)(j0 + j) * Dh + 4 * c4, 4);
                        a[j] = _mm512_dpbusd_epi32(a[j], x, _mm512_set1_epi32(w));
                    }
                }
            }
            for (int j = 0; j < gn; j++) _mm512_storeu_si512((void *)(isum + (size_t)(j0 + j) * 64 + 16 * s), a[j]);
        }
    }
}

static inline __attribute__((always_inline)) void MQ_FN(kv_vdotg_)(const uint8_t *p8, int g, int Dh, const uint8_t *vc,
                                                                   int bits, int32_t *iv) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    static const int8_t lev[16] = MQ_KV_VLEV;
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lev));
    for (int j0 = 0; j0 < g; j0 += 8) {
        const int gn = g - j0 < 8 ? g - j0 : 8;
        for (int c32 = 0; c32 < Dh / 32; c32++) {        /* 32 channels: two vectors per head */
            __m512i a[8][2];
            for (int j = 0; j < 8; j++) a[j][0] = a[j][1] = _mm512_setzero_si512();
            for (int u = 0; u < 16; u++) {               /* 4 positions */
                __m512i x0, x1;
                if (bits == 4) {
                    const __m512i x = _mm512_loadu_si512((const void *)(vc + ((size_t)u * (Dh / 32) + c32) * 64));
                    x0 = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, lo4));     /* code -> its level */
                    x1 = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(x, 4), lo4));
                } else {
                    x0 = _mm512_loadu_si512((const void *)(vc + ((size_t)u * (Dh / 16) + 2 * c32) * 64));
                    x1 = _mm512_loadu_si512((const void *)(vc + ((size_t)u * (Dh / 16) + 2 * c32 + 1) * 64));
                }
                for (int j = 0; j < 8; j++) {
                    if (j >= gn) break;
                    int32_t w;
                    memcpy(&w, p8 + (size_t)(j0 + j) * 64 + 4 * u, 4);
                    const __m512i pw = _mm512_set1_epi32(w);
                    if (bits == 4) {       /* probabilities 0..255 unsigned, levels -127..127 signed */
                        a[j][0] = _mm512_dpbusd_epi32(a[j][0], pw, x0);
                        a[j][1] = _mm512_dpbusd_epi32(a[j][1], pw, x1);
                    } else {               /* codes 0..255 unsigned, probabilities 0..127 signed */
                        a[j][0] = _mm512_dpbusd_epi32(a[j][0], x0, pw);
                        a[j][1] = _mm512_dpbusd_epi32(a[j][1], x1, pw);
                    }
                }
            }
            for (int j = 0; j < gn; j++) {
                _mm512_storeu_si512((void *)(iv + (size_t)(j0 + j) * Dh + 32 * c32), a[j][0]);
                _mm512_storeu_si512((void *)(iv + (size_t)(j0 + j) * Dh + 32 * c32 + 16), a[j][1]);
            }
        }
    }
}
/* g a compile-time constant for the common group sizes (no per-head branch in the loop) */
static void MQ_FN(kv_vdot_)(const uint8_t *p8, int g, int Dh, const uint8_t *vc, int bits, int32_t *iv) {
    switch (g) {
    case 1: MQ_FN(kv_vdotg_)(p8, 1, Dh, vc, bits, iv); return;
    case 2: MQ_FN(kv_vdotg_)(p8, 2, Dh, vc, bits, iv); return;
    case 4: MQ_FN(kv_vdotg_)(p8, 4, Dh, vc, bits, iv); return;
    case 6: MQ_FN(kv_vdotg_)(p8, 6, Dh, vc, bits, iv); return;
    case 7: MQ_FN(kv_vdotg_)(p8, 7, Dh, vc, bits, iv); return;
    case 8: MQ_FN(kv_vdotg_)(p8, 8, Dh, vc, bits, iv); return;
    default: MQ_FN(kv_vdotg_)(p8, g, Dh, vc, bits, iv); return;
    }
}
#else
/* portable: the codes unpacked to bytes [64][Dh] (position-major), then plain integer loops */
static void MQ_FN(kv_unpack_k_)(const uint8_t *kc, int Dh, int bits, uint8_t *out) {
    for (int t = 0; t < 64; t++)
        for (int c = 0; c < Dh; c++) {
            const int s = t / 16, tt = t % 16;
            uint8_t b;
            if (bits == 4) b = (uint8_t)((kc[((size_t)s * (Dh / 8) + c / 8) * 64 + tt * 4 + c % 4] >> (4 * ((c % 8) / 4))) & 15);
            else b = kc[((size_t)s * (Dh / 4) + c / 4) * 64 + tt * 4 + c % 4];
            out[(size_t)t * Dh + c] = b;
        }
}

static void MQ_FN(kv_unpack_v_)(const uint8_t *vc, int Dh, int bits, uint8_t *out) {
    for (int t = 0; t < 64; t++)
        for (int d = 0; d < Dh; d++) {
            const int u = t / 4, j = t % 4;
            uint8_t b;
            if (bits == 4) b = (uint8_t)((vc[((size_t)u * (Dh / 32) + d / 32) * 64 + (d % 16) * 4 + j] >> (4 * ((d % 32) / 16))) & 15);
            else b = vc[((size_t)u * (Dh / 16) + d / 16) * 64 + (d % 16) * 4 + j];
            out[(size_t)t * Dh + d] = b;
        }
}

static void MQ_FN(kv_kdot_)(const int8_t *q8, const uint8_t *fac, int g, int Dh, const uint8_t *kc, int bits,
                            int32_t *isum) {
    uint8_t codes[64 * 256];
    MQ_FN(kv_unpack_k_)(kc, Dh, bits, codes);
    if (fac)                                            /* q4: u = 16 a + (b + 1) code, per sub-block */
        for (int t = 0; t < 64; t++)
            for (int c = 0; c < Dh; c++)
                codes[(size_t)t * Dh + c] = (uint8_t)(codes[(size_t)t * Dh + c] * fac[(size_t)(t / MQ_KV_SUB) * Dh + c]
                                                      + fac[(size_t)(4 + t / MQ_KV_SUB) * Dh + c]);
    for (int j = 0; j < g; j++)
        for (int t = 0; t < 64; t++) {
            int32_t s = 0;
            const uint8_t *cr = codes + (size_t)t * Dh;
            const int8_t *qj = q8 + (size_t)j * Dh;
            for (int c = 0; c < Dh; c++) s += (int32_t)qj[c] * (int32_t)cr[c];
            isum[(size_t)j * 64 + t] = s;
        }
}

static void MQ_FN(kv_vdot_)(const uint8_t *p8, int g, int Dh, const uint8_t *vc, int bits, int32_t *iv) {
    static const int32_t lev[16] = MQ_KV_VLEV;
    uint8_t codes[64 * 256];
    MQ_FN(kv_unpack_v_)(vc, Dh, bits, codes);
    for (int j = 0; j < g; j++) {
        int32_t *o = iv + (size_t)j * Dh;
        for (int d = 0; d < Dh; d++) o[d] = 0;
        for (int t = 0; t < 64; t++) {
            const int32_t p = p8[(size_t)j * 64 + t];
            const uint8_t *cr = codes + (size_t)t * Dh;
            if (bits == 4)
                for (int d = 0; d < Dh; d++) o[d] += p * lev[cr[d]];
            else
                for (int d = 0; d < Dh; d++) o[d] += p * (int32_t)cr[d];
        }
    }
}
#endif

/* sc[t] = ((float)isum[t] * d + c) * scale for n positions (n a multiple of 16) */
static inline void MQ_FN(kv_scores_)(const int32_t *isum, float d, float c, float scale, float *sc, int n) {
    int t = 0;
#if defined(__AVX512F__)
    const __m512 dv = _mm512_set1_ps(d), cv = _mm512_set1_ps(c), sv = _mm512_set1_ps(scale);
    for (; t + 16 <= n; t += 16) {
        const __m512 x = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(isum + t)));
        _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(x, dv), cv), sv));
    }
#endif
    for (; t < n; t++) sc[t] = ((float)isum[t] * d + c) * scale;
}

/* ---- the query against keys of per-channel scale sc and min mn (ref._q8_query) */
static inline void MQ_FN(kv_q8_query_)(const float *q, int g, int Dh, const float *sc, const float *mn, float *row,
                                       int8_t *q8, float *d8, float *cst) {
#if defined(__AVX512F__)
    {   /* max |q sc| and dot(q, mn) (dotf_'s order) of every head, reduced in trees of four */
        __m512 am[MQ_KV_GB], dv[MQ_KV_GB];
        float a[MQ_KV_GB], qs[MQ_KV_GB * 256];                   /* q' = q sc of every head */
        for (int j = 0; j < g; j++) {
            const float *qj = q + (size_t)j * Dh;
            float *qsj = qs + (size_t)j * Dh;
            __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
            for (int i = 0; i < Dh; i += 16) {
                const __m512 qv = _mm512_loadu_ps(qj + i), p = _mm512_mul_ps(qv, _mm512_loadu_ps(sc + i));
                _mm512_storeu_ps(qsj + i, p);
                x = _mm512_max_ps(x, _mm512_abs_ps(p));
                y = _mm512_add_ps(y, _mm512_mul_ps(qv, _mm512_loadu_ps(mn + i)));
            }
            am[j] = x; dv[j] = y;
        }
        MQ_FN(kv_hred_)(am, g, 1, a);
        MQ_FN(kv_hred_)(dv, g, 0, cst);
        for (int j = 0; j < g; j++) {
            int8_t *qo = q8 + (size_t)j * Dh;
            if (a[j] > 0.0f) {
                MQ_FN(kv_round8_)(qs + (size_t)j * Dh, 127.0f / a[j], (uint8_t *)qo, Dh);
                d8[j] = a[j] / 127.0f;
            } else {
                memset(qo, 0, (size_t)Dh);
                d8[j] = 0.0f;
            }
        }
        (void)row;
        return;
    }
#endif
    for (int j = 0; j < g; j++) {
        const float *qj = q + (size_t)j * Dh;
        const float a = MQ_FN(kv_mul_absmax_)(qj, sc, row, Dh);
        cst[j] = MQ_FN(dotf_)(qj, mn, Dh);
        int8_t *qo = q8 + (size_t)j * Dh;
        if (a > 0.0f) {
            MQ_FN(kv_round8_)(row, 127.0f / a, (uint8_t *)qo, Dh);
            d8[j] = a / 127.0f;
        } else {
            for (int i = 0; i < Dh; i++) qo[i] = 0;
            d8[j] = 0.0f;
        }
    }
}

/* ---- one packed block for one row's g heads */
static void MQ_FN(kv_packed_block_)(const float *q, int g, int Dh, const uint8_t *blk, int bits, float scale,
                                    float *m, float *L, float *acc, float *sc, float *row, void *iscr) {
    const int q4 = bits == 4, NS = 64 / MQ_KV_SUB;
    const uint8_t *kc, *vc, *adj = NULL;
    const uint16_t *km16;
    const float pmax = bits == 8 ? 127.0f : 255.0f;
    int8_t *q8 = (int8_t *)iscr;                                   /* [GB][Dh] */
    int32_t *isum = (int32_t *)(q8 + 2 * (size_t)MQ_KV_GB * 256);  /* [g][64], then [g][Dh] */
    uint8_t *p8 = (uint8_t *)(isum + (size_t)MQ_KV_GB * 256);      /* [g][64] */
    float kmin[256], kscale[256], vsc[64], vmn[64];
    float d8[MQ_KV_GB], ck[MQ_KV_GB];
    uint8_t fac[3 * 4 * 256];          /* q4: b + 1 [4][Dh], then 16 a [4][Dh] (VNNI: fe, fo, 16 a: kv_kdot4_) */
    if (q4) {                                                      /* kmin f16, kscale u8, adj [4][Dh], codes, vscale u8, codes */
        km16 = (const uint16_t *)blk;
        adj = blk + 3 * (size_t)Dh;
        kc = adj + (size_t)NS * Dh;
        vc = kc + (size_t)32 * Dh + 64;
        MQ_FN(kv_logscales_)(blk + 2 * (size_t)Dh, kscale, Dh);
        MQ_FN(kv_logscales_)(kc + (size_t)32 * Dh, vsc, 64);
    } else {                                                       /* kscale, kmin f16, codes, vscale, vmin f16, codes */
        km16 = (const uint16_t *)blk + Dh;
        kc = blk + 4 * (size_t)Dh;
        const uint16_t *vs = (const uint16_t *)(kc + (size_t)64 * Dh);
        vc = (const uint8_t *)(vs + 128);
        MQ_FN(kv_cvt16_)((const uint16_t *)blk, kscale, Dh);
        MQ_FN(kv_cvt16_)(vs, vsc, 64);
        MQ_FN(kv_cvt16_)(vs + 64, vmn, 64);
    }
    MQ_FN(kv_cvt16_)(km16, kmin, Dh);
    MQ_FN(kv_q8_query_)(q, g, Dh, kscale, kmin, row, q8, d8, ck);  /* the query against the block's scale */
    if (q4) {          /* k = kmin + kscale / 16 * u, u = 16 a + (b + 1) code <= 255 (sub-block i's a, b) */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        MQ_FN(kv_q4_factors_)(adj, Dh, fac, fac + 4 * (size_t)Dh, fac + 8 * (size_t)Dh);
#else
        for (int i = 0; i < NS; i++) {
            const uint8_t *ai = adj + (size_t)i * Dh;
            for (int c = 0; c < Dh; c++) {
                fac[(size_t)i * Dh + c] = (uint8_t)((ai[c] >> 4) + 1);
                fac[(size_t)(NS + i) * Dh + c] = (uint8_t)(16 * (ai[c] & 15));
            }
        }
#endif
        for (int j = 0; j < g; j++) d8[j] = d8[j] * 0.0625f;
    }
    MQ_FN(kv_kdot_)(q8, q4 ? fac : NULL, g, Dh, kc, bits, isum);
    for (int j = 0; j < g; j++) MQ_FN(kv_scores_)(isum + (size_t)j * 64, d8[j], ck[j], scale, sc + (size_t)j * 64, 64);
    float alpha[MQ_KV_GB], e8[MQ_KV_GB], vsum[MQ_KV_GB];
    MQ_FN(kv_probs_)(sc, g, 64, m, L, alpha);
    float pb[MQ_KV_GB], pv[MQ_KV_GB * 64];                          /* max p' of each head; p' = p vscale */
#if defined(__AVX512F__)
    {
        __m512 v[MQ_KV_GB];
        for (int j = 0; j < g; j++) {
            const float *pj = sc + (size_t)j * 64;
            __m512 x = _mm512_setzero_ps();
            for (int t = 0; t < 64; t += 16) {
                const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(pj + t), _mm512_loadu_ps(vsc + t));
                _mm512_storeu_ps(pv + (size_t)j * 64 + t, p);
                x = _mm512_max_ps(x, _mm512_abs_ps(p));
            }
            v[j] = x;
        }
        MQ_FN(kv_hred_)(v, g, 1, pb);
    }
#else
    for (int j = 0; j < g; j++) pb[j] = MQ_FN(kv_mul_absmax_)(sc + (size_t)j * 64, vsc, pv + (size_t)j * 64, 64);
#endif
    for (int j = 0; j < g; j++) {
        const float *pj = sc + (size_t)j * 64;
        const float b = pb[j];                                         /* p' >= 0 */
        uint8_t *po = p8 + (size_t)j * 64;
        if (b > 0.0f) {
            MQ_FN(kv_round8_)(pv + (size_t)j * 64, pmax / b, po, 64);
            e8[j] = b / pmax;
        } else {
            for (int t = 0; t < 64; t++) po[t] = 0;
            e8[j] = 0.0f;
        }
        if (!q4) {
            for (int t = 0; t < 64; t++) row[t] = pj[t] * vmn[t];
            vsum[j] = MQ_FN(kv_sum16_)(row);
        }
    }
    MQ_FN(kv_vdot_)(p8, g, Dh, vc, bits, isum);
    for (int j = 0; j < g; j++) {
        float *aj = acc + (size_t)j * Dh;
        const int32_t *ij = isum + (size_t)j * Dh;
        if (q4)
            for (int d = 0; d < Dh; d++) aj[d] = aj[d] * alpha[j] + (float)ij[d] * e8[j];
        else
            for (int d = 0; d < Dh; d++) aj[d] = aj[d] * alpha[j] + ((float)ij[d] * e8[j] + vsum[j]);
    }
}

/* Rows [r0, r1) of KV head kh (all its query heads, in passes of MQ_KV_GB); see misc.h. */
void MQ_FN(mq_kvattn_)(const mq_kvatt *a, int kh, int r0, int r1, float *scratch) {
    const int Dh = a->Dh, g = a->Hq / a->Hkv, G = 64;
    const float scale = (float)(1.0 / sqrt((double)Dh)) * MQ_KV_LOG2E;     /* scores in base 2 */
    const size_t nb = (size_t)(a->S / G), bb = (size_t)a->block_bytes;
    const uint16_t *kf = a->kf + (size_t)kh * a->S * Dh, *vf = a->vf + (size_t)kh * a->S * Dh;
    const uint8_t *pk = a->pk ? a->pk + (size_t)kh * nb * bb : NULL;
    /* scratch: per tile row: m [GB], L [GB][16], acc [GB][Dh]; then sc [GB][64], row [256], integer scratch */
    const size_t per_row = 17 * MQ_KV_GB + (size_t)MQ_KV_GB * Dh;
    float *sc = scratch + (size_t)MQ_KV_TR * per_row;
    float *row = sc + (size_t)MQ_KV_GB * 64;
    void *iscr = (void *)(row + 256);
    for (int j0 = 0; j0 < g; j0 += MQ_KV_GB) {
        const int gn = g - j0 < MQ_KV_GB ? g - j0 : MQ_KV_GB;
        for (int t0 = r0; t0 < r1; t0 += MQ_KV_TR) {
            const int tn = r1 - t0 < MQ_KV_TR ? r1 - t0 : MQ_KV_TR;
            int bmin = 1 << 30, bmax = 0;
            for (int r = 0; r < tn; r++) {
                float *st = scratch + (size_t)r * per_row;
                for (int j = 0; j < gn; j++) st[j] = -INFINITY;
                memset(st + MQ_KV_GB, 0, sizeof(float) * (size_t)16 * MQ_KV_GB);
                memset(st + 17 * MQ_KV_GB, 0, sizeof(float) * (size_t)gn * Dh);
                const int n = a->pos0 + t0 + r + 1;
                const int lo = a->window > 0 && n > a->window ? n - a->window : 0;
                bmin = lo / G < bmin ? lo / G : bmin;
                bmax = (n - 1) / G > bmax ? (n - 1) / G : bmax;
            }
            for (int b = bmin; b <= bmax; b++) {
                if (pk && b + MQ_KV_PF <= bmax) {                /* the block MQ_KV_PF ahead, into the cache */
                    const char *nx = (const char *)(pk + (size_t)(b + MQ_KV_PF) * bb);
                    for (size_t o = 0; o < bb; o += 64) __builtin_prefetch(nx + o, 0, 3);
                }
                for (int r = 0; r < tn; r++) {
                    const int n = a->pos0 + t0 + r + 1;
                    const int lo = a->window > 0 && n > a->window ? n - a->window : 0;
                    const int i0 = b * G > lo ? b * G : lo, i1 = (b + 1) * G < n ? (b + 1) * G : n;
                    if (i1 <= i0) continue;
                    float *st = scratch + (size_t)r * per_row;
                    const float *q = a->q + ((size_t)(t0 + r) * a->Hq + (size_t)kh * g + j0) * Dh;
                    if (pk && b >= 1 && b < n / G - MQ_KV_RECENT)
                        MQ_FN(kv_packed_block_)(q, gn, Dh, pk + (size_t)b * bb, a->bits, scale, st, st + MQ_KV_GB,
                                                st + 17 * MQ_KV_GB, sc, row, iscr);
                    else
                        MQ_FN(kv_f16_block_)(q, gn, Dh, kf + (size_t)i0 * Dh, vf + (size_t)i0 * Dh, i1 - i0, scale,
                                             st, st + MQ_KV_GB, st + 17 * MQ_KV_GB, sc, row);
                }
            }
            for (int r = 0; r < tn; r++) {
                const float *st = scratch + (size_t)r * per_row;
                float *o = a->out + ((size_t)(t0 + r) * a->Hq + (size_t)kh * g + j0) * Dh;
                for (int j = 0; j < gn; j++) {
                    const float l = MQ_FN(kv_ltree_)(st + MQ_KV_GB + (size_t)j * 16);
                    for (int d = 0; d < Dh; d++) o[(size_t)j * Dh + d] = st[17 * MQ_KV_GB + (size_t)j * Dh + d] / l;
                    if (pk && a->bits == 4) mq_kv_fwht(o + (size_t)j * Dh, Dh);     /* q4 values are rotated */
                }
            }
        }
    }
}
