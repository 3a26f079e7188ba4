/* The float ops' per-tier dispatch (tiers: misc_generic.c, misc_avx2.c, misc_avx512.c) and rope,
 * which has one portable version. */
#include <math.h>

#include "cpu.h"
#include "misc.h"

#define MQ_DECL(ret, name, args) ret name##generic args; ret name##avx2 args; ret name##avx512 args;
MQ_DECL(float, mq_expf_fast_, (float x))
MQ_DECL(void, mq_rmsnorm_, (const float *x, const float *w, float *y, int T, int D, float eps))
MQ_DECL(void, mq_silu_mul_, (const float *g, const float *u, float *y, size_t n))
MQ_DECL(void, mq_dot_rows_, (const float *w, const float *x, float *y, int N, int K, int T))
MQ_DECL(void, mq_hadamard_, (const float *x, float *y, const float *s, int T, int K, int b, float scale))
MQ_DECL(void, mq_softmax_rows_, (float *x, int rows, int n, int fast))
MQ_DECL(void, mq_softmax_causal_, (float *x, int n, int T, int pos0, int r0, int r1))
MQ_DECL(void, mq_attention_, (const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                              int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch))
MQ_DECL(void, mq_kvattn_, (const mq_kvatt *a, int kh, int r0, int r1, float *scratch))

#if defined(__x86_64__)
#define MQ_DISPATCH(name, ...) do { int isa_ = mq_isa_get(); \
    if (isa_ >= MQ_ISA_AVX512) return name##avx512(__VA_ARGS__); \
    if (isa_ >= MQ_ISA_AVX2) return name##avx2(__VA_ARGS__); \
    return name##generic(__VA_ARGS__); } while (0)
#else
#define MQ_DISPATCH(name, ...) return name##generic(__VA_ARGS__)
#endif

float mq_expf_fast(float x) { MQ_DISPATCH(mq_expf_fast_, x); }
void mq_rmsnorm(const float *x, const float *w, float *y, int T, int D, float eps) { MQ_DISPATCH(mq_rmsnorm_, x, w, y, T, D, eps); }
void mq_silu_mul(const float *g, const float *u, float *y, size_t n) { MQ_DISPATCH(mq_silu_mul_, g, u, y, n); }
void mq_dot_rows(const float *w, const float *x, float *y, int N, int K, int T) { MQ_DISPATCH(mq_dot_rows_, w, x, y, N, K, T); }
void mq_hadamard(const float *x, float *y, const float *s, int T, int K, int b, float scale) {
    MQ_DISPATCH(mq_hadamard_, x, y, s, T, K, b, scale);
}
void mq_softmax_rows(float *x, int rows, int n, int fast) { MQ_DISPATCH(mq_softmax_rows_, x, rows, n, fast); }
void mq_softmax_causal(float *x, int n, int T, int pos0, int r0, int r1) { MQ_DISPATCH(mq_softmax_causal_, x, n, T, pos0, r0, r1); }
void mq_attention(const float *q, const void *k, const void *v, int kv_f16, float *out, int T, int Hq, int Hkv,
                  int Dh, int S, int pos0, int h0, int h1, float *scratch) {
    MQ_DISPATCH(mq_attention_, q, k, v, kv_f16, out, T, Hq, Hkv, Dh, S, pos0, h0, h1, scratch);
}

void mq_kvattn(const mq_kvatt *a, int kh, int r0, int r1, float *scratch) { MQ_DISPATCH(mq_kvattn_, a, kh, r0, r1, scratch); }

void mq_rope(float *x, const int64_t *pos, int T, int H, int Dh, double theta) {
    int half = Dh / 2;
    double inv[512];
    float cs[512], sn[512];
    for (int i = 0; i < half && i < 512; i++) inv[i] = 1.0 / pow(theta, (double)(2 * i) / Dh);
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half && i < 512; i++) {
            double ang = (double)pos[t] * inv[i];
            cs[i] = (float)cos(ang); sn[i] = (float)sin(ang);
        }
        for (int h = 0; h < H; h++) {
            float *r = x + ((size_t)t * H + h) * Dh;
            for (int i = 0; i < half; i++) {
                float x1 = r[i], x2 = r[i + half];
                r[i] = x1 * cs[i] - x2 * sn[i];
                r[i + half] = x2 * cs[i] + x1 * sn[i];
            }
        }
    }
}
